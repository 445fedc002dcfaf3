#include "plan/tune.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "common/output_file.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "node/handshake.h"
#include "plan/measure.h"

namespace colibri {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

std::vector<std::string> TuneSetting::args(const std::vector<TuneKnob>& knobs) const {
  std::vector<std::string> out;
  for (size_t k = 0; k < knobs.size(); ++k) {
    const TuneValue& v = knobs[k].values[size_t(choice[k])];
    out.insert(out.end(), v.args.begin(), v.args.end());
  }
  return out;
}

std::map<std::string, std::string> TuneSetting::env(const std::vector<TuneKnob>& knobs) const {
  std::map<std::string, std::string> out;
  for (size_t k = 0; k < knobs.size(); ++k)
    for (const auto& [name, value] : knobs[k].values[size_t(choice[k])].env) out[name] = value;
  return out;
}

std::string TuneSetting::describe(const std::vector<TuneKnob>& knobs) const {
  std::string out;
  for (size_t k = 0; k < knobs.size(); ++k)
    if (choice[k] != 0)
      out += fmt::format("{}{}={}", out.empty() ? "" : " ", knobs[k].name,
                         knobs[k].values[size_t(choice[k])].label);
  return out.empty() ? "the defaults" : out;
}

namespace {

struct Medians {
  double tok_s = 0, p99_ms = 0, hit = 0;
};

Medians medians(const std::vector<TuneSample>& samples) {
  std::vector<double> tok, p99, hit;
  for (const TuneSample& s : samples) {
    tok.push_back(s.tok_s);
    p99.push_back(s.p99_ms);
    hit.push_back(s.hit_rate);
  }
  return {calibration::median(tok), calibration::median(p99), calibration::median(hit)};
}

// `runs` jobs of each setting in alternation (a, b, a, b, ...): both see the same drift.
std::pair<Medians, Medians> interleaved(const TuneSetting& a, const TuneSetting& b, int runs,
                                        const TuneMeasure& measure) {
  std::vector<TuneSample> sa, sb;
  for (int r = 0; r < runs; ++r) {
    sa.push_back(measure(a));
    sb.push_back(measure(b));
  }
  return {medians(sa), medians(sb)};
}

}  // namespace

TuneResult tune(const std::vector<TuneKnob>& knobs, const TuneMeasure& measure,
                const TuneGate& gate, const std::function<void(const std::string&)>& log) {
  TuneResult result;
  const TuneSetting baseline{std::vector<int>(knobs.size(), 0)};
  result.best = baseline;
  for (size_t k = 0; k < knobs.size(); ++k) {
    for (size_t v = 1; v < knobs[k].values.size(); ++v) {
      TuneSetting candidate = result.best;
      candidate.choice[k] = int(v);
      const auto [cand, inc] = interleaved(candidate, result.best, gate.runs, measure);
      TuneTrial t;
      t.knob = knobs[k].name;
      t.value = knobs[k].values[v].label;
      t.candidate_tok_s = cand.tok_s;
      t.incumbent_tok_s = inc.tok_s;
      t.candidate_p99_ms = cand.p99_ms;
      t.incumbent_p99_ms = inc.p99_ms;
      t.candidate_hit = cand.hit;
      t.incumbent_hit = inc.hit;
      const double gain = inc.tok_s > 0 ? cand.tok_s / inc.tok_s - 1 : 0;
      if (gain < gate.min_gain)
        t.why = fmt::format("{:+.1f} %: under the +{:.0f} % gate", 100 * gain, 100 * gate.min_gain);
      else if (cand.p99_ms > inc.p99_ms * (1 + gate.max_p99_growth))
        t.why = fmt::format("{:+.1f} %, but p99 {:.3f} ms against {:.3f}", 100 * gain, cand.p99_ms,
                            inc.p99_ms);
      else if (cand.hit < inc.hit - gate.max_hit_drop)
        t.why = fmt::format("{:+.1f} %, but hit rate {:.1f} % against {:.1f}", 100 * gain,
                            100 * cand.hit, 100 * inc.hit);
      else {
        t.kept = true;
        t.why = fmt::format("{:+.1f} %", 100 * gain);
        result.best = candidate;
      }
      log(fmt::format("  {}={}: {:.2f} against {:.2f} tok/s: {}{}", t.knob, t.value,
                      t.candidate_tok_s, t.incumbent_tok_s, t.kept ? "kept, " : "", t.why));
      result.trials.push_back(t);
    }
  }
  if (result.best.choice == baseline.choice) {
    result.saved = true;
    return result;
  }
  // The winner once more, against a final baseline, interleaved.
  const auto [best, base] = interleaved(result.best, baseline, gate.runs, measure);
  result.final_best_tok_s = best.tok_s;
  result.final_baseline_tok_s = base.tok_s;
  result.saved = best.tok_s >= base.tok_s * (1 + gate.min_gain);
  log(fmt::format("  re-run: {} {:.2f} against the defaults {:.2f} tok/s: {}",
                  result.best.describe(knobs), best.tok_s, base.tok_s,
                  result.saved ? "holds" : "does not hold its gain; the defaults stay"));
  if (!result.saved) result.best = baseline;
  return result;
}

std::vector<TuneKnob> default_tune_knobs(int cores_per_rank, bool heat_placement) {
  std::vector<TuneKnob> knobs = {
      {"wire", {{"f32", {}, {}}, {"bf16", {"--wire", "bf16"}, {}}}},
      {"shared-memory", {{"on", {}, {}}, {"off", {"--shared-memory", "off"}, {}}}},
      {"activations",
       {{"default", {}, {}},
        {"int8", {"--activations", "int8"}, {}},
        {"f32", {"--activations", "f32"}, {}}}},
      {"split-linears", {{"off", {}, {}}, {"on", {"--split-linears"}, {}}}},
      {"prefetch-ahead", {{"off", {}, {}}, {"on", {"--prefetch-ahead"}, {}}}},
  };
  TuneKnob threads{"threads", {{"default", {}, {}}}};
  for (int t = 1; t <= cores_per_rank; t *= 2)
    threads.values.push_back({std::to_string(t), {}, {{"OMP_NUM_THREADS", std::to_string(t)}}});
  if (threads.values.size() > 1) knobs.push_back(threads);
  if (heat_placement)
    knobs.push_back(
        {"replicas",
         {{"0", {}, {}}, {"2", {"--replicas", "2"}, {}}, {"8", {"--replicas", "8"}, {}}}});
  return knobs;
}

std::string default_tune_path() {
  if (const char* xdg = std::getenv("XDG_CONFIG_HOME"); xdg && *xdg)
    return (fs::path(xdg) / "colibri-node" / "tune.json").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home && *home ? home : ".") / ".config" / "colibri-node" / "tune.json").string();
}

