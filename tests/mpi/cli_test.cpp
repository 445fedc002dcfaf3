// The colibri-node program under a real `mpirun`, as a user starts it: profile outputs, the
// failure paths (an expert rank killed, stopped or sending a corrupted reply), a handshake
// mismatch, a bad layout file, and the single-process run. This binary is not an MPI program: it
// launches mpirun as a child in its own session, with a hard wall-clock limit after which the
// whole session is killed and the test fails, so a hang can never outlive the test.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "mpirun_job.h"

namespace colibri {
namespace {

using namespace colibri::test;  // NOLINT(google-build-using-namespace): the job helpers

// ---- a. profile outputs ------------------------------------------------------------------------

TEST(MpiCli, ProfileTableJsonAndTraceAtThreeRanks) {
  const ScratchDir dir;
  const fs::path profile = dir.path() / "profile.json", trace = dir.path() / "trace.json";
  const int ngen = 6, np = 3;
  const JobResult r = run_node(np, {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                    "--ngen", std::to_string(ngen), "--ignore-eos",
                                    "--profile-json", profile.string(), "--trace", trace.string()});
  expect_clean_end(r);
  ASSERT_EQ(r.exit_code, 0) << describe(r);

  // stdout: exactly the greedy tokens of the transformers golden.
  const std::vector<int> expected(golden().greedy.begin(), golden().greedy.begin() + ngen);
  EXPECT_EQ(parse_tokens(r.out), expected) << r.out;

  // stderr: one table row per rank, then the run line with the exact token counts.
  const std::regex row_pattern(
      R"(^\s*(\d+)\s+(coordinator|cpu-expert|gpu-expert)\s+\S+\s+[0-9.]+\s+[0-9.]+\s+\d+\s+\d+.*)");
  std::set<int> table_ranks;
  for (const std::string& line : lines_of(r.err)) {
    std::smatch m;
    if (std::regex_match(line, m, row_pattern)) {
      table_ranks.insert(std::stoi(m[1]));
      EXPECT_EQ(m[2] == "coordinator", std::stoi(m[1]) == 0) << line;
    }
  }
  EXPECT_EQ(table_ranks, (std::set<int>{0, 1, 2})) << r.err;
  const std::regex run_pattern(
      R"(prefill (\d+) tok in [0-9.]+ s \| decode (\d+) tok in [0-9.]+ s \([0-9.]+ tok/s\) \| TTFT [0-9.]+ s)");
  std::smatch run_line;
  ASSERT_TRUE(std::regex_search(r.err, run_line, run_pattern)) << r.err;
  EXPECT_EQ(std::stoi(run_line[1]), int(golden().prompt.size()));
  EXPECT_EQ(std::stoi(run_line[2]), ngen - 1);

  // --profile-json: three ranks; what the coordinator sent is what the expert ranks received.
  const json p = read_json(profile);
  EXPECT_EQ(p.at("run").at("decode_tokens").get<int>(), ngen - 1);
  EXPECT_GT(p.at("run").at("decode_tok_per_s").get<double>(), 0);
  const json& ranks = p.at("ranks");
  ASSERT_EQ(ranks.size(), size_t(np));
  const json config = read_json(kModel / "config.json");
  const int moe_layers =
      config.at("num_hidden_layers").get<int>() - config.at("first_k_dense_replace").get<int>();
  const int top_k = config.at("num_experts_per_tok").get<int>();
  const uint64_t tokens_through_model = golden().prompt.size() + size_t(ngen - 1);
  uint64_t expert_pairs = 0, expert_rows = 0, expert_bytes_in = 0, expert_bytes_out = 0;
  for (int i = 0; i < np; ++i) {
    const json& rank = ranks[size_t(i)];
    SCOPED_TRACE("rank " + std::to_string(i));
    EXPECT_EQ(rank.at("rank").get<int>(), i);
    EXPECT_GT(rank.at("wall_us").get<double>(), 0);
    EXPECT_GT(rank.at("weight_bytes_read").get<uint64_t>(), 0u);
    EXPECT_GT(rank.at("trace_events").get<uint64_t>(), 0u);
    const json& phases = rank.at("phases_us");
    if (i == 0) {
      EXPECT_EQ(rank.at("role"), "coordinator");
      EXPECT_GT(rank.at("rows").get<uint64_t>(), 0u);
      // Every token passes every MoE layer and is routed to top_k experts, all of them remote.
      EXPECT_EQ(rank.at("experts").get<uint64_t>(), tokens_through_model * moe_layers * top_k);
      for (const char* phase :
           {"attention", "router", "dispatch", "wait_slowest", "combine", "lm_head"})
        EXPECT_GT(phases.at(phase).get<double>(), 0) << phase;
      EXPECT_EQ(phases.at("compute").get<double>(), 0);
    } else {
      EXPECT_EQ(rank.at("role"), "cpu-expert");
      EXPECT_GT(rank.at("experts").get<uint64_t>(), 0u);
      for (const char* phase : {"recv_wait", "compute", "send"})
        EXPECT_GT(phases.at(phase).get<double>(), 0) << phase;
      EXPECT_EQ(phases.at("attention").get<double>(), 0);
      expert_pairs += rank.at("experts").get<uint64_t>();
      expert_rows += rank.at("rows").get<uint64_t>();
      expert_bytes_in += rank.at("bytes_in").get<uint64_t>();
      expert_bytes_out += rank.at("bytes_out").get<uint64_t>();
    }
  }
  EXPECT_EQ(expert_pairs, ranks[0].at("experts").get<uint64_t>());
  EXPECT_EQ(expert_rows, ranks[0].at("rows").get<uint64_t>());
  EXPECT_EQ(expert_bytes_in, ranks[0].at("bytes_out").get<uint64_t>());
  EXPECT_EQ(expert_bytes_out, ranks[0].at("bytes_in").get<uint64_t>());

  // --trace: a named process per rank, and complete events with times for every one of them.
  const json t = read_json(trace);
  const json& events = t.at("traceEvents");
  ASSERT_TRUE(events.is_array());
  std::map<int, std::string> process_names;
  std::map<int, size_t> complete_events;
  for (const json& e : events) {
    const int pid = e.at("pid").get<int>();
    if (e.at("ph") == "M" && e.at("name") == "process_name") {
      process_names[pid] = e.at("args").at("name").get<std::string>();
    } else if (e.at("ph") == "X") {
      ASSERT_TRUE(e.at("ts").is_number() && e.at("dur").is_number()) << e.dump();
      EXPECT_GE(e.at("dur").get<double>(), 0) << e.dump();
      ++complete_events[pid];
    }
  }
  for (int i = 0; i < np; ++i) {
    ASSERT_TRUE(process_names.count(i)) << "no process_name for pid " << i;
    EXPECT_EQ(process_names[i].rfind("rank " + std::to_string(i) + " (", 0), 0u)
        << process_names[i];
    EXPECT_GT(complete_events[i], 0u) << "no X events for pid " << i;
  }
  EXPECT_EQ(process_names.size(), size_t(np));
}

// ---- b.-d. an expert rank fails mid-run --------------------------------------------------------

TEST(MpiCli, KilledExpertRankEndsTheJobQuickly) {
  const JobResult r = run_node(4,
                               {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                "--ngen", "6", "--ignore-eos"},
                               {{"COLIBRI_TEST_FAULT", "kill:2:2"}});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  // The launcher, not the 300 s --rank-timeout, ends the job, within 5 s of the kill (the
  // faulting rank prints the wall-clock time at which it raises the signal).
  EXPECT_LT(r.elapsed_s, 15) << describe(r);
  const std::regex fault_line(R"(test fault: rank 2 raises signal 9 at ([0-9.]+))");
  std::smatch fault;
  ASSERT_TRUE(std::regex_search(r.combined, fault, fault_line)) << describe(r);
  EXPECT_LT(r.reaped_unix_s - std::stod(fault[1]), 5.0) << describe(r);
  EXPECT_EQ(r.combined.find("is silent"), std::string::npos) << describe(r);
  // Open MPI's own report: "process rank 2 with PID ... on node <host> exited on signal 9".
  const std::regex names_rank_and_host("rank 2 [^\n]*node " + regex_escape(short_hostname()) +
                                       "[^\n]*signal 9");
  EXPECT_TRUE(std::regex_search(r.combined, names_rank_and_host)) << describe(r);
}

TEST(MpiCli, StoppedExpertRankIsNamedAfterTheRankTimeout) {
  const JobResult r = run_node(3,
                               {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                "--ngen", "6", "--ignore-eos", "--rank-timeout", "2"},
                               {{"COLIBRI_TEST_FAULT", "stop:1:1"}});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_GE(r.elapsed_s, 2) << "ended before the rank timeout could fire\n" << describe(r);
  EXPECT_LT(r.elapsed_s, 15) << describe(r);
  EXPECT_NE(r.combined.find("rank 1@" + short_hostname()), std::string::npos) << describe(r);
  EXPECT_NE(r.combined.find("rank 1@" + short_hostname() + " is silent"), std::string::npos)
      << describe(r);
  EXPECT_NE(r.combined.find("--rank-timeout"), std::string::npos) << describe(r);
}

// --micro-batches 2: the 20-token prompt runs as two micro-batches, both exchanges of layer 1
// out when rank 1 stops on the first; the coordinator's wait for the first names it all the same.
TEST(MpiCli, StoppedExpertRankIsNamedWithTwoExchangesInFlight) {
  const JobResult r = run_node(
      3,
      {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg, "--ngen", "6",
       "--ignore-eos", "--rank-timeout", "2", "--micro-batches", "2", "--micro-batch-rows", "4"},
      {{"COLIBRI_TEST_FAULT", "stop:1:1"}});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_GE(r.elapsed_s, 2) << "ended before the rank timeout could fire\n" << describe(r);
  EXPECT_LT(r.elapsed_s, 15) << describe(r);
  EXPECT_NE(r.combined.find("rank 1@" + short_hostname() + " is silent: no reply within 2.0 s"),
            std::string::npos)
      << describe(r);
  EXPECT_NE(r.combined.find("--rank-timeout"), std::string::npos) << describe(r);
}

// --micro-batches 2 at np 3: the greedy tokens of the transformers golden.
TEST(MpiCli, MicroBatchesGiveTheGoldenTokens) {
  const int ngen = 6;
  const JobResult r = run_node(
      3, {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg, "--ngen",
          std::to_string(ngen), "--ignore-eos", "--micro-batches", "2", "--micro-batch-rows", "4"});
  expect_clean_end(r);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::vector<int> expected(golden().greedy.begin(), golden().greedy.begin() + ngen);
  EXPECT_EQ(parse_tokens(r.out), expected) << r.out;
  EXPECT_EQ(r.combined.find("--micro-batches 2 needs"), std::string::npos) << describe(r);
}

// --split-linears: the rank stops as the first split linear of layer 0 reaches it, while the
// coordinator waits for its rows.
TEST(MpiCli, StoppedSplitLinearRankIsNamedAfterTheRankTimeout) {
  const JobResult r =
      run_node(2,
               {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg, "--ngen", "6",
                "--ignore-eos", "--rank-timeout", "2", "--split-linears"},
               {{"COLIBRI_TEST_FAULT", "stop:1:0"}});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_GE(r.elapsed_s, 2) << "ended before the rank timeout could fire\n" << describe(r);
  EXPECT_LT(r.elapsed_s, 15) << describe(r);
  EXPECT_NE(r.combined.find("rank 1@" + short_hostname() +
                            " is silent: no rows of a split linear within 2.0 s for layer 0 "),
            std::string::npos)
      << describe(r);
}

// --split-linears in the batched path: a prompt longer than one prefill chunk (--max-rows 3)
// gives the lm_head a chunk without rows for logits, which once stopped every rank with "0 rows";
// the sequences equal one process's.
TEST(MpiCli, SplitLinearsBatchOfLongPromptsEqualsOneProcess) {
  ASSERT_GT(golden().prompt.size(), 3u);
  const std::vector<std::string> args = {"--model",
                                         kModel.string(),
                                         "--prompt-ids",
                                         golden().prompt_arg,
                                         "--ngen",
                                         "4",
                                         "--ignore-eos",
                                         "--sequences",
                                         "2",
                                         "--max-rows",
                                         "3",
                                         "--quiet"};
  const JobResult alone = run_node(1, args);
  expect_clean_end(alone);
  ASSERT_EQ(alone.exit_code, 0) << describe(alone);
  std::vector<std::string> split = args;
  split.push_back("--split-linears");
  const JobResult r = run_node(2, split);
  expect_clean_end(r);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(alone.out.find("[sequence 1] "), std::string::npos) << alone.out;
  EXPECT_EQ(r.out, alone.out);
}

// A KV pool, or the copy of it a rank keeps for --split-linears, larger than the memory is
// refused at start-up with the numbers, before anything is allocated for it.
TEST(MpiCli, KvPoolBeyondTheMemoryIsRefusedWithTheNumbers) {
  const std::vector<std::string> args = {"--model",           kModel.string(), "--prompt-ids",
                                         golden().prompt_arg, "--ngen",        "2",
                                         "--kv-tokens",       "1073741824"};
  const JobResult alone = run_node(1, args);
  expect_clean_end(alone);
  EXPECT_EQ(alone.exit_code, 1) << describe(alone);
  EXPECT_NE(alone.err.find("the KV pool of 1073741824 tokens (--kv-tokens) needs "),
            std::string::npos)
      << describe(alone);
  std::vector<std::string> split = args;
  split.push_back("--split-linears");
  const JobResult r = run_node(2, split);
  expect_clean_end(r);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  // The coordinator's pool is the larger; a rank's copy is checked too (a host with less memory).
  EXPECT_NE(r.err.find("1073741824 tokens (--kv-tokens) needs "), std::string::npos) << describe(r);
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << describe(r);
  EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
}

TEST(MpiCli, CorruptedReplyIsDetectedByChecksum) {
  const JobResult r = run_node(3,
                               {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                "--ngen", "6", "--ignore-eos"},
                               {{"COLIBRI_TEST_FAULT", "corrupt:2:3"}});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.combined.find("corrupted reply from rank 2@" + short_hostname()), std::string::npos)
      << describe(r);
  EXPECT_NE(r.combined.find("checksum"), std::string::npos) << describe(r);
  EXPECT_TRUE(r.out.empty() || parse_tokens(r.out).size() < 6u)
      << "a corrupted run must not finish\n"
      << r.out;
}

// --split-linears: the expert rank flips a byte of its heads' outputs for layer 0's attention.
TEST(MpiCli, CorruptedAttentionReplyIsDetectedByChecksum) {
  const JobResult r = run_node(2,
                               {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                "--ngen", "6", "--ignore-eos", "--split-linears"},
                               {{"COLIBRI_TEST_FAULT", "corrupt:1:0"}});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.combined.find("corrupted heads of layer 0 attention from rank 1@" + short_hostname() +
                            ": payload checksum mismatch"),
            std::string::npos)
      << describe(r);
  EXPECT_TRUE(r.out.empty() || parse_tokens(r.out).size() < 6u)
      << "a corrupted run must not finish\n"
      << r.out;
}

