// The dashboard of --serve at 3 ranks with an API key: /dashboard and /dashboard/state answer 401
// without the key; the JSON holds the numbers of /metrics and a heat map whose rows add up to the
// routed pairs; the expert ranks' own counters (asked for while serving) agree with what the
// coordinator sent them and with their end-of-run report; and the page, loaded in headless Chromium
// (Debian's `chromium`), shows the numbers of /metrics, runs its chat box against the API, and is
// saved as a screenshot. Without Chromium the browser part is skipped with the reason. Every wait
// has a deadline; the browser runs in its own session with its own profile directory and is killed
// whole on every path.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "server_process.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using test::ServerProcess;

const std::string kKey = "dashboard-test-key";

std::string get(int port, const std::string& path, int* status, const std::string& key = kKey) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(5);
  c.set_read_timeout(20);
  httplib::Headers headers;
  if (!key.empty()) headers.emplace("Authorization", "Bearer " + key);
  auto res = c.Get(path.c_str(), headers);
  *status = res ? res->status : -1;
  return res ? res->body : std::string();
}

// /metrics as name{labels} -> value.
std::map<std::string, double> parse_metrics(const std::string& text) {
  std::map<std::string, double> values;
  for (const std::string& line : test::split(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    values[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return values;
}

std::map<std::string, double> metrics_now(int port) {
  int status = 0;
  const std::string text = get(port, "/metrics", &status);
  EXPECT_EQ(status, 200) << text;
  return parse_metrics(text);
}

// Waits (up to 30 s) until nothing runs and the engine's step count stood still for a second.
void wait_idle(int port) {
  const auto start = Clock::now();
  double steps = -1;
  while (Clock::now() - start < std::chrono::seconds(30)) {
    auto m = metrics_now(port);
    if (m["colibri_num_requests_running"] == 0 && m["colibri_num_requests_waiting"] == 0 &&
        m["colibri_engine_steps_total"] == steps)
      return;
    steps = m["colibri_engine_steps_total"];
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  ADD_FAILURE() << "the server did not become idle within 30 s";
}

void drive_requests(int port) {
  const std::vector<std::string> prompts = {"And God said,", "In the beginning",
                                            "The LORD is my shepherd;", "Blessed are the meek"};
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (size_t i = 0; i < prompts.size(); ++i)
    clients.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", port);
      c.set_connection_timeout(5);
      c.set_read_timeout(60);
      const json body = {{"prompt", prompts[i]},
                         {"max_tokens", 24 + 8 * int(i)},
                         {"temperature", 0},
                         {"ignore_eos", true}};
      auto res = c.Post("/v1/completions", {{"Authorization", "Bearer " + kKey}}, body.dump(),
                        "application/json");
      if (res && res->status == 200) ++ok;
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok, int(prompts.size()));
}

// ---- headless Chromium -----------------------------------------------------------------------

std::string find_chromium() {
  for (const char* name : {"/usr/bin/chromium", "/usr/bin/chromium-browser"})
    if (::access(name, X_OK) == 0) return name;
  return {};
}

// Runs Chromium headless on `url` with `mode` (--dump-dom, or --screenshot=FILE) in a session of
// its own, its stdout to `out`; kills the session after `limit_s`. Returns its exit status (-1:
// killed at the deadline).
int run_chromium(const std::string& binary, const fs::path& profile, const std::string& url,
                 const std::string& mode, const fs::path& out, int virtual_ms, double limit_s) {
  std::vector<std::string> args = {
      binary, "--headless",
      "--no-sandbox",  // as root Chromium refuses to start without
      "--disable-gpu", "--no-first-run", "--disable-extensions", "--disable-background-networking",
      "--user-data-dir=" + profile.string(), "--window-size=1280,1760",
      // Timers run in virtual time (the page polls every
      // virtual second), the server's answers in real time.
      "--virtual-time-budget=" + std::to_string(virtual_ms), mode, url};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string out_path = out.string();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setsid();
    const int o = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open((out_path + ".stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, STDOUT_FILENO);
    ::dup2(e, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  const auto start = Clock::now();
  int status = 0, code = -1;
  while (std::chrono::duration<double>(Clock::now() - start).count() < limit_s) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  test::kill_session(pid);  // its renderer and helper processes too, on every path
  if (code == -1) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  return code;
}

std::string unescape_attribute(std::string s) {
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"&quot;", "\""},
                                 {"&lt;", "<"},
                                 {"&gt;", ">"},
                                 {"&amp;", "&"}}) {
    for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
      s.replace(at, from.size(), to);
  }
  return s;
}

// The DOM without its script's source (which spells the attributes it writes).
std::string without_scripts(const std::string& dom) {
  const size_t open = dom.find("<script>");
  const size_t close = dom.find("</script>");
  if (open == std::string::npos || close == std::string::npos || close < open) return dom;
  return dom.substr(0, open) + dom.substr(close + 9);
}

// Every element of the page that shows a /metrics number: data-metric -> data-value.
std::map<std::string, double> shown_metrics(const std::string& dom) {
  std::map<std::string, double> shown;
  const std::regex cell(R"re(data-metric="([^"]*)"[^>]*?data-value="([^"]*)")re");
  for (auto it = std::sregex_iterator(dom.begin(), dom.end(), cell); it != std::sregex_iterator();
       ++it)
    shown[unescape_attribute((*it)[1])] = std::stod((*it)[2]);
  return shown;
}

TEST(DashboardMpi, PageShowsTheNumbersOfMetricsAtThreeRanks) {
  ServerProcess server(3, {"--api-key", kKey, "--max-seqs", "8", "--max-batch-tokens", "48"});
  ASSERT_TRUE(server.wait_ready(90)) << server.stderr_text();
  const int port = server.port();
  EXPECT_NE(server.stderr_text().find("/dashboard"), std::string::npos) << server.stderr_text();

  // The API's authentication: 401 without the key or with a wrong one.
  int status = 0;
  for (const std::string& key : {std::string(), std::string("wrong")}) {
    get(port, "/dashboard/state", &status, key);
    EXPECT_EQ(status, 401) << "key '" << key << "'";
    const std::string page = get(port, "/dashboard", &status, key);
    EXPECT_EQ(status, 401) << "key '" << key << "'";
    // Without the key the page comes with the 401 (it asks for the key), holding no numbers.
    EXPECT_NE(page.find("colibri-node dashboard"), std::string::npos);
  }
  const std::string page = get(port, "/dashboard", &status);
  EXPECT_EQ(status, 200);
  EXPECT_EQ(page.find("http://"), std::string::npos) << "the page loads nothing from elsewhere";

  drive_requests(port);
  wait_idle(port);

  // The JSON: the numbers of /metrics, and the engine's view of the cluster.
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // the engine view's period
  const std::string text = get(port, "/dashboard/state", &status);
  ASSERT_EQ(status, 200) << text;
  const json state = json::parse(text);
  auto m = metrics_now(port);
  EXPECT_EQ(state["schema"], "colibri-dashboard");
  EXPECT_EQ(state["version"], 1);
  EXPECT_EQ(state["tokens"]["generated"].get<double>(), m["colibri_generation_tokens_total"]);
  EXPECT_EQ(state["engine"]["steps"].get<double>(), m["colibri_engine_steps_total"]);
  EXPECT_EQ(state["tokens"]["generated"], 24 + 32 + 40 + 48);
  ASSERT_EQ(state["ranks"].size(), 3u);
  const int steps = state["engine"]["steps"].get<int>();
  const json& experts = state["experts"];
  const int top_k = 4;  // the embedded model's num_experts_per_tok
  int moe_layers = 0;
  for (int l = 0; l < experts["layers"].get<int>(); ++l) {
    const json& layer = state["layers"][size_t(l)];
    const bool moe = experts["owner"][size_t(l)][0].get<int>() != -1;
    if (!moe) continue;
    ++moe_layers;
    // One exchange per forward call: the scheduler's steps and the warm-up's.
    EXPECT_EQ(layer["exchanges"].get<int>(), steps + 1) << "layer " << l;
    EXPECT_EQ(m["colibri_layer_exchanges_total{layer=\"" + std::to_string(l) + "\"}"], steps + 1);
    const int slowest = layer["slowest_rank"].get<int>();  // -1: every exchange a tie
    EXPECT_TRUE(slowest == -1 || slowest == 1 || slowest == 2) << layer.dump();
    // Each exchange had one owner last, or a tie.
    int decided = layer["tied"].get<int>();
    for (const auto& [rank, n] : layer["last_replies"].items()) decided += n.get<int>();
    EXPECT_EQ(decided, steps + 1) << layer.dump();
    // The heat map's row: every routed row counted top_k times.
    double routed = 0;
    for (const json& n : experts["routed_rows"][size_t(l)]) routed += n.get<double>();
    EXPECT_EQ(routed, experts["tokens"].get<double>() * top_k) << "layer " << l;
    for (const json& owner : experts["owner"][size_t(l)])
      EXPECT_TRUE(owner == 1 || owner == 2) << "layer " << l;
  }
  EXPECT_GT(moe_layers, 0);

  // Each expert rank's own counters, as it answered the last poll: the pairs it computed are the
  // pairs the coordinator sent it, and it was busy.
  for (const char* r : {"1", "2"}) {
    const std::string rank = std::string("{rank=\"") + r + "\"}";
    EXPECT_EQ(m["colibri_rank_pairs_total" + rank], m["colibri_routed_pairs_total" + rank]) << r;
    EXPECT_GT(m["colibri_rank_busy_seconds_total" + rank], 0) << r;
    EXPECT_GT(m["colibri_rank_wait_seconds_total" + rank], 0) << r;
    const json& own = state["ranks"][size_t(std::stoi(r))]["own"];
    ASSERT_TRUE(own.is_object()) << state["ranks"].dump();
    EXPECT_EQ(own["pairs"].get<double>(), m["colibri_rank_pairs_total" + rank]) << r;
  }

  const std::string binary = find_chromium();
  if (binary.empty())
    GTEST_SKIP() << "no Chromium (/usr/bin/chromium): launch/install-deps.sh installs Debian's "
                    "chromium package; the page was not loaded in a browser";

  const fs::path dir = server.dir();
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/dashboard#key=" + kKey;
  // The page's chat box, sent from the URL's fragment, against the API with the same key.
  // Virtual time does not wait for a streamed body: a reply still streaming when the budget ends
  // (a busy machine) is tried again.
  const std::string chat_url = url + "&chat=Who%20was%20Moses%3F";
  const std::regex chat_done(R"re(class="meta">[1-9]\d* tokens in)re");
  std::string chat_dom;
  for (int attempt = 0; attempt < 3; ++attempt) {
    ASSERT_EQ(run_chromium(binary, dir / ("profile-chat" + std::to_string(attempt)), chat_url,
                           "--dump-dom", dir / "chat.html", 30000, 90),
              0)
        << test::read_file(dir / "chat.html.stderr");
    chat_dom = without_scripts(test::read_file(dir / "chat.html"));
    if (std::regex_search(chat_dom, chat_done)) break;
  }
  EXPECT_TRUE(std::regex_search(chat_dom, chat_done)) << chat_dom;
  EXPECT_EQ(chat_dom.find("class=\"meta\">error"), std::string::npos) << chat_dom;
  wait_idle(port);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));

  // The page's numbers against /metrics, read once the page has polled and the server is idle.
  ASSERT_EQ(
      run_chromium(binary, dir / "profile-dom", url, "--dump-dom", dir / "page.html", 6000, 90), 0)
      << test::read_file(dir / "page.html.stderr");
  const std::string dom = without_scripts(test::read_file(dir / "page.html"));
  const std::regex polls(R"re(data-polls="(\d+)")re");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(dom, match, polls)) << dom.substr(0, 2000);
  EXPECT_GE(std::stoi(match[1]), 1) << "the page never read /dashboard/state";
  m = metrics_now(port);
  const std::map<std::string, double> shown = shown_metrics(dom);
  for (const auto& [name, value] : shown) {
    const auto it = m.find(name);
    if (it == m.end()) {
      ADD_FAILURE() << "the page shows " << name << ", which /metrics does not have";
      continue;
    }
    EXPECT_NEAR(value, it->second, 1e-9 * std::max(1.0, std::fabs(it->second))) << name;
  }
  // Not a vacuous match: the numbers a reader looks for first are among them.
  for (const char* name :
       {"colibri_generation_tokens_total", "colibri_engine_steps_total",
        "colibri_num_requests_running", "colibri_kv_blocks_total",
        "colibri_expert_rank_reply_seconds_total{rank=\"1\"}",
        "colibri_expert_rank_reply_seconds_total{rank=\"2\"}",
        "colibri_routed_pairs_total{rank=\"1\"}", "colibri_rank_busy_seconds_total{rank=\"2\"}",
        "colibri_rank_tier_hits_total{rank=\"1\",tier=\"pinned\"}",
        "colibri_time_per_output_token_seconds_count",
        "colibri_coordinator_phase_seconds_total{phase=\"attention\"}"})
    EXPECT_TRUE(shown.count(name)) << "the page does not show " << name;
  EXPECT_GT(shown.at("colibri_generation_tokens_total"), 0);
  bool layer_shown = false;
  for (const auto& [name, value] : shown)
    layer_shown |= name.rfind("colibri_layer_exchanges_total{", 0) == 0 && value > 0;
  EXPECT_TRUE(layer_shown) << "no layer's critical path on the page";

  // The screenshot, with the chat box used, beside the test binary.
  const fs::path png = COLIBRI_DASHBOARD_SCREENSHOT;
  fs::remove(png);
  ASSERT_EQ(run_chromium(binary, dir / "profile-png", chat_url, "--screenshot=" + png.string(),
                         dir / "png.out", 30000, 90),
            0)
      << test::read_file(dir / "png.out.stderr");
  ASSERT_TRUE(fs::exists(png));
  EXPECT_GT(fs::file_size(png), 20000u) << "a blank page?";
  EXPECT_EQ(test::read_file(png).substr(1, 3), "PNG");
}