namespace {

// FNV-1a of a file's bytes, as hex ("" when it cannot be read).
std::string file_hash(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  uint64_t h = kFnvOffset;
  std::vector<char> block(1 << 20);
  while (in) {
    in.read(block.data(), std::streamsize(block.size()));
    h = fnv1a(h, std::string_view(block.data(), size_t(in.gcount())));
  }
  return fmt::format("{:016x}", h);
}

// What a tuned profile holds for: the binary, the model, the job's ranks and hosts, the devices.
json fingerprint(const std::string& model, int np, const std::string& layout,
                 const std::string& hostfile) {
  const ModelConfig config = load_model_config(model);
  const Checkpoint checkpoint(model, config.fp8_block, config.int4_group_size);
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  return {{"binary", file_hash("/proc/self/exe")},
          {"model", fmt::format("{:016x}", model_hash(model, checkpoint))},
          {"topology",
           layout.empty() ? fmt::format("np {}", np) : fmt::format("layout {}", file_hash(layout))},
          {"hosts", hostfile.empty() ? "this host" : "hostfile " + file_hash(hostfile)},
          {"devices", fmt::format("{} x{} CUDA_VISIBLE_DEVICES={}", calibration::cpu_model(),
                                  std::thread::hardware_concurrency(), visible ? visible : "")}};
}

// The fields in which two fingerprints differ, "" when none.
std::string difference(const json& a, const json& b) {
  std::string out;
  for (const auto& [key, value] : a.items())
    if (!b.contains(key) || b[key] != value) out += (out.empty() ? "" : ", ") + key;
  return out;
}

struct JobSpec {
  std::string launcher, node, model, text, layout, hostfile;
  int np = 0;
  std::vector<std::string> extra;
  double timeout_s = 600;
};

// One job: the launcher with the setting's arguments and environment, teacher-forcing the text.
TuneSample run_job(const JobSpec& spec, const std::vector<TuneKnob>& knobs,
                   const TuneSetting& setting, const fs::path& scratch) {
  const fs::path err_path = scratch / "job.err", profile = scratch / "profile.json";
  std::vector<std::string> argv = {spec.launcher};
  if (!spec.layout.empty()) argv.insert(argv.end(), {"--layout", spec.layout});
  if (spec.np > 0) argv.insert(argv.end(), {"--np", std::to_string(spec.np)});
  if (!spec.hostfile.empty()) argv.insert(argv.end(), {"--hostfile", spec.hostfile});
  argv.insert(argv.end(), {"--", "--model", spec.model, "--score", spec.text, "--max-rows", "1",
                           "--profile-json", profile.string()});
  const std::vector<std::string> args = setting.args(knobs);
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), spec.extra.begin(), spec.extra.end());
  const std::map<std::string, std::string> env = setting.env(knobs);
  std::error_code ec;
  fs::remove(profile, ec);
  const pid_t pid = fork();
  if (pid < 0) fail("tune: fork: {}", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    const int out = ::open("/dev/null", O_WRONLY);
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out >= 0) dup2(out, STDOUT_FILENO);
    if (err >= 0) dup2(err, STDERR_FILENO);
    setenv("COLIBRI_NODE", spec.node.c_str(), 1);
    for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
    std::vector<char*> c_argv;
    for (const std::string& a : argv) c_argv.push_back(const_cast<char*>(a.c_str()));
    c_argv.push_back(nullptr);
    execvp(c_argv[0], c_argv.data());
    std::fprintf(stderr, "tune: cannot run %s: %s\n", c_argv[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
        spec.timeout_s) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      fail("tune: a job ({}) ran past --job-timeout {} s and was stopped", setting.describe(knobs),
           spec.timeout_s);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::stringstream err_text;
  err_text << std::ifstream(err_path).rdbuf();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail("tune: the job with {} failed:\n{}", setting.describe(knobs), err_text.str());
  static const std::regex line(
      R"(score \d+ tok in \d+ forward calls, [0-9.]+ s \(([0-9.]+) tok/s\) \| call p50 [0-9.]+ ms p99 ([0-9.]+) ms)");
  std::smatch m;
  const std::string text = err_text.str();
  if (!std::regex_search(text, m, line))
    fail("tune: the job with {} printed no score line:\n{}", setting.describe(knobs), text);
  TuneSample sample;
  sample.tok_s = std::stod(m[1]);
  sample.p99_ms = std::stod(m[2]);
  std::ifstream in(profile);
  const json doc = json::parse(in, nullptr, false);
  double hits = 0, misses = 0;
  if (!doc.is_discarded() && doc.contains("ranks"))
    for (const json& r : doc["ranks"]) {
      for (const char* key : {"pinned_hits", "ram_hits", "vram_hits"}) hits += r.value(key, 0.0);
      misses += r.value("disk_hits", 0.0);
    }
  sample.hit_rate = hits + misses > 0 ? hits / (hits + misses) : 1.0;
  return sample;
}