// ---- e.-f. start-up refused ------------------------------------------------------------------

TEST(MpiCli, DifferentModelOnOneRankIsRefusedAtTheHandshake) {
  const ScratchDir dir;
  const fs::path a = dir.path() / "A", b = dir.path() / "B";
  fs::copy(kModel, a, fs::copy_options::recursive);
  fs::copy(kModel, b, fs::copy_options::recursive);
  json config = read_json(b / "config.json");
  config["colibri_test_extra_key"] = 1;  // harmless for loading, but a different config
  std::ofstream(b / "config.json") << config.dump(2);

  // MPMD: ranks 0 and 1 load A, rank 2 loads B.
  std::vector<std::string> args = mpirun_prefix();
  const std::vector<std::string> common = {"--prompt-ids", golden().prompt_arg, "--ngen", "2"};
  args.insert(args.end(), {"-np", "2", COLIBRI_NODE_BINARY, "--model", a.string()});
  args.insert(args.end(), common.begin(), common.end());
  args.insert(args.end(), {":", "-np", "1", COLIBRI_NODE_BINARY, "--model", b.string()});
  args.insert(args.end(), common.begin(), common.end());
  const JobResult r = run_job(args);
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.combined.find("rank 2@" + short_hostname()), std::string::npos) << describe(r);
  EXPECT_NE(r.combined.find("different model"), std::string::npos) << describe(r);
  EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
}

