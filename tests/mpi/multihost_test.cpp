// colibri-node across hosts: a head and three host namespaces made by launch/netns-hosts.sh,
// `mpirun -np 7` across them over Open MPI's TCP transport only (the coordinator and an expert
// rank on the head, then 2, 2 and 1 expert ranks on the hosts). The distributed logits equal the
// single process's within 1e-5 on a GLM-5 and a DeepSeek-V3 parity model; faults on another host
// end every process of the job within 10 s, non-zero, with a line naming rank@host. Skipped, with
// the reason, where namespaces cannot be made. Each test binary run has its own set of namespaces
// (named after its pid), taken down at the end, also after failures; sets left by a killed run are
// removed by the next (`gc`).
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "common/npy.h"
#include "mpirun_job.h"

namespace colibri {
namespace {

using namespace colibri::test;  // NOLINT(google-build-using-namespace): the job helpers

const fs::path kScript = fs::path(COLIBRI_SOURCE_DIR) / "launch" / "netns-hosts.sh";
const fs::path kParityDir = fs::path(COLIBRI_TEST_DATA) / "parity";
constexpr int kHosts = 3;
constexpr int kRanks = 7;  // ranks 0 and 1 on the head, 2i and 2i+1 on host i (6 on host 3)
// Every process of a job is gone within this of a fault.
constexpr double kFaultLimitSeconds = 10;

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// Runs a shell command with a hard limit of 60 s (timeout(1)), returning its output.
CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen(("timeout -s KILL 60 " + command + " 2>&1").c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe))
    result.output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

std::string quoted(const std::string& word) {
  return "'" + std::regex_replace(word, std::regex("'"), "'\\''") + "'";
}

class Multihost : public ::testing::Test {
 protected:
  static std::string name_;         // of this run's set of namespaces
  static std::string skip_reason_;  // why the namespaces cannot be made here
  static std::string up_error_;     // why making them failed where they should have been made

  static fs::path state_dir() { return fs::path("/run/colibri-netns") / name_; }
  static fs::path mpirun() { return state_dir() / "mpirun"; }
  static std::string host(int i) { return name_ + (i == 0 ? "-head" : "-h" + std::to_string(i)); }
  static std::string host_of_rank(int rank) { return host(rank < 2 ? 0 : rank / 2); }

  static void SetUpTestSuite() {
    name_ = "cmh" + std::to_string(::getpid());
    if (::geteuid() != 0) {
      skip_reason_ = "making network namespaces needs root";
      return;
    }
    run_command("bash " + quoted(kScript.string()) + " gc");
    const CommandResult up =
        run_command("env COLIBRI_NETNS_OWNER=" + std::to_string(::getpid()) + " bash " +
                    quoted(kScript.string()) + " up " + std::to_string(kHosts) +
                    " --head-slots 2 --name " + name_);
    if (up.exit_code == 77) {
      skip_reason_ = up.output;
    } else if (up.exit_code != 0) {
      up_error_ =
          "netns-hosts.sh up failed (exit " + std::to_string(up.exit_code) + "): " + up.output;
    }
  }

  static void TearDownTestSuite() {
    if (skip_reason_.empty())
      run_command("bash " + quoted(kScript.string()) + " down --name " + name_);
  }

  void SetUp() override {
    if (!skip_reason_.empty()) GTEST_SKIP() << skip_reason_;
    ASSERT_TRUE(up_error_.empty()) << up_error_;
  }

  // Processes left in any namespace of the set ("NS: pids" per namespace with some).
  static std::string namespace_processes() {
    std::string left;
    for (int i = 0; i <= kHosts; ++i) {
      const CommandResult pids = run_command("ip netns pids " + host(i));
      if (!pids.output.empty()) left += host(i) + ": " + pids.output;
    }
    return left;
  }