// Expert ranks reading experts from disk under a RAM budget: their tier counters are live in
// /metrics and /dashboard/state while the server runs, and once it is idle they equal the
// end-of-run report (--profile-json) of each rank.
TEST(DashboardMpi, ExpertRanksOwnCountersAreLiveAndEqualTheirReport) {
  const fs::path report = fs::path(::testing::TempDir()) / "dashboard-own-counters.json";
  fs::remove(report);
  ServerProcess server(3, {"--api-key", kKey, "--max-seqs", "8", "--ram-gb", "0.0005",
                           "--profile-json", report.string()});
  ASSERT_TRUE(server.wait_ready(90)) << server.stderr_text();
  const int port = server.port();
  drive_requests(port);
  wait_idle(port);
  // The last poll comes within a second of the last step.
  std::map<std::string, double> m;
  const auto start = Clock::now();
  const auto answered = [&] {
    for (const char* r : {"1", "2"}) {
      const std::string rank = std::string("{rank=\"") + r + "\"}";
      if (!m.count("colibri_rank_pairs_total" + rank) ||
          m["colibri_rank_pairs_total" + rank] != m["colibri_routed_pairs_total" + rank])
        return false;
    }
    return true;
  };
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    m = metrics_now(port);
  } while (!answered() && Clock::now() - start < std::chrono::seconds(10));
  ASSERT_TRUE(answered()) << "the expert ranks' own pairs never equalled the pairs sent to them";
  int status = 0;
  const json state = json::parse(get(port, "/dashboard/state", &status));
  ASSERT_EQ(status, 200);
  EXPECT_TRUE(state["own_counters_at_s"].is_number());
  std::map<std::string, json> own;
  for (const char* r : {"1", "2"}) {
    const std::string rank = std::string("{rank=\"") + r + "\"}";
    const std::string tier = std::string("{rank=\"") + r + "\",tier=\"";
    own[r] = state["ranks"][size_t(std::stoi(r))]["own"];
    EXPECT_GT(m["colibri_rank_tier_hits_total" + tier + "disk\"}"], 0) << r;
    EXPECT_GT(m["colibri_rank_disk_read_bytes_total" + rank], 0) << r;
    EXPECT_EQ(own[r]["tier_hits"]["disk"].get<double>(),
              m["colibri_rank_tier_hits_total" + tier + "disk\"}"]);
    EXPECT_EQ(own[r]["disk_read_bytes"].get<double>(),
              m["colibri_rank_disk_read_bytes_total" + rank]);
  }
  server.signal(SIGTERM);
  ASSERT_NE(server.wait_exit(30), -1) << server.stderr_text();
  const json profile = json::parse(test::read_file(report));
  for (const json& r : profile["ranks"]) {
    const std::string rank = std::to_string(r["rank"].get<int>());
    if (!own.count(rank)) continue;
    const json& o = own[rank];
    EXPECT_EQ(r["experts"], o["pairs"]) << rank;
    EXPECT_EQ(r["rows"], o["rows"]) << rank;
    EXPECT_EQ(r["pinned_hits"], o["tier_hits"]["pinned"]) << rank;
    EXPECT_EQ(r["ram_hits"], o["tier_hits"]["ram"]) << rank;
    EXPECT_EQ(r["disk_hits"], o["tier_hits"]["disk"]) << rank;
    EXPECT_EQ(r["disk_bytes_read"], o["disk_read_bytes"]) << rank;
    own.erase(rank);
  }
  EXPECT_TRUE(own.empty()) << "ranks missing from the report";
  fs::remove(report);
}

}  // namespace
}  // namespace colibri