std::string default_launcher() {
  if (const char* env = std::getenv("COLIBRI_LAUNCH"); env && *env) return env;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path beside = self.parent_path().parent_path().parent_path() / "launch" /
                            "colibri-launch";  // build/src/colibri-node in the repository
    if (fs::exists(beside)) return beside.string();
  }
  return "colibri-launch";
}

json read_profiles(const std::string& path) {
  std::ifstream in(path);
  if (!in) return json{{"version", 1}, {"profiles", json::array()}};
  json doc = json::parse(in, nullptr, false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("profiles") ||
      !doc["profiles"].is_array())
    fail("tune: {} is not a tune profile file (colibri-node tune writes one)", path);
  return doc;
}

// What `tune`'s flags set.
struct TuneArgs {
  std::string model, layout, hostfile, text, out = default_tune_path(), launcher, only;
  int np = 0;
  bool apply = false;
  TuneGate gate;
  double timeout_s = 600;
  std::vector<std::string> extra;
};

void add_tune_flags(CLI::App& app, TuneArgs& a) {
  app.add_option("--model", a.model, "model directory")->required();
  app.add_option("--np", a.np, "ranks (the plain mpirun -np N), or --layout");
  app.add_option("--layout", a.layout, "layout file");
  app.add_option("--hostfile", a.hostfile, "hostfile (several hosts)");
  app.add_option("--text", a.text, "the text every job teacher-forces (a few hundred tokens)");
  app.add_option("--runs", a.gate.runs, "jobs per setting in each comparison")
      ->capture_default_str()
      ->check(CLI::Range(1, 99));
  app.add_option("--min-gain", a.gate.min_gain, "least median gain that keeps a candidate")
      ->capture_default_str();
  app.add_option("--knobs", a.only, "comma-separated subset of the knobs to sweep");
  app.add_option("--out", a.out, "profile file")->capture_default_str();
  app.add_option("--launcher", a.launcher, "colibri-launch (default: the repository's)");
  app.add_option("--job-timeout", a.timeout_s, "seconds a job may run")->capture_default_str();
  app.add_flag("--apply", a.apply,
               "print the saved setting for this job (`arg A` and `env NAME=VALUE` lines), or "
               "say on stderr why there is none");
  app.add_option("node_args", a.extra, "after --: colibri-node arguments every job gets");
}

