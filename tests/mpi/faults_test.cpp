// Faults across ranks under a real `mpirun`, at three ranks, with different arguments per rank
// (mpirun's MPMD form `-np 1 colibri-node A : -np 2 colibri-node B`):
//   1. an error found by one rank only (arguments, files, its model) is printed once, by that rank,
//      and ends the job within seconds; a rank that never reaches a start-up step is named after
//      --startup-timeout;
//   2. ranks that disagree on a setting, or on the model's weight data, are refused with both
//      ranks and the field named;
//   3. the expert ranks notice a stopped or killed coordinator, even while it idles in --chat, and
//      the idle coordinator notices a stopped or killed expert rank (on NCCL too, with a GPU).
// Every case asserts the exit code, the message, the time to exit and that no process is left.
#include <signal.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "mpirun_job.h"

namespace colibri {
namespace {

using namespace colibri::test;  // NOLINT(google-build-using-namespace): the job helpers

const fs::path kChatModel = fs::path(COLIBRI_EMBEDDED_MODEL);  // has a tokenizer

// Start-up errors end well within this (the ranks load a 1 MB model).
constexpr double kQuickExitSeconds = 10;
// After a deadline fires, the job is gone within this.
constexpr double kAfterDeadlineSeconds = 8;

using Args = std::vector<std::string>;

// `mpirun -np n1 colibri-node ARGS1 : -np n2 colibri-node ARGS2 ...`
JobResult run_mpmd(const std::vector<std::pair<int, Args>>& groups,
                   const std::map<std::string, std::string>& extra_env = {},
                   const JobAction* action = nullptr) {
  Args args = mpirun_prefix();
  for (size_t i = 0; i < groups.size(); ++i) {
    if (i > 0) args.push_back(":");
    args.insert(args.end(), {"-np", std::to_string(groups[i].first), COLIBRI_NODE_BINARY});
    args.insert(args.end(), groups[i].second.begin(), groups[i].second.end());
  }
  return run_job(args, extra_env, action);
}

// Three ranks, rank `odd` given `odd_args` and the others `args`.
JobResult run_three_with_one_odd(int odd, const Args& args, const Args& odd_args,
                                 const std::map<std::string, std::string>& extra_env = {}) {
  std::vector<std::pair<int, Args>> groups;
  if (odd > 0) groups.emplace_back(odd, args);
  groups.emplace_back(1, odd_args);
  if (odd < 2) groups.emplace_back(2 - odd, args);
  return run_mpmd(groups, extra_env);
}

Args generate_args() {
  return {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg, "--ngen", "2"};
}

Args plus(Args args, const Args& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::string rank_at(int rank) {
  return "rank " + std::to_string(rank) + "@" + short_hostname();
}

// The lines of stderr that report an error of ours: "[rank r@host] error: " or
// "colibri-node: error: ".
std::vector<std::string> error_lines(const JobResult& r) {
  std::vector<std::string> lines;
  for (std::string line : lines_of(r.err)) {
    while (line.rfind("> ", 0) == 0) line.erase(0, 2);  // after a --chat prompt
    if (line.rfind("colibri-node: error: ", 0) == 0 ||
        (line.rfind("[rank ", 0) == 0 && line.find("] error: ") != std::string::npos))
      lines.push_back(line);
  }
  return lines;
}

// The job ended by itself within `max_seconds`, non-zero, with nothing on stdout and exactly one
// error line, which starts with `start` and holds every one of `parts`.
void expect_one_error(const JobResult& r, const std::string& start, const Args& parts,
                      double max_seconds = kQuickExitSeconds) {
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_LT(r.elapsed_s, max_seconds) << describe(r);
  EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
  EXPECT_EQ(r.combined.find("internal error"), std::string::npos) << describe(r);
  const std::vector<std::string> lines = error_lines(r);
  ASSERT_EQ(lines.size(), 1u) << describe(r);
  EXPECT_EQ(lines[0].rfind(start, 0), 0u) << lines[0];
  for (const std::string& part : parts)
    EXPECT_NE(lines[0].find(part), std::string::npos) << "missing '" << part << "'\n" << lines[0];
}

// ---- 1. an error on one rank --------------------------------------------------------------------

TEST(MpiFaults, AnErrorFoundByOneRankIsPrintedOnceByThatRank) {
  const ScratchDir dir;
  const fs::path no_config = dir.path() / "no-config";  // a model directory without config.json
  fs::create_directory(no_config);
  fs::copy(kModel / "model.safetensors", no_config / "model.safetensors");
  const fs::path truncated = dir.path() / "truncated";  // model.safetensors cut inside its header
  fs::create_directory(truncated);
  fs::copy(kModel / "config.json", truncated / "config.json");
  {
    std::ifstream in(kModel / "model.safetensors", std::ios::binary);
    std::string head(200, '\0');
    in.read(head.data(), std::streamsize(head.size()));
    std::ofstream(truncated / "model.safetensors", std::ios::binary) << head;
  }
  const std::string missing = (dir.path() / "missing").string();
  struct Case {
    int rank;
    Args odd_args;
    Args parts;
  };
  const std::vector<Case> cases = {
      {2, plus(generate_args(), {"--bogus"}), {"--bogus", "--help"}},
      {1, {"--model", missing}, {missing, "No such file or directory"}},
      {0,
       {"--model", kModel.string(), "--score", missing + ".txt"},
       {missing + ".txt", "--score", "No such file or directory"}},
      {2, plus(generate_args(), {"--rank-timeout", "0"}), {"--rank-timeout 0"}},
      {1, plus(generate_args(), {"--startup-timeout", "nan"}), {"--startup-timeout nan"}},
      {0, plus(generate_args(), {"--ngen", "-3"}), {"--ngen"}},
      {1, plus(generate_args(), {"--layout", missing + ".layout"}), {missing + ".layout"}},
      {2, {"--model", no_config.string()}, {(no_config / "config.json").string()}},
      {1, {"--model", truncated.string()}, {(truncated / "model.safetensors").string()}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("rank " + std::to_string(c.rank) + ": " + testing::PrintToString(c.odd_args));
    const JobResult r = run_three_with_one_odd(c.rank, generate_args(), c.odd_args);
    expect_one_error(r, "[" + rank_at(c.rank) + "] error: ", c.parts);
  }
}

TEST(MpiFaults, ErrorsOnSeveralRanksArePrintedOnceByTheLowest) {
  const JobResult r = run_mpmd({{1, generate_args()},
                                {1, plus(generate_args(), {"--top-p", "2"})},
                                {1, plus(generate_args(), {"--unknown-flag"})}});
  expect_one_error(r, "[" + rank_at(1) + "] error: ", {"--top-p 2"});
  EXPECT_EQ(r.combined.find("--unknown-flag"), std::string::npos) << describe(r);
  // The same bad argument on every rank: one line too.
  const JobResult all = run_mpmd({{3, plus(generate_args(), {"--temp", "-1"})}});
  expect_one_error(all, "[" + rank_at(0) + "] error: ", {"--temp -1"});
}

// A rank stopped before a start-up step: the rank waiting for it names it at --startup-timeout.
TEST(MpiFaults, ARankThatNeverArrivesIsNamedAfterTheStartupTimeout) {
  const double timeout = 3;
  struct Case {
    std::string fault;  // COLIBRI_TEST_FAULT
    std::string reporter, silent, stage;
  };
  const std::vector<Case> cases = {
      {"stop:2:load", rank_at(0), rank_at(2) + " is silent: did not reach",
       "start-up (weights loaded"},
      {"stop:0:load", rank_at(1), rank_at(0) + " is silent: did not reach",
       "start-up (weights loaded"},
      {"stop:1:startup", rank_at(0), "rank 1@", "start-up (argument checks)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.fault);
    const JobResult r =
        run_mpmd({{3, plus(generate_args(), {"--startup-timeout", std::to_string(timeout)})}},
                 {{"COLIBRI_TEST_FAULT", c.fault}});
    expect_clean_end(r);
    EXPECT_NE(r.exit_code, 0) << describe(r);
    EXPECT_GE(r.elapsed_s, timeout) << "ended before the deadline could fire\n" << describe(r);
    EXPECT_LT(r.elapsed_s, timeout + kAfterDeadlineSeconds) << describe(r);
    const std::vector<std::string> lines = error_lines(r);
    ASSERT_GE(lines.size(), 1u) << describe(r);
    EXPECT_EQ(lines[0].rfind("[" + c.reporter + "] error: ", 0), 0u) << lines[0];
    for (const std::string& part :
         {c.silent, c.stage, std::string("within 3.0 s"), std::string("(--startup-timeout)")})
      EXPECT_NE(lines[0].find(part), std::string::npos) << "missing '" << part << "'\n" << lines[0];
    EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
  }
}

// A rank killed during start-up: Open MPI ends the job and names it, whatever the deadline.
TEST(MpiFaults, ARankKilledDuringStartupEndsTheJobQuickly) {
  for (const std::string fault : {"kill:1:startup", "kill:0:load", "kill:2:load"}) {
    SCOPED_TRACE(fault);
    const JobResult r = run_mpmd({{3, generate_args()}}, {{"COLIBRI_TEST_FAULT", fault}});
    expect_clean_end(r);
    EXPECT_NE(r.exit_code, 0) << describe(r);
    EXPECT_LT(r.elapsed_s, kQuickExitSeconds) << describe(r);
    const std::string rank = fault.substr(5, 1);
    EXPECT_NE(r.combined.find("rank " + rank + " with PID"), std::string::npos) << describe(r);
    EXPECT_NE(r.combined.find("signal 9"), std::string::npos) << describe(r);
    EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
  }
}

// A rank killed while experts move to it (--repin-every: the change is announced and the new
// holders start reading) ends the job as any other fault, naming it. The embedded model's skewed
// routing drifts from the uniform heat of a fresh statistics file within the first prefill.
TEST(MpiFaults, ARankKilledDuringAMoveOfExpertsEndsTheJobNamingIt) {
  const fs::path stats = fs::temp_directory_path() / "faults-move.stats";
  fs::remove(stats);
  std::string prompt;
  for (int i = 0; i < 20; ++i) prompt += "And God said, Let there be light: and there was light. ";
  const Args args = {
      "--model", kChatModel.string(), "--prompt",     prompt,          "--ngen", "8", "--placement",
      "heat",    "--routing-stats",   stats.string(), "--repin-every", "64"};
  const JobResult r = run_mpmd({{3, args}}, {{"COLIBRI_TEST_FAULT", "kill:1:move"}});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_LT(r.elapsed_s, kQuickExitSeconds) << describe(r);
  EXPECT_NE(r.combined.find("rank 1 with PID"), std::string::npos) << describe(r);
  EXPECT_NE(r.combined.find("signal 9"), std::string::npos) << describe(r);
  // Without the fault the same job moves experts and ends well.
  const JobResult ok = run_mpmd({{3, args}});
  expect_clean_end(ok);
  EXPECT_EQ(ok.exit_code, 0) << describe(ok);
  EXPECT_NE(ok.err.find("re-placement: "), std::string::npos) << describe(ok);
  EXPECT_EQ(ok.err.find(" 0 of them moved experts"), std::string::npos) << describe(ok);
  fs::remove(stats);
}

// A rank stopped in its first instant (before MPI_Init, or before the node's first communicator
// split) leaves the others in a call without a deadline of its own: the watchdog ends the job
// within --startup-timeout, naming the step (MPI cannot tell which rank is missing there).
TEST(MpiFaults, ARankStoppedBeforeMpiInitOrTheFirstSplitEndsTheJobInTime) {
  const double timeout = 3;
  for (const auto& [fault, step] :
       {std::pair{"stop:1:init", "MPI_Init"},
        std::pair{"stop:2:split", "the communicator split at start-up"}}) {
    SCOPED_TRACE(fault);
    const JobResult r =
        run_mpmd({{3, plus(generate_args(), {"--startup-timeout", std::to_string(timeout)})}},
                 {{"COLIBRI_TEST_FAULT", fault}});
    expect_clean_end(r);
    EXPECT_NE(r.exit_code, 0) << describe(r);
    EXPECT_GE(r.elapsed_s, timeout) << "ended before the deadline could fire\n" << describe(r);
    EXPECT_LT(r.elapsed_s, timeout + kAfterDeadlineSeconds) << describe(r);
    EXPECT_NE(
        r.combined.find(std::string(step) + " did not finish within 3.0 s (--startup-timeout)"),
        std::string::npos)
        << describe(r);
    EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
  }
}

// ---- 2. ranks that disagree ---------------------------------------------------------------------

TEST(MpiFaults, RanksThatDisagreeOnASettingAreRefusedNamingBothAndTheField) {
  const ScratchDir dir;
  const fs::path layout = dir.path() / "three.layout";
  std::ofstream(layout) << "# rank role\n0 coordinator\n1 cpu-expert\n2 cpu-expert\n";
  struct Case {
    int rank;
    Args odd_args;  // appended to the odd rank's arguments
    Args all_args;  // appended to every rank's
    std::string field, odd_value, other_value;
    int other;  // the rank it is compared with
  };
  const std::vector<Case> cases = {
      {2, {"--max-rows", "64"}, {}, "--max-rows", "64", "256", 0},
      {1, {"--wire", "bf16"}, {}, "--wire", "bf16", "f32", 0},
      {0, {"--placement", "round-robin"}, {}, "--placement", "balanced", "round-robin", 1},
      {1, {"--layout", layout.string()}, {}, "--layout", "a file with content hash", "(none)", 0},
      {2, {"--temp", "0.9"}, {"--temp", "0.5"}, "--temp", "0.9", "0.5", 0},
      {1, {"--seed", "7"}, {}, "--seed", "7", "0", 0},
      {2, {"--kv-tokens", "64"}, {"--kv-tokens", "128"}, "--kv-tokens", "64", "128", 0},
      {1, {"--ignore-eos"}, {}, "--ignore-eos", "on", "off", 0},
      // Activations default to int8.
      {1,
       {"--activations", "int8"},
       {"--activations", "mixed"},
       "--activations",
       "int8",
       "mixed",
       0},
      {2, {"--activations", "f32"}, {"--sequences", "2"}, "--activations", "f32", "int8", 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("rank " + std::to_string(c.rank) + ": " + testing::PrintToString(c.odd_args));
    const JobResult r = run_three_with_one_odd(c.rank, plus(generate_args(), c.all_args),
                                               plus(generate_args(), c.odd_args));
    // The message names the later rank first.
    const int first = c.rank == 0 ? c.other : c.rank, second = c.rank == 0 ? 0 : c.other;
    expect_one_error(r, "colibri-node: error: ",
                     {rank_at(first) + " and " + rank_at(second) + " disagree on " + c.field,
                      "'" + c.odd_value, "'" + c.other_value + "'"});
  }
}

// --serve on an expert rank of an MPMD job whose coordinator generates from the command line
// would be ignored: refused at the handshake naming both ranks.
TEST(MpiFaults, ServeOnAnExpertRankAloneIsRefused) {
  const JobResult r =
      run_three_with_one_odd(1, generate_args(), {"--model", kModel.string(), "--serve"});
  expect_one_error(r, "colibri-node: error: ",
                   {rank_at(1) + " and " + rank_at(0) + " disagree on --serve", "'on'", "'off'"});
}

// Adds 1 to the lowest mantissa bit of every F32, BF16 and F16 value: the same config, names,
// dtypes and shapes, different (and still finite) weights.
void perturb_weights(const fs::path& file) {
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_bytes = 0;
  io.read(reinterpret_cast<char*>(&header_bytes), 8);
  std::string header(header_bytes, '\0');
  io.read(header.data(), std::streamsize(header_bytes));
  const json index = json::parse(header);
  for (const auto& [name, entry] : index.items()) {
    if (name == "__metadata__") continue;
    const std::string dtype = entry.at("dtype");
    const size_t elem = dtype == "F32" ? 4 : (dtype == "BF16" || dtype == "F16") ? 2 : 0;
    ASSERT_NE(elem, 0u) << name << " " << dtype;
    const uint64_t begin = entry.at("data_offsets")[0], end = entry.at("data_offsets")[1];
    std::string data(end - begin, '\0');
    io.seekg(std::streamoff(8 + header_bytes + begin));
    io.read(data.data(), std::streamsize(data.size()));
    for (size_t i = 0; i < data.size(); i += elem) data[i] = char(data[i] ^ 1);
    io.seekp(std::streamoff(8 + header_bytes + begin));
    io.write(data.data(), std::streamsize(data.size()));
  }
  ASSERT_TRUE(io.good()) << file;
}

TEST(MpiFaults, DifferentWeightDataOfTheSameShapesIsRefused) {
  const ScratchDir dir;
  const fs::path same = dir.path() / "same", other = dir.path() / "other";
  fs::copy(kModel, same, fs::copy_options::recursive);
  fs::copy(kModel, other, fs::copy_options::recursive);
  perturb_weights(other / "model.safetensors");
  const Args common = {"--prompt-ids", golden().prompt_arg, "--ngen", "2"};
  const JobResult r = run_three_with_one_odd(1, plus({"--model", kModel.string()}, common),
                                             plus({"--model", other.string()}, common));
  expect_one_error(r, "colibri-node: error: ",
                   {rank_at(1) + " loaded different weight data than " + rank_at(0),
                    "--model " + other.string() + " on " + rank_at(1),
                    "--model " + kModel.string() + " on " + rank_at(0)});

  // The same bytes at another path on one rank start and give the golden tokens.
  const JobResult ok =
      run_three_with_one_odd(2, plus({"--model", kModel.string()}, plus(common, {"--ignore-eos"})),
                             {"--model", same.string()});
  expect_clean_end(ok);
  EXPECT_EQ(ok.exit_code, 0) << describe(ok);
  EXPECT_EQ(parse_tokens(ok.out),
            std::vector<int>(golden().greedy.begin(), golden().greedy.begin() + 2))
      << describe(ok);
}

// Settings the coordinator alone uses may be left out on the expert ranks, or given the same.
TEST(MpiFaults, RanksThatAgreeStartWithCoordinatorOnlySettingsLeftOut) {
  const int ngen = 5;
  const Args coordinator = {"--model", kModel.string(),      "--prompt-ids", golden().prompt_arg,
                            "--ngen",  std::to_string(ngen), "--ignore-eos", "--temp",
                            "0",       "--max-rows",         "32",           "--wire",
                            "bf16"};
  const JobResult r = run_mpmd(
      {{1, coordinator},
       {1, {"--model", kModel.string(), "--max-rows", "32", "--wire", "bf16", "--temp", "0"}},
       {1, {"--model", kModel.string(), "--max-rows", "32", "--wire", "bf16"}}});
  expect_clean_end(r);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(parse_tokens(r.out).size(), size_t(ngen)) << describe(r);
  EXPECT_TRUE(error_lines(r).empty()) << describe(r);
}

// ---- 3. a stopped or killed coordinator ---------------------------------------------------------

// `--chat` on three ranks with stdin held open: the coordinator idles at its prompt.
JobResult run_idle_chat(const Args& extra, const JobAction& action) {
  Args args = {"--model", kChatModel.string(), "--chat", "--quiet"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_mpmd({{3, args}}, {}, &action);
}

JobAction signal_rank(int rank, int signal) {
  return {"> ", 0.5, [rank, signal](pid_t session, int&) {
            const pid_t pid = rank_pid(session, rank);
            ASSERT_GT(pid, 0) << "no process for rank " << rank;
            ::kill(pid, signal);
          }};
}

TEST(MpiFaults, ExpertRanksNameAStoppedIdleCoordinator) {
  const double timeout = 2;
  const JobResult r = run_idle_chat({"--rank-timeout", "2"}, signal_rank(0, SIGSTOP));
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  ASSERT_GT(r.action_elapsed_s, 0) << describe(r);
  const double after_stop = r.elapsed_s - r.action_elapsed_s;
  // Silence counts from the last heartbeat, up to one period (timeout / 4) before the stop.
  EXPECT_GE(after_stop, timeout * 0.75) << describe(r);
  EXPECT_LT(after_stop, timeout + kAfterDeadlineSeconds) << describe(r);
  const std::vector<std::string> lines = error_lines(r);
  ASSERT_GE(lines.size(), 1u) << describe(r);
  EXPECT_EQ(lines[0], "[" + rank_at(1) + "] error: coordinator " + rank_at(0) +
                          " is silent: no request or heartbeat within 2.0 s (--rank-timeout)")
      << describe(r);
}

// The coordinator idles at its prompt; expert rank 2 stops: the coordinator's heartbeats go
// unanswered and it names the rank at --rank-timeout, without waiting for a request.
TEST(MpiFaults, TheCoordinatorNamesAStoppedExpertRankWhileIdle) {
  const double timeout = 2;
  const JobResult r = run_idle_chat({"--rank-timeout", "2"}, signal_rank(2, SIGSTOP));
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  ASSERT_GT(r.action_elapsed_s, 0) << describe(r);
  const double after_stop = r.elapsed_s - r.action_elapsed_s;
  // Silence counts from the last answer, up to one heartbeat period (timeout / 4) before the stop.
  EXPECT_GE(after_stop, timeout * 0.75) << describe(r);
  EXPECT_LT(after_stop, timeout + kAfterDeadlineSeconds) << describe(r);
  const std::vector<std::string> lines = error_lines(r);
  ASSERT_EQ(lines.size(), 1u) << describe(r);
  EXPECT_EQ(lines[0], "[" + rank_at(0) + "] error: " + rank_at(2) +
                          " is silent: no answer to the coordinator's heartbeats within 2.0 s "
                          "while it waited for a request (--rank-timeout)")
      << describe(r);
}

TEST(MpiFaults, AnIdleCoordinatorKeepsTheExpertRanksWaiting) {
  // Idle for four rank timeouts, then end of input ends the chat.
  const JobAction close_stdin{"> ", 4.0, [](pid_t, int& stdin_fd) {
                                ::close(stdin_fd);
                                stdin_fd = -1;
                              }};
  const JobResult r = run_idle_chat({"--rank-timeout", "1"}, close_stdin);
  expect_clean_end(r);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_GE(r.elapsed_s, 4.0) << describe(r);
  EXPECT_EQ(r.combined.find("silent"), std::string::npos) << describe(r);
  EXPECT_TRUE(error_lines(r).empty()) << describe(r);
}

TEST(MpiFaults, AKilledIdleCoordinatorEndsTheJob) {
  // The default --rank-timeout (300 s) plays no part: Open MPI ends the job.
  const JobResult r = run_idle_chat({}, signal_rank(0, SIGKILL));
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  ASSERT_GT(r.action_elapsed_s, 0) << describe(r);
  EXPECT_LT(r.elapsed_s - r.action_elapsed_s, 5.0) << describe(r);
  EXPECT_NE(r.combined.find("rank 0 with PID"), std::string::npos) << describe(r);
  EXPECT_NE(r.combined.find("signal 9"), std::string::npos) << describe(r);
}

// The coordinator idles at its prompt; expert rank 2 is killed: its liveness connection closes
// and the coordinator names it at once, before Open MPI's teardown (transport/liveness.h).
TEST(MpiFaults, TheCoordinatorNamesAKilledExpertRankAtOnce) {
  const JobResult r = run_idle_chat({}, signal_rank(2, SIGKILL));
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  ASSERT_GT(r.action_elapsed_s, 0) << describe(r);
  EXPECT_LT(r.elapsed_s - r.action_elapsed_s, 5.0) << describe(r);
  const std::vector<std::string> lines = error_lines(r);
  ASSERT_EQ(lines.size(), 1u) << describe(r);
  EXPECT_EQ(lines[0].rfind("[" + rank_at(0) + "] error: " + rank_at(2) + " is gone: ", 0), 0u)
      << describe(r);
}

// The same points for gpu-expert ranks whose exchange is NCCL (no heartbeat of its own): the
// liveness connection names a stopped idle coordinator, and a stopped or killed idle gpu-expert
// rank. They need a CUDA device and a build with NCCL.
class NcclFaults : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef COLIBRI_HAVE_NCCL
    GTEST_SKIP() << "built without NCCL";
#endif
    if (!fs::exists("/dev/nvidiactl")) GTEST_SKIP() << "no NVIDIA device (/dev/nvidiactl)";
    layout_ = fs::path(::testing::TempDir()) / "nccl-faults.layout";
    std::ofstream(layout_) << "0 coordinator\n1 gpu-expert 0\n2 cpu-expert\n";
  }
  JobResult run(const Args& extra, const JobAction& action) {
    return run_idle_chat(plus({"--layout", layout_.string(), "--transport", "nccl"}, extra),
                         action);
  }
  fs::path layout_;
};

TEST_F(NcclFaults, AGpuExpertRankNamesAStoppedIdleCoordinator) {
  const JobResult r = run({"--rank-timeout", "2"}, signal_rank(0, SIGSTOP));
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_LT(r.elapsed_s - r.action_elapsed_s, 2 + 4.0 + kAfterDeadlineSeconds) << describe(r);
  EXPECT_NE(r.combined.find("the coordinator " + rank_at(0) + " is silent"), std::string::npos)
      << describe(r);
}

TEST_F(NcclFaults, TheCoordinatorNamesAStoppedIdleGpuExpertRank) {
  const JobResult r = run({"--rank-timeout", "2"}, signal_rank(1, SIGSTOP));
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_LT(r.elapsed_s - r.action_elapsed_s, 2 + kAfterDeadlineSeconds) << describe(r);
  EXPECT_NE(r.combined.find(rank_at(1) + " is silent"), std::string::npos) << describe(r);
}

TEST_F(NcclFaults, TheCoordinatorNamesAKilledGpuExpertRankAtOnce) {
  const JobResult r = run({}, signal_rank(1, SIGKILL));
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_LT(r.elapsed_s - r.action_elapsed_s, 5.0) << describe(r);
  EXPECT_NE(r.combined.find(rank_at(1) + " is gone"), std::string::npos) << describe(r);
}

}  // namespace
}  // namespace colibri