  // `mpirun -np 7 colibri-node ARGS` across the hosts.
  static JobResult run_across_hosts(const std::vector<std::string>& node_args,
                                    const std::map<std::string, std::string>& env = {},
                                    const JobAction* action = nullptr) {
    std::vector<std::string> args = {mpirun().string(), "-np", std::to_string(kRanks),
                                     COLIBRI_NODE_BINARY};
    args.insert(args.end(), node_args.begin(), node_args.end());
    return run_job(args, env, action);
  }
};

std::string Multihost::name_;
std::string Multihost::skip_reason_;
std::string Multihost::up_error_;

std::string prompt_of(const std::string& fixture) {
  const json meta = read_json(kParityDir / fixture / "golden" / "meta.json");
  std::string prompt;
  for (int id : meta.at("prompt_ids").get<std::vector<int>>())
    prompt += (prompt.empty() ? "" : ",") + std::to_string(id);
  return prompt;
}

std::vector<std::string> generate_args(const std::string& fixture, int ngen) {
  return {"--model",      (kParityDir / fixture / "model").string(),
          "--prompt-ids", prompt_of(fixture),
          "--ngen",       std::to_string(ngen),
          "--ignore-eos"};
}

// The lines of stderr that report an error of ours ("[rank r@host] error: ...").
std::vector<std::string> error_lines(const JobResult& r) {
  std::vector<std::string> lines;
  for (std::string line : lines_of(r.err)) {
    while (line.rfind("> ", 0) == 0) line.erase(0, 2);  // after a --chat prompt
    if (line.rfind("[rank ", 0) == 0 && line.find("] error: ") != std::string::npos)
      lines.push_back(line);
  }
  return lines;
}

// ---- equal to the single process ---------------------------------------------------------------

// Fixture, --combine: star (every owner replies to the coordinator) or host (the expert ranks of
// a host sum their partials at the lowest of them: ranks 2+3 and 4+5 here), --placement, and
// whether a layout gives the coordinator a RAM budget, so that it owns routed experts too, and
// --split-linears (the coordinator's linears split by rows across the six expert ranks too).
using EqualityCase = std::tuple<std::string, std::string, std::string, bool, bool>;
class MultihostEquality : public Multihost, public ::testing::WithParamInterface<EqualityCase> {};

TEST_P(MultihostEquality, LogitsEqualTheSingleProcess) {
  const auto& [fixture, combine, placement, coordinator_experts, split_linears] = GetParam();
  const ScratchDir dir;
  std::vector<std::string> layout_args;
  if (coordinator_experts) {
    const fs::path layout = dir.path() / "coordinator-experts.layout";
    std::ofstream out(layout);
    out << "0 coordinator - - 1\n";
    for (int rank = 1; rank < kRanks; ++rank) out << rank << " cpu-expert - - 2\n";
    out.close();
    ASSERT_TRUE(out) << layout;
    layout_args = {"--layout", layout.string()};
  }
  const int ngen = 4;
  std::vector<std::string> one_args = generate_args(fixture, ngen);
  one_args.insert(one_args.end(), {"--logits-out", (dir.path() / "one.npy").string()});
  const JobResult one = run_job([&] {
    std::vector<std::string> args = {COLIBRI_NODE_BINARY};
    args.insert(args.end(), one_args.begin(), one_args.end());
    return args;
  }());
  expect_clean_end(one);
  ASSERT_EQ(one.exit_code, 0) << describe(one);

  std::vector<std::string> job_args = generate_args(fixture, ngen);
  job_args.insert(job_args.end(),
                  {"--logits-out", (dir.path() / "seven.npy").string(), "--print-placement",
                   "--rank-timeout", "30", "--combine", combine, "--placement", placement});
  job_args.insert(job_args.end(), layout_args.begin(), layout_args.end());
  if (split_linears) job_args.push_back("--split-linears");
  const JobResult job = run_across_hosts(job_args);
  expect_clean_end(job);
  ASSERT_EQ(job.exit_code, 0) << describe(job);

  // The ranks ran on their hosts: the profile table's host column ("  3  cpu-expert  NAME-h2").
  for (int rank = 0; rank < kRanks; ++rank) {
    const std::regex row("\\n *" + std::to_string(rank) + " +(coordinator|cpu-expert) +" +
                         regex_escape(host_of_rank(rank)) + " ");
    EXPECT_TRUE(std::regex_search(job.err, row))
        << "rank " << rank << " not on " << host_of_rank(rank) << "\n"
        << describe(job);
  }
  if (coordinator_experts) {
    EXPECT_TRUE(
        std::regex_search(job.err, std::regex("\\n  rank +0 coordinator +[1-9][0-9]* experts")))
        << "the coordinator owns no routed expert\n"
        << describe(job);
  }
  if (split_linears) {  // the memory lines: the coordinator's count, each expert rank's rows
    EXPECT_TRUE(std::regex_search(job.err, std::regex(" [1-9][0-9]* linears split by rows")))
        << describe(job);
    for (int rank = 1; rank < kRanks; ++rank)
      EXPECT_TRUE(std::regex_search(
          job.err, std::regex("rank " + std::to_string(rank) + "@[^\n]*rows of split linears")))
          << "rank " << rank << "\n"
          << describe(job);
  }
  const std::vector<int> tokens = parse_tokens(job.out);
  EXPECT_EQ(tokens.size(), size_t(ngen)) << describe(job);
  EXPECT_EQ(tokens, parse_tokens(one.out)) << describe(job);

  const NpyArray a = read_npy_f32(dir.path() / "one.npy");
  const NpyArray b = read_npy_f32(dir.path() / "seven.npy");
  ASSERT_EQ(a.shape, b.shape);
  ASSERT_EQ(a.shape.size(), 2u);
  ASSERT_EQ(a.data.size(), b.data.size());
  float max_diff = 0, max_abs = 0;
  for (size_t i = 0; i < a.data.size(); ++i) {
    ASSERT_TRUE(std::isfinite(b.data[i])) << "logit " << i;
    max_diff = std::max(max_diff, std::abs(a.data[i] - b.data[i]));
    max_abs = std::max(max_abs, std::abs(a.data[i]));
  }
  EXPECT_GT(max_abs, 0.1f) << "logits near zero: the comparison would pass vacuously";
  EXPECT_LE(max_diff, 1e-5f) << fixture << ": " << a.shape[0] << " positions";
  RecordProperty("max_abs_diff", std::to_string(max_diff));
  // The coordinator's count of the bytes that crossed hosts (profile table).
  std::smatch crossed;
  ASSERT_TRUE(std::regex_search(job.err, crossed,
                                std::regex("rank 0: [^\n]*\\(([0-9]+) bytes\\) crossed hosts")))
      << describe(job);
  RecordProperty("bytes_cross_host", crossed[1].str());
  std::printf(
      "[%s --combine %s --placement %s%s%s] max |logit diff| %.3g, %s bytes crossed hosts\n",
      fixture.c_str(), combine.c_str(), placement.c_str(),
      coordinator_experts ? ", coordinator owns experts" : "",
      split_linears ? ", split linears" : "", max_diff, crossed[1].str().c_str());
  // --print-placement: a line per host (the head's two ranks, two on hosts 1 and 2, one on 3).
  for (int h = 0; h <= kHosts; ++h) {
    const int ranks = h == 3 ? 1 : 2;
    EXPECT_TRUE(
        std::regex_search(job.err, std::regex("\\n  host " + regex_escape(host(h)) + " +" +
                                              std::to_string(ranks) + " ranks +[0-9]+ experts")))
        << host(h) << "\n"
        << describe(job);
  }
}

INSTANTIATE_TEST_SUITE_P(ParityModels, MultihostEquality,
                         ::testing::Values(EqualityCase{"glm5", "star", "balanced", false, false},
                                           EqualityCase{"glm5", "host", "balanced", false, false},
                                           EqualityCase{"dsv3", "star", "balanced", false, false},
                                           EqualityCase{"dsv3", "host", "balanced", false, false},
                                           EqualityCase{"dsv3", "star", "hosts", false, false},
                                           EqualityCase{"dsv3", "host", "hosts", false, false},
                                           EqualityCase{"glm5", "host", "balanced", true, false},
                                           EqualityCase{"dsv3", "host", "hosts", true, false},
                                           EqualityCase{"glm5", "star", "balanced", false, true},
                                           EqualityCase{"dsv3", "host", "hosts", true, true}),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) + "_" +
                                  std::get<1>(param_info.param) + "_" +
                                  std::get<2>(param_info.param) +
                                  (std::get<3>(param_info.param) ? "_coordinator_experts" : "") +
                                  (std::get<4>(param_info.param) ? "_split_linears" : "");
                         });