// --apply: prints the saved setting whose fingerprint is this job's, or says on stderr why none.
int apply_profile(const json& print, const json& profiles, const std::string& out) {
  std::string why = fmt::format("no tuned profile in {}", out);
  for (const json& p : profiles["profiles"]) {
    const std::string diff = difference(print, p["fingerprint"]);
    if (diff.empty()) {
      for (const json& a : p["args"]) std::printf("arg %s\n", a.get<std::string>().c_str());
      for (const auto& [name, value] : p["env"].items())
        std::printf("env %s=%s\n", name.c_str(), value.get<std::string>().c_str());
      return 0;
    }
    why = fmt::format("the tuned profile in {} is for another {}; not applied", out, diff);
  }
  std::fprintf(stderr, "colibri-node tune: %s\n", why.c_str());
  return 0;
}

// The knobs to sweep: every one (replicas too when the jobs run --placement heat), or --knobs'.
std::vector<TuneKnob> knobs_to_sweep(const TuneArgs& a) {
  const int ranks = a.np > 0 ? a.np : 2;
  bool heat = false;  // the jobs run --placement heat: replicas are a knob too
  for (size_t i = 0; i < a.extra.size(); ++i)
    heat = heat || a.extra[i] == "--placement=heat" ||
           (a.extra[i] == "--placement" && i + 1 < a.extra.size() && a.extra[i + 1] == "heat");
  std::vector<TuneKnob> knobs =
      default_tune_knobs(std::max(1, int(std::thread::hardware_concurrency()) / ranks), heat);
  if (a.only.empty()) return knobs;
  std::vector<TuneKnob> chosen;
  std::stringstream names(a.only);
  for (std::string name; std::getline(names, name, ',');) {
    const auto it =
        std::find_if(knobs.begin(), knobs.end(), [&](const TuneKnob& k) { return k.name == name; });
    if (it == knobs.end()) fail("--knobs: '{}' is not a knob", name);
    chosen.push_back(*it);
  }
  return chosen;
}