TEST(MpiCli, LayoutWithDuplicateRankIsRefused) {
  const ScratchDir dir;
  const fs::path layout = dir.path() / "duplicate.layout";
  std::ofstream(layout) << "# rank role\n0 coordinator\n1 cpu-expert\n1 cpu-expert\n";
  const JobResult r = run_node(3, {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                   "--ngen", "2", "--layout", layout.string()});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.combined.find(layout.string() + ":4"), std::string::npos) << describe(r);
  EXPECT_NE(r.combined.find("duplicate"), std::string::npos) << describe(r);
  // Refused once, by the coordinator, for every rank.
  size_t errors = 0;
  for (const std::string& line : lines_of(r.err))
    errors += line.rfind("colibri-node: error:", 0) == 0;
  EXPECT_EQ(errors, 1u) << r.err;
  EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
}

// The layout's numa column binds each rank to its node (this host has node 0) before it loads
// anything; every rank's memory line says where its resident memory is and that it is bound.
TEST(MpiCli, NumaColumnBindsEachRankAndTheMemoryLineSaysWhere) {
  const ScratchDir dir;
  const fs::path layout = dir.path() / "numa.layout";
  std::ofstream(layout) << "# rank role gpu numa\n0 coordinator - 0\n1 cpu-expert - 0\n"
                           "2 cpu-expert - -\n";
  const JobResult r = run_node(3, {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                   "--ngen", "2", "--layout", layout.string()});
  expect_clean_end(r);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(parse_tokens(r.out),
            std::vector<int>(golden().greedy.begin(), golden().greedy.begin() + 2))
      << r.out;
  for (const int rank : {0, 1, 2}) {
    const std::string start = "memory: rank " + std::to_string(rank) + "@";
    const size_t at = r.err.find(start);
    ASSERT_NE(at, std::string::npos) << describe(r);
    const std::string line = r.err.substr(at, r.err.find('\n', at) - at);
    EXPECT_NE(line.find("(node 0 "), std::string::npos) << line;
    EXPECT_NE(line.find(rank == 2 ? "; not bound)" : "; bound to node 0)"), std::string::npos)
        << line;
  }
}