// ---- faults on another host --------------------------------------------------------------------

// The faulting expert ranks: rank 4 on host 2, rank 1 beside the coordinator on the head.
constexpr int kFaultLayer = 2;  // an MoE layer of the GLM-5 parity model
// Requests for that layer: the prompt's (one), then one per decode step: the third is decode.
constexpr int kFaultRequest = 3;

// Every process of the job gone within kFaultLimitSeconds of the fault, exit non-zero, nothing
// left in any namespace.
void expect_ended_after_fault(const JobResult& r, double seconds_after_fault,
                              const std::string& left_in_namespaces) {
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_GT(seconds_after_fault, 0) << describe(r);
  EXPECT_LT(seconds_after_fault, kFaultLimitSeconds) << describe(r);
  EXPECT_TRUE(left_in_namespaces.empty()) << "left running: " << left_in_namespaces;
  std::printf("fault to every process gone: %.2f s\n", seconds_after_fault);
  ::testing::Test::RecordProperty("seconds_after_fault", std::to_string(seconds_after_fault));
}

// The fault matrix: {kill -9, SIGSTOP, abort, exit(1)} x {the coordinator (rank 0 on the head),
// an expert rank on another host (rank 4 on host 2)} x {start-up, weight loading, prefill, decode,
// idle}, and kill and stop of the expert rank beside the coordinator (rank 1) in decode and idle.
// Faults inside the program come from COLIBRI_TEST_FAULT (expert ranks only in prefill and decode);
// the coordinator in decode and either role while the coordinator idles in --chat get the signal
// from the test (exit(1) cannot be sent, so those cells are absent). Every cell: every process of
// the job gone within 10 s of the fault, exit non-zero, nothing left in any namespace, and the rank
// named: by mpirun for a death ("process rank 4 ... on node NAME-h2 exited on signal 9"; for
// exit(1) Open MPI names the rank without its host, and the rank's own line its host), by one
// error line for a stop.
enum class Kind { kKill, kStop, kAbort, kExit };
enum class Phase { kStartup, kLoad, kPrefill, kDecode, kIdle };