// The sweep's jobs in a scratch directory removed at the end; prints each comparison.
TuneResult run_sweep(const JobSpec& spec, const std::vector<TuneKnob>& knobs,
                     const TuneGate& gate) {
  char scratch_template[] = "/tmp/colibri-tune-XXXXXX";
  if (!mkdtemp(scratch_template)) fail("tune: cannot make a scratch directory");
  const fs::path scratch = scratch_template;
  struct Remove {
    fs::path p;
    ~Remove() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } remove{scratch};
  fmt::print(
      "tune: {} knob(s), {} job(s) per setting and comparison, gate +{:.0f} % median, "
      "p99 within {:.0f} %, hit rate within {:.1f} points\n",
      knobs.size(), gate.runs, 100 * gate.min_gain, 100 * gate.max_p99_growth,
      100 * gate.max_hit_drop);
  std::fflush(stdout);
  return tune(
      knobs, [&](const TuneSetting& s) { return run_job(spec, knobs, s, scratch); }, gate,
      [](const std::string& line) {
        fmt::print("{}\n", line);
        std::fflush(stdout);
      });
}

// The profile of this job: its fingerprint, the date, the setting that won and every trial.
json profile_entry(const json& print, const TuneResult& result,
                   const std::vector<TuneKnob>& knobs) {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  json entry = {{"fingerprint", print},
                {"date", date},
                {"setting", result.best.describe(knobs)},
                {"args", result.best.args(knobs)},
                {"env", result.best.env(knobs)},
                {"final_tok_s", result.final_best_tok_s},
                {"final_baseline_tok_s", result.final_baseline_tok_s},
                {"trials", json::array()}};
  for (const TuneTrial& t : result.trials)
    entry["trials"].push_back({{"knob", t.knob},
                               {"value", t.value},
                               {"tok_s", t.candidate_tok_s},
                               {"incumbent_tok_s", t.incumbent_tok_s},
                               {"p99_ms", t.candidate_p99_ms},
                               {"incumbent_p99_ms", t.incumbent_p99_ms},
                               {"kept", t.kept},
                               {"why", t.why}});
  return entry;
}

// Sweeps the knobs and saves what wins in --out, in place of an earlier profile of this job.
int run_tune(const TuneArgs& a, const json& print, json profiles) {
  if (a.text.empty()) fail("tune: --text FILE is needed (the text every job teacher-forces)");
  fs::create_directories(fs::path(a.out).parent_path().empty() ? fs::path(".")
                                                               : fs::path(a.out).parent_path());
  check_output_path(a.out, "--out");
  JobSpec spec;
  spec.launcher = a.launcher.empty() ? default_launcher() : a.launcher;
  spec.node = fs::read_symlink("/proc/self/exe").string();
  spec.model = a.model;
  spec.text = fs::absolute(a.text).string();
  spec.layout = a.layout;
  spec.hostfile = a.hostfile;
  spec.np = a.np;
  spec.extra = a.extra;
  spec.timeout_s = a.timeout_s;
  const std::vector<TuneKnob> knobs = knobs_to_sweep(a);
  const TuneResult result = run_sweep(spec, knobs, a.gate);
  json kept = json::array();
  for (const json& p : profiles["profiles"])
    if (!difference(print, p["fingerprint"]).empty()) kept.push_back(p);
  kept.push_back(profile_entry(print, result, knobs));
  profiles["profiles"] = kept;
  write_file_atomically(a.out, [&](std::FILE* f) { fmt::print(f, "{}\n", profiles.dump(2)); });
  fmt::print("tune: {} saved in {} (colibri-launch --auto-tier applies it)\n",
             result.best.describe(knobs), a.out);
  return 0;
}

}  // namespace

int tune_main(int argc, char** argv) {
  CLI::App app{
      "colibri-node tune: sweep execution knobs (wire, shared memory, activations, split "
      "linears, prefetch, threads) on this machine, teacher-forcing one text, and save what wins "
      "for colibri-launch --auto-tier. --apply prints the saved setting for this job."};
  TuneArgs a;
  add_tune_flags(app, a);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if ((a.np > 0) == !a.layout.empty()) fail("tune: give --np N or --layout FILE (one of them)");
    const json print = fingerprint(a.model, a.np, a.layout, a.hostfile);
    json profiles = read_profiles(a.out);
    if (a.apply) return apply_profile(print, profiles, a.out);
    return run_tune(a, print, std::move(profiles));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri-node tune: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace colibri