// A numa node the host does not have ends the job with one line naming the rank and the nodes.
TEST(MpiCli, NumaNodeTheHostLacksIsNamed) {
  const ScratchDir dir;
  const fs::path layout = dir.path() / "numa.layout";
  std::ofstream(layout) << "0 coordinator\n1 cpu-expert - 9\n2 cpu-expert\n";
  const JobResult r = run_node(3, {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                   "--ngen", "2", "--layout", layout.string()});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.err.find("rank 1@" + short_hostname() +
                       "] error: layout numa 9: this host has NUMA nodes 0.."),
            std::string::npos)
      << describe(r);
  EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
}

// A gpu-expert rank computes on its GPU; one that sees no device (none visible here: the job runs
// with CUDA_VISIBLE_DEVICES empty, also on a machine with GPUs) is refused by the coordinator in
// one line naming the layout, the rank and the reason, instead of running on its CPU.
TEST(MpiCli, GpuExpertRankWithoutDeviceIsRefused) {
  const ScratchDir dir;
  const fs::path layout = dir.path() / "gpu.layout";
  std::ofstream(layout) << "0 coordinator\n1 gpu-expert 0\n2 cpu-expert\n";
  const JobResult r = run_node(3,
                               {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                "--ngen", "2", "--layout", layout.string()},
                               {{"CUDA_VISIBLE_DEVICES", ""}});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  const std::string line = "colibri-node: error: layout " + layout.string() + ": rank 1@" +
                           short_hostname() + " is a gpu-expert (GPU 0) but sees no CUDA device (";
  EXPECT_NE(r.err.find(line), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("make it a cpu-expert"), std::string::npos) << describe(r);
  size_t errors = 0;
  for (const std::string& l : lines_of(r.err)) errors += l.rfind("colibri-node: error:", 0) == 0;
  EXPECT_EQ(errors, 1u) << r.err;
  EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
}