struct Cell {
  Kind kind;
  int rank;
  Phase phase;
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kKill:
      return "kill";
    case Kind::kStop:
      return "stop";
    case Kind::kAbort:
      return "abort";
    case Kind::kExit:
      return "exit";
  }
  return "?";
}
const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kStartup:
      return "startup";
    case Phase::kLoad:
      return "load";
    case Phase::kPrefill:
      return "prefill";
    case Phase::kDecode:
      return "decode";
    case Phase::kIdle:
      return "idle";
  }
  return "?";
}
int signal_of(Kind k) {
  return k == Kind::kKill ? SIGKILL : k == Kind::kStop ? SIGSTOP : k == Kind::kAbort ? SIGABRT : 0;
}

std::vector<Cell> fault_cells() {
  std::vector<Cell> cells;
  for (Kind kind : {Kind::kKill, Kind::kStop, Kind::kAbort, Kind::kExit}) {
    for (int rank : {0, 1, 4}) {
      for (Phase phase :
           {Phase::kStartup, Phase::kLoad, Phase::kPrefill, Phase::kDecode, Phase::kIdle}) {
        // The expert rank beside the coordinator: kill and stop, in decode and idle.
        if (rank == 1 && ((kind != Kind::kKill && kind != Kind::kStop) ||
                          (phase != Phase::kDecode && phase != Phase::kIdle)))
          continue;
        const bool internal = phase == Phase::kStartup || phase == Phase::kLoad ||
                              (rank != 0 && (phase == Phase::kPrefill || phase == Phase::kDecode));
        const bool external = phase == Phase::kIdle || (rank == 0 && phase == Phase::kDecode);
        if (!internal && !(external && kind != Kind::kExit)) continue;
        cells.push_back({kind, rank, phase});
      }
    }
  }
  return cells;
}

class MultihostFault : public Multihost, public ::testing::WithParamInterface<Cell> {};

