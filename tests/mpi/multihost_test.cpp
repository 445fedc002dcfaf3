// colibri-node across hosts: a head and three host namespaces made by launch/netns-hosts.sh,
// `mpirun -np 7` across them over Open MPI's TCP transport only (1 rank on the head, 2 on each
// host). The distributed logits equal the single process's within 1e-5 on a GLM-5 and a
// DeepSeek-V3 parity model; faults on another host end every process of the job within 10 s,
// non-zero, with a line naming rank@host. Skipped, with the reason, where namespaces cannot be
// made. Each test binary run has its own set of namespaces (named after its pid), taken down at
// the end, also after failures; sets left by a killed run are removed by the next (`gc`).
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
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
constexpr int kRanks = 7;  // rank 0 on the head, ranks 2i-1 and 2i on host i
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
  static std::string host_of_rank(int rank) { return host((rank + 1) / 2); }

  static void SetUpTestSuite() {
    name_ = "cmh" + std::to_string(::getpid());
    if (::geteuid() != 0) {
      skip_reason_ = "making network namespaces needs root";
      return;
    }
    run_command("bash " + quoted(kScript.string()) + " gc");
    const CommandResult up = run_command("env COLIBRI_NETNS_OWNER=" + std::to_string(::getpid()) +
                                         " bash " + quoted(kScript.string()) + " up " +
                                         std::to_string(kHosts) + " --name " + name_);
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
  for (const std::string& line : lines_of(r.err))
    if (line.rfind("[rank ", 0) == 0 && line.find("] error: ") != std::string::npos)
      lines.push_back(line);
  return lines;
}

// ---- equal to the single process ---------------------------------------------------------------

class MultihostEquality : public Multihost, public ::testing::WithParamInterface<std::string> {};

TEST_P(MultihostEquality, LogitsEqualTheSingleProcess) {
  const std::string fixture = GetParam();
  const ScratchDir dir;
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
  job_args.insert(job_args.end(), {"--logits-out", (dir.path() / "seven.npy").string(),
                                   "--print-placement", "--rank-timeout", "30"});
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
}

INSTANTIATE_TEST_SUITE_P(ParityModels, MultihostEquality, ::testing::Values("glm5", "dsv3"),
                         [](const auto& param_info) { return param_info.param; });

// ---- faults on another host --------------------------------------------------------------------

// Rank 4 (host 2) and rank 5 (host 3) are expert ranks on hosts other than the coordinator's.
constexpr int kFaultLayer = 2;  // an MoE layer of the GLM-5 parity model
// Requests for that layer: the prompt's (one), then one per decode step: the third is decode.
constexpr int kFaultRequest = 3;

// The wall-clock time at which the faulting rank raised its signal, from its announcement.
double fault_unix_s(const JobResult& r, int rank, int signal) {
  const std::regex line("test fault: rank " + std::to_string(rank) + " raises signal " +
                        std::to_string(signal) + " at ([0-9.]+)");
  std::smatch match;
  if (!std::regex_search(r.combined, match, line)) return -1;
  return std::stod(match[1]);
}

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

TEST_F(Multihost, AnExpertRankKilledOnAnotherHostDuringDecodeEndsTheJob) {
  const int rank = 4;
  std::vector<std::string> args = generate_args("glm5", 8);
  args.insert(args.end(), {"--quiet", "--rank-timeout", "30"});
  const JobResult r = run_across_hosts(
      args,
      {{"COLIBRI_TEST_FAULT", "kill:" + std::to_string(rank) + ":" + std::to_string(kFaultLayer) +
                                  ":" + std::to_string(kFaultRequest)}});
  const double fault = fault_unix_s(r, rank, SIGKILL);
  ASSERT_GT(fault, 0) << describe(r);
  expect_ended_after_fault(r, r.reaped_unix_s - fault, namespace_processes());
  // Open MPI's report: "process rank 4 with PID ... on node NAME-h2 exited on signal 9".
  const std::regex names_rank_and_host("rank " + std::to_string(rank) + " [^\n]*node " +
                                       regex_escape(host_of_rank(rank)) + "[^\n]*signal 9");
  EXPECT_TRUE(std::regex_search(r.combined, names_rank_and_host)) << describe(r);
  EXPECT_EQ(r.combined.find("is silent"), std::string::npos) << describe(r);
  EXPECT_LT(parse_tokens(r.out).size(), 8u) << describe(r);
}

TEST_F(Multihost, AnExpertRankStoppedOnAnotherHostDuringDecodeIsNamed) {
  const int rank = 5;
  const double timeout = 2;
  std::vector<std::string> args = generate_args("glm5", 8);
  args.insert(args.end(), {"--quiet", "--rank-timeout", "2"});
  const JobResult r = run_across_hosts(
      args,
      {{"COLIBRI_TEST_FAULT", "stop:" + std::to_string(rank) + ":" + std::to_string(kFaultLayer) +
                                  ":" + std::to_string(kFaultRequest)}});
  const double fault = fault_unix_s(r, rank, SIGSTOP);
  ASSERT_GT(fault, 0) << describe(r);
  expect_ended_after_fault(r, r.reaped_unix_s - fault, namespace_processes());
  EXPECT_GE(r.reaped_unix_s - fault, timeout) << "ended before the deadline\n" << describe(r);
  const std::vector<std::string> lines = error_lines(r);
  ASSERT_EQ(lines.size(), 1u) << describe(r);
  EXPECT_EQ(lines[0], "[rank 0@" + host(0) + "] error: rank " + std::to_string(rank) + "@" +
                          host_of_rank(rank) + " is silent: no reply within 2.0 s in the layer " +
                          std::to_string(kFaultLayer) + " exchange (--rank-timeout)")
      << describe(r);
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
  const std::regex silent("\\[rank 0@" + regex_escape(host(0)) + "\\] error: rank [34]@" +
                          regex_escape(cut_host) +
                          " is silent: no reply within 2\\.0 s in the layer [0-9]+ exchange "
                          "\\(--rank-timeout\\)");
  EXPECT_TRUE(std::regex_match(lines[0], silent)) << lines[0];
}

}  // namespace
}  // namespace colibri