// --transport nccl where NCCL cannot run (a build without NCCL; with NCCL, a coordinator without a
// gpu in the layout) is one error naming the rank.
TEST(MpiCli, TransportNcclThatCannotRunIsRefusedNamingTheRank) {
  const JobResult r = run_node(2, {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                   "--ngen", "2", "--transport", "nccl"});
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
#ifdef COLIBRI_HAVE_NCCL
  const std::string line = "colibri-node: error: --transport nccl: the coordinator rank 0@" +
                           short_hostname() + " has no gpu in layout default";
#else
  const std::string line = "colibri-node: error: --transport nccl: rank 0@" + short_hostname() +
                           " was built without NCCL";
#endif
  EXPECT_NE(r.err.find(line), std::string::npos) << describe(r);
  size_t errors = 0;
  for (const std::string& l : lines_of(r.err)) errors += l.rfind("colibri-node: error:", 0) == 0;
  EXPECT_EQ(errors, 1u) << r.err;
  EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
}

// --experts gpu: a single process's experts on its GPU. Without a visible device it is refused
// with the reason; under mpirun it is refused too (expert ranks take gpu-expert in --layout).
TEST(MpiCli, ExpertsOnGpuNeedADeviceAndASingleProcess) {
  const std::vector<std::string> args = {
      "--model", kModel.string(), "--prompt-ids", golden().prompt_arg, "--ngen",
      "2",       "--experts",     "gpu"};
  const JobResult alone = run_node(1, args, {{"CUDA_VISIBLE_DEVICES", ""}});
  expect_clean_end(alone);
  EXPECT_NE(alone.exit_code, 0) << describe(alone);
  EXPECT_NE(
      alone.err.find("colibri-node: error: --experts gpu: this process sees no CUDA device: "),
      std::string::npos)
      << describe(alone);
  EXPECT_TRUE(parse_tokens(alone.out).empty()) << alone.out;

  const JobResult three = run_node(3, args);
  expect_clean_end(three);
  EXPECT_NE(three.exit_code, 0) << describe(three);
  EXPECT_NE(three.err.find("--experts gpu is for a single process"), std::string::npos)
      << describe(three);
  EXPECT_TRUE(parse_tokens(three.out).empty()) << three.out;
}