TEST_P(MultihostFault, EndsTheJobAndNamesTheRank) {
  const Cell c = GetParam();
  const std::string rank = std::to_string(c.rank);
  // A stop is found by a deadline: short ones. A death is for mpirun to report: deadlines that
  // cannot fire first.
  const bool stop = c.kind == Kind::kStop;
  const std::string rank_timeout = stop ? "1" : "30", startup_timeout = stop ? "2" : "30";
  std::vector<std::string> args;
  std::map<std::string, std::string> env;
  std::optional<JobAction> action;
  const auto signal_rank = [&](const std::string& after_output, double delay_s) {
    const int r = c.rank, signal = signal_of(c.kind);
    action = JobAction{after_output, delay_s, [r, signal](pid_t session, int&) {
                         const pid_t pid = rank_pid(session, r);
                         ASSERT_GT(pid, 0) << "no process for rank " << r;
                         ::kill(pid, signal);
                       }};
  };
  if (c.phase == Phase::kIdle) {
    // --chat with stdin held open: the coordinator idles at its prompt.
    args = {"--model", COLIBRI_EMBEDDED_MODEL, "--chat", "--quiet"};
    signal_rank("> ", 0.5);
  } else if (c.rank == 0 && c.phase == Phase::kDecode) {
    // A long decode; the signal just after the first token.
    args = generate_args("glm5", 3000);
    const json meta = read_json(kParityDir / "glm5" / "golden" / "meta.json");
    signal_rank(std::to_string(meta.at("greedy_ids").at(0).get<int>()) + " ", 0.2);
  } else {
    args = generate_args("glm5", 8);
    std::string where = phase_name(c.phase);
    if (c.phase == Phase::kPrefill) where = std::to_string(kFaultLayer) + ":1";
    if (c.phase == Phase::kDecode)
      where = std::to_string(kFaultLayer) + ":" + std::to_string(kFaultRequest);
    env["COLIBRI_TEST_FAULT"] = std::string(kind_name(c.kind)) + ":" + rank + ":" + where;
  }
  args.insert(args.end(), {"--rank-timeout", rank_timeout, "--startup-timeout", startup_timeout});
  const JobResult r = run_across_hosts(args, env, action ? &*action : nullptr);

  double seconds_after_fault = -1;
  if (action) {
    ASSERT_GT(r.action_elapsed_s, 0) << "the fault was not injected\n" << describe(r);
    seconds_after_fault = r.elapsed_s - r.action_elapsed_s;
  } else {
    const std::regex announced(
        c.kind == Kind::kExit ? "test fault: rank " + rank + " exits with status 1 at ([0-9.]+)"
                              : "test fault: rank " + rank + " raises signal " +
                                    std::to_string(signal_of(c.kind)) + " at ([0-9.]+)");
    std::smatch match;
    ASSERT_TRUE(std::regex_search(r.combined, match, announced)) << describe(r);
    seconds_after_fault = r.reaped_unix_s - std::stod(match[1]);
  }
  expect_ended_after_fault(r, seconds_after_fault, namespace_processes());

  const std::string fault_host = host_of_rank(c.rank);
  const std::vector<std::string> lines = error_lines(r);
  if (c.kind == Kind::kStop) {
    ASSERT_EQ(lines.size(), 1u) << describe(r);
    std::string expected;
    if (c.phase == Phase::kStartup) {
      // The first step exchanges the hosts; the host comes from the early host messages.
      expected =
          "rank " + rank + "@" + regex_escape(fault_host) + " is silent: did not reach start-up";
    } else if (c.phase == Phase::kLoad) {
      expected =
          "rank " + rank + "@" + regex_escape(fault_host) + " is silent: did not reach start-up";
    } else if (c.rank == 0) {
      expected = "coordinator rank 0@" + regex_escape(fault_host) +
                 " is silent: no request or heartbeat within 1.0 s";
    } else if (c.phase == Phase::kIdle) {
      expected = "rank " + rank + "@" + regex_escape(fault_host) +
                 " is silent: no answer to the coordinator's heartbeats within 1.0 s";
    } else {
      expected =
          "rank " + rank + "@" + regex_escape(fault_host) + " is silent: no reply within 1.0 s";
    }
    // The reporter: the coordinator, or the first expert rank for a silent coordinator.
    const std::string reporter = c.rank == 0 ? "rank 1@" + host_of_rank(1) : "rank 0@" + host(0);
    EXPECT_TRUE(std::regex_search(
        lines[0], std::regex("^\\[" + regex_escape(reporter) + "\\] error: " + expected)))
        << lines[0];
  } else if (c.kind == Kind::kExit) {
    // exit(1) before MPI_Finalize: the rank says so itself, with its host (Open MPI names the
    // rank only).
    ASSERT_EQ(lines.size(), 1u) << describe(r);
    EXPECT_TRUE(
        std::regex_search(lines[0], std::regex("^\\[rank " + rank + "@" + regex_escape(fault_host) +
                                               "\\] error: exit\\(\\) before MPI_Finalize")))
        << lines[0];
    EXPECT_TRUE(std::regex_search(
        r.combined, std::regex("Process name: \\[\\[[0-9]+,1\\]," + rank + "\\]\\s+Exit code: +1")))
        << describe(r);
  } else {
    // An expert rank that dies once start-up is done: its liveness connection closes and the
    // coordinator names it (transport/liveness.h). Otherwise mpirun reports the death alone.
    if (c.rank != 0 && c.phase != Phase::kStartup && c.phase != Phase::kLoad) {
      ASSERT_EQ(lines.size(), 1u) << describe(r);
      EXPECT_TRUE(std::regex_search(
          lines[0], std::regex("^\\[" + regex_escape("rank 0@" + host(0)) + "\\] error: rank " +
                               rank + "@" + regex_escape(fault_host) + " is gone: ")))
          << lines[0];
    } else {
      EXPECT_TRUE(lines.empty()) << "a death is reported by mpirun\n" << describe(r);
    }
    const std::regex names =
        std::regex("rank " + rank + " [^\\n]*node " + regex_escape(fault_host) + "[^\\n]*signal " +
                   std::to_string(signal_of(c.kind)));
    EXPECT_TRUE(std::regex_search(r.combined, names)) << describe(r);
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, MultihostFault, ::testing::ValuesIn(fault_cells()),
                         [](const auto& param_info) {
                           const Cell& c = param_info.param;
                           return std::string(kind_name(c.kind)) + "_" +
                                  (c.rank == 0   ? "coordinator"
                                   : c.rank == 1 ? "expert_head_host"
                                                 : "expert_other_host") +
                                  "_" + phase_name(c.phase);
                         });

// --combine host: rank 5 stops in decode; its host leader (rank 4, the lowest expert rank of
// host 2) names it, before the coordinator's longer wait for the leader runs out.
TEST_F(Multihost, AStoppedHostMateIsNamedByItsHostLeader) {
  std::vector<std::string> args = generate_args("glm5", 8);
  args.insert(args.end(), {"--combine", "host", "--rank-timeout", "1", "--startup-timeout", "2"});
  const JobResult r =
      run_across_hosts(args, {{"COLIBRI_TEST_FAULT", "stop:5:" + std::to_string(kFaultLayer) + ":" +
                                                         std::to_string(kFaultRequest)}});
  std::smatch match;
  ASSERT_TRUE(std::regex_search(
      r.combined, match,
      std::regex("test fault: rank 5 raises signal " + std::to_string(SIGSTOP) + " at ([0-9.]+)")))
      << describe(r);
  expect_ended_after_fault(r, r.reaped_unix_s - std::stod(match[1]), namespace_processes());
  const std::vector<std::string> lines = error_lines(r);
  ASSERT_EQ(lines.size(), 1u) << describe(r);
  const std::regex silent("\\[rank 4@" + regex_escape(host_of_rank(4)) + "\\] error: rank 5@" +
                          regex_escape(host_of_rank(5)) +
                          " is silent: no host partial for its host leader within 1\\.0 s in the "
                          "layer 2 exchange \\(--rank-timeout\\)");
  EXPECT_TRUE(std::regex_match(lines[0], silent)) << lines[0];
}

TEST_F(Multihost, ALinkCutDuringDecodeEndsTheJob) {
  // A long decode; host 2's link goes down just after the first token.
  const json meta = read_json(kParityDir / "glm5" / "golden" / "meta.json");
  const int first_token = meta.at("greedy_ids").at(0).get<int>();
  const std::string cut_host = host(2);
  const JobAction cut{std::to_string(first_token) + " ", 0.2, [cut_host](pid_t, int&) {
                        const CommandResult down =
                            run_command("ip -n " + cut_host + " link set eth0 down");
                        ASSERT_EQ(down.exit_code, 0) << down.output;
                      }};
  std::vector<std::string> args = generate_args("glm5", 3000);
  args.insert(args.end(), {"--quiet", "--rank-timeout", "2"});
  const JobResult r = run_across_hosts(args, {}, &cut);
  ASSERT_GT(r.action_elapsed_s, 0) << "the link was not cut\n" << describe(r);
  expect_ended_after_fault(r, r.elapsed_s - r.action_elapsed_s, namespace_processes());
  EXPECT_LT(parse_tokens(r.out).size(), 3000u) << "decode finished despite the cut";
  // The coordinator names a rank of the cut host.
  const std::vector<std::string> lines = error_lines(r);
  ASSERT_EQ(lines.size(), 1u) << describe(r);
  const std::regex silent("\\[rank 0@" + regex_escape(host(0)) + "\\] error: rank [45]@" +
                          regex_escape(cut_host) +
                          " is silent: no reply within 2\\.0 s in the layer [0-9]+ exchange "
                          "\\(--rank-timeout\\)");
  EXPECT_TRUE(std::regex_match(lines[0], silent)) << lines[0];
}

}  // namespace
}  // namespace colibri