// --coordinator-gpu, or a gpu in the coordinator's layout row: the coordinator's forward on its
// GPU. Without a visible device (or without CUDA built) it is refused with the reason, and
// --coordinator-gpu under mpirun is refused too.
TEST(MpiCli, CoordinatorOnGpuNeedsADevice) {
  const std::vector<std::string> args = {"--model",           kModel.string(), "--prompt-ids",
                                         golden().prompt_arg, "--ngen",        "2"};
  std::vector<std::string> flag = args;
  flag.push_back("--coordinator-gpu");
  const JobResult alone = run_node(1, flag, {{"CUDA_VISIBLE_DEVICES", ""}});
  expect_clean_end(alone);
  EXPECT_NE(alone.exit_code, 0) << describe(alone);
  EXPECT_NE(alone.err.find("colibri-node: error: the coordinator on a GPU: rank 0@" +
                           short_hostname() + " sees no CUDA device: "),
            std::string::npos)
      << describe(alone);
  EXPECT_TRUE(parse_tokens(alone.out).empty()) << alone.out;

  const JobResult three = run_node(3, flag);
  expect_clean_end(three);
  EXPECT_NE(three.exit_code, 0) << describe(three);
  EXPECT_NE(three.err.find("--coordinator-gpu is for a single process"), std::string::npos)
      << describe(three);

  const ScratchDir dir;
  const fs::path layout = dir.path() / "coordinator-gpu.layout";
  std::ofstream(layout) << "0 coordinator 0\n1 cpu-expert\n2 cpu-expert\n";
  std::vector<std::string> with_layout = args;
  with_layout.insert(with_layout.end(), {"--layout", layout.string()});
  const JobResult laid_out = run_node(3, with_layout, {{"CUDA_VISIBLE_DEVICES", ""}});
  expect_clean_end(laid_out);
  EXPECT_NE(laid_out.exit_code, 0) << describe(laid_out);
  EXPECT_NE(laid_out.err.find("the coordinator on a GPU: rank 0@" + short_hostname() +
                              " sees no CUDA device: "),
            std::string::npos)
      << describe(laid_out);
  EXPECT_TRUE(parse_tokens(laid_out.out).empty()) << laid_out.out;
}

// ---- h. bad input at three ranks: refused at start-up, quickly, nothing destroyed
// ----------------

// Every rank checks the same arguments; whichever reports first ends the job.
constexpr double kRefusalSeconds = 15;

void expect_refused(const JobResult& r, const std::vector<std::string>& parts) {
  expect_clean_end(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_LT(r.elapsed_s, kRefusalSeconds) << describe(r);
  for (const auto& part : parts) EXPECT_NE(r.err.find(part), std::string::npos) << describe(r);
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << describe(r);
  EXPECT_TRUE(parse_tokens(r.out).empty()) << r.out;
}

TEST(MpiCli, OutputThatIsADeviceOrADirectoryIsRefusedAndKept) {
  const ScratchDir dir;
  const fs::path sub = dir.path() / "sub";
  fs::create_directory(sub);
  for (const auto& [flag, path, reason] :
       {std::tuple<std::string, std::string, std::string>{"--logits-out", "/dev/null",
                                                          "is a character device"},
        {"--trace", sub.string(), "is a directory"},
        {"--profile-json", (dir.path() / "missing" / "p.json").string(),
         "No such file or directory"}}) {
    SCOPED_TRACE(flag + " " + path);
    const JobResult r = run_node(3, {"--model", kModel.string(), "--prompt-ids",
                                     golden().prompt_arg, "--ngen", "2", flag, path});
    expect_refused(r, {flag + " " + path, reason});
  }
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  EXPECT_TRUE(fs::is_directory(sub));
  EXPECT_TRUE(fs::is_empty(sub));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

// --output under mpirun: the coordinator writes what it would print into the file (nothing on
// stdout, whose failed writes mpirun's forwarding would hide); a full device is refused at start.
TEST(MpiCli, OutputFileHoldsWhatStdoutWould) {
  const ScratchDir dir;
  const std::vector<std::string> args = {"--model",           kModel.string(), "--prompt-ids",
                                         golden().prompt_arg, "--ngen",        "4",
                                         "--ignore-eos",      "--quiet"};
  const JobResult printed = run_node(3, args);
  expect_clean_end(printed);
  ASSERT_EQ(printed.exit_code, 0) << describe(printed);
  ASSERT_FALSE(printed.out.empty());
  std::vector<std::string> to_file = args;
  const fs::path file = dir.path() / "out.txt";
  to_file.insert(to_file.end(), {"--output", file.string()});
  const JobResult written = run_node(3, to_file);
  expect_clean_end(written);
  ASSERT_EQ(written.exit_code, 0) << describe(written);
  EXPECT_EQ(written.out, "");
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes, printed.out);
  std::vector<std::string> full = args;
  full.insert(full.end(), {"--output", "/dev/full"});
  expect_refused(run_node(3, full), {"--output /dev/full", "is a character device"});
}

TEST(MpiCli, BadNumbersAreRefusedNotWrapped) {
  for (const auto& [args, message] :
       {std::pair<std::vector<std::string>, std::string>{{"--seed", "-1"}, "--seed '-1'"},
        {{"--rank-timeout", "nan"}, "--rank-timeout nan"},
        {{"--ram-gb", "1e300"}, "--ram-gb 1e+300"}}) {
    SCOPED_TRACE(message);
    std::vector<std::string> node_args = {"--model",           kModel.string(), "--prompt-ids",
                                          golden().prompt_arg, "--ngen",        "2"};
    node_args.insert(node_args.end(), args.begin(), args.end());
    expect_refused(run_node(3, node_args), {message});
  }
}

TEST(MpiCli, FifoInTheModelDirectoryDoesNotBlock) {
  const ScratchDir dir;
  const fs::path model = dir.path() / "model";
  fs::create_directory(model);
  for (const auto& entry : fs::directory_iterator(kModel))
    if (entry.path().filename() != "generation_config.json")
      fs::create_symlink(fs::absolute(entry.path()), model / entry.path().filename());
  const fs::path fifo = model / "generation_config.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const JobResult r =
      run_node(3, {"--model", model.string(), "--prompt-ids", golden().prompt_arg, "--ngen", "2"});
  expect_refused(r, {fifo.string(), "FIFO (named pipe), not a regular file"});
  EXPECT_TRUE(fs::is_fifo(fifo));
}

TEST(MpiCli, GenerationPastTheContextIsRefusedWithTheCounts) {
  const JobResult r = run_node(
      3, {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg, "--ngen", "5000"});
  expect_refused(r,
                 {"--ngen 5000", "prompt of " + std::to_string(golden().prompt.size()) + " tokens",
                  "context of 4096"});
}

// ---- g. one process ----------------------------------------------------------------------------

TEST(MpiCli, SingleRankGeneratesTheGoldenTokens) {
  const int ngen = int(golden().greedy.size());
  const JobResult r = run_node(1, {"--model", kModel.string(), "--prompt-ids", golden().prompt_arg,
                                   "--ngen", std::to_string(ngen), "--ignore-eos"});
  expect_clean_end(r);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  ASSERT_GE(ngen, 6);
  EXPECT_EQ(parse_tokens(r.out), golden().greedy) << r.out;
}

// ---- calibrate's exchange ----------------------------------------------------------------------

// `calibrate` alone, then `mpirun -np 2 colibri-node calibrate --exchange` adds the exchange's
// raw times and the links to the same file; without a calibration to add to, the job ends at
// once naming the file.
TEST(MpiCli, CalibrateExchangeAddsTheLinksToTheCalibration) {
  const ScratchDir dir;
  const fs::path out = dir.path() / "hardware.json";
  const JobResult alone =
      run_job({COLIBRI_NODE_BINARY, "calibrate", "--quick", "--out", out.string()});
  expect_clean_end(alone);
  ASSERT_EQ(alone.exit_code, 0) << describe(alone);
  const JobResult r =
      run_node(2, {"calibrate", "--exchange", "--quick", "--hidden", "256", "--out", out.string()});
  expect_clean_end(r);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::ifstream in(out);
  const json doc = json::parse(in);
  ASSERT_TRUE(doc["calibration"]["exchange"].is_object()) << doc.dump(2);
  EXPECT_EQ(doc["calibration"]["exchange"]["median_us"].size(), 4u);
  for (const json& us : doc["calibration"]["exchange"]["median_us"]) EXPECT_GT(us.get<double>(), 0);
  EXPECT_TRUE(doc["links"].contains("shm_us")) << doc.dump(2);
  EXPECT_TRUE(doc["calibration"]["experts"].contains("int4"));  // the rest kept

  const JobResult missing = run_node(
      2, {"calibrate", "--exchange", "--quick", "--out", (dir.path() / "none.json").string()});
  expect_clean_end(missing);
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("none.json cannot be read"), std::string::npos) << describe(missing);
}

}  // namespace
}  // namespace colibri
