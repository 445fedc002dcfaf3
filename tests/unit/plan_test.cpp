// colibri-node plan (src/plan/plan.h): the critical path of a hand-made machine against a hand
// computation, budgets kept, hardware descriptions refused naming the field, and the subcommand.
#include "plan/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.h"
#include "model_writer.h"
#include "plan/calibrate.h"
#include "plan/plan_main.h"
#include "plan/tune.h"

namespace colibri {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

// The tiny model with two routed experts, both routed for every row: a step's expert part has
// no chance in it.
ModelConfig every_expert_routed() {
  test::TinyModel tiny;
  tiny.config["n_routed_experts"] = 2;
  tiny.config["num_experts_per_tok"] = 2;
  tiny.config["n_group"] = 1;
  tiny.config["topk_group"] = 1;
  return parse_model_config(tiny.config.dump(), "tiny config.json");
}

// One host, one socket of 10 GB/s (10 a core, 2 cores), compute that never binds, a disk of 1 GB/s,
// exchange 10 us + 1 GB/s.
const char* kMachine = R"({"hosts": [{"name": "box", "sockets": [{"cores": 2, "mem_gbps": 10,
    "core_gbps": 10, "gflops": 1e9}], "disk_gbps": 1}],
    "links": {"shm_us": 10, "shm_gbps": 1}})";

Layout three_ranks(double ram_gb = 0) {
  std::string text = "0 coordinator\n";
  for (int r = 1; r <= 2; ++r)
    text += ram_gb > 0 ? fmt::format("{} cpu-expert - - {}\n", r, ram_gb)
                       : fmt::format("{} cpu-expert\n", r);
  return parse_layout(text, "test layout", 3);
}

TEST(Plan, TheCriticalPathOfAHandMadeMachineIsTheHandComputation) {
  const ModelConfig config = every_expert_routed();
  const ModelBytes bytes = model_bytes(config, "bf16");
  const Layout layout = three_ranks();
  const PlacementTable placement =
      make_placement(config, layout, PlacementPolicy::kBalanced, bytes.expert);
  const Hardware hw = parse_hardware(kMachine, "machine.json");
  PlanOptions options;
  options.batches = {1, 3};
  options.context_tokens = 100;
  options.samples = 16;
  const Plan plan = make_plan(config, bytes, layout, placement, hw, options);
  ASSERT_EQ(plan.batches.size(), 2u);
  // Two expert ranks share the socket: 5 GB/s each (one core's 10 is not the limit). Each holds
  // one expert and reads it once a step; its exchange is 10 us + rows x hidden x 4 B x 2 at 1 GB/s.
  for (const BatchPlan& b : plan.batches) {
    const double read = double(bytes.expert) / 5e9;
    const double link = 10e-6 + double(b.rows) * config.hidden_size * 4 * 2 / 1e9;
    EXPECT_NEAR(b.experts_s, read + link, 1e-12) << b.rows << " rows";
    // The coordinator: every layer's dense weights and the head at 10 GB/s, and each row's KV
    // reads of 100 tokens.
    double coordinator = double(bytes.head) / 10e9;
    for (uint64_t layer : bytes.dense_layer) coordinator += double(layer) / 10e9;
    coordinator += double(bytes.kv_per_token) * 100 * b.rows / 10e9;
    EXPECT_NEAR(b.coordinator_s, coordinator, 1e-12) << b.rows << " rows";
    EXPECT_NEAR(b.decode_tok_s, b.rows / (coordinator + read + link), 1e-6);
  }
  // Both owners are as slow: between them they are the slowest of every sampled layer.
  EXPECT_DOUBLE_EQ(plan.ranks[1].slowest_share + plan.ranks[2].slowest_share, 1.0);
  // What the slowest spent most time on: the exchange's 10 us, against the expert's read.
  const double read = double(bytes.expert) / 5e9, link = 10e-6 + config.hidden_size * 4 * 2 / 1e9;
  EXPECT_EQ(plan.ranks[1].slowest_by, link > read ? "link" : "ram");
}

TEST(Plan, RamBudgetsAreKeptAndTheRestGoesToDisk) {
  test::TinyModel tiny;
  tiny.config["n_routed_experts"] = 16;
  tiny.config["num_experts_per_tok"] = 4;
  const ModelConfig config = parse_model_config(tiny.config.dump(), "tiny config.json");
  const ModelBytes bytes = model_bytes(config, "int4");
  // Room for 3 of each rank's 8 experts.
  const double ram_gb = 3.5 * double(bytes.expert) / (1 << 30);  // GiB, as a layout
  const Layout layout = three_ranks(ram_gb);
  const PlacementTable placement =
      make_placement(config, layout, PlacementPolicy::kBalanced, bytes.expert);
  const Plan plan = make_plan(config, bytes, layout, placement,
                              parse_hardware(kMachine, "machine.json"), PlanOptions{});
  uint64_t held = 0;
  for (int r = 1; r <= 2; ++r) {
    const RankPlan& rank = plan.ranks[size_t(r)];
    EXPECT_LE(double(rank.ram_bytes), ram_gb * (1 << 30)) << "rank " << r;
    EXPECT_EQ(rank.ram_bytes, 3 * bytes.expert) << "rank " << r;
    EXPECT_EQ(rank.vram_bytes, 0u);
    held += rank.ram_bytes + rank.disk_bytes;
  }
  EXPECT_EQ(held, uint64_t(config.num_moe_layers()) * 16 * bytes.expert);
  // The experts on disk (0.5 GB/s a rank, against 5 from RAM) make the step's expert part
  // slower than with every expert resident.
  const Layout resident = three_ranks();
  const Plan all_in_ram =
      make_plan(config, bytes, resident,
                make_placement(config, resident, PlacementPolicy::kBalanced, bytes.expert),
                parse_hardware(kMachine, "machine.json"), PlanOptions{});
  for (size_t b = 0; b < plan.batches.size(); ++b)
    EXPECT_GT(plan.batches[b].experts_s, all_in_ram.batches[b].experts_s) << b;
  EXPECT_EQ(all_in_ram.ranks[1].disk_bytes, 0u);
  // Replicas take room in their holders' budgets too.
  const PlacementTable replicated =
      make_placement(config, layout, PlacementPolicy::kHeat, bytes.expert, nullptr, 4);
  const Plan with_replicas = make_plan(config, bytes, layout, replicated,
                                       parse_hardware(kMachine, "machine.json"), PlanOptions{});
  uint64_t copies = 0;
  for (int r = 1; r <= 2; ++r) {
    EXPECT_LE(double(with_replicas.ranks[size_t(r)].ram_bytes), ram_gb * (1 << 30)) << "rank " << r;
    copies += with_replicas.ranks[size_t(r)].ram_bytes + with_replicas.ranks[size_t(r)].disk_bytes;
  }
  EXPECT_EQ(copies,
            (uint64_t(config.num_moe_layers()) * 16 + uint64_t(replicated.replica_count())) *
                bytes.expert);
}

TEST(Plan, PerCallCostsAddToTheHandComputation) {
  // kMachine with a fixed cost of 4 us per coordinator matrix product and 100 us per BF16 expert
  // call (measured with the whole socket: each of the two owners sharing it pays 200 us).
  const char* with_calls = R"({"hosts": [{"name": "box", "sockets": [{"cores": 2, "mem_gbps": 10,
      "core_gbps": 10, "gflops": 1e9, "linear_us": 4, "expert_us": {"bf16": 100, "int4": 7}}],
      "disk_gbps": 1}], "links": {"shm_us": 10, "shm_gbps": 1}})";
  const ModelConfig config = every_expert_routed();
  const ModelBytes bytes = model_bytes(config, "bf16");
  const Layout layout = three_ranks();
  const PlacementTable placement =
      make_placement(config, layout, PlacementPolicy::kBalanced, bytes.expert);
  PlanOptions options;
  options.batches = {1, 3};
  options.samples = 16;
  const Plan base =
      make_plan(config, bytes, layout, placement, parse_hardware(kMachine, "m.json"), options);
  const Plan plan =
      make_plan(config, bytes, layout, placement, parse_hardware(with_calls, "m.json"), options);
  int calls = 1;  // the head
  for (int c : bytes.dense_layer_calls) calls += c;
  for (size_t b = 0; b < plan.batches.size(); ++b) {
    EXPECT_NEAR(plan.batches[b].coordinator_s - base.batches[b].coordinator_s, calls * 4e-6, 1e-12);
    EXPECT_NEAR(plan.batches[b].experts_s - base.batches[b].experts_s,
                config.num_moe_layers() * 200e-6, 1e-12);
  }
  // Three ranks on two cores run one thread each: the one-thread figures where measured.
  const char* one_thread = R"({"hosts": [{"name": "box", "sockets": [{"cores": 2, "mem_gbps": 10,
      "core_gbps": 10, "gflops": 1e9, "linear_us": 4, "linear_us_one_thread": 1,
      "expert_us": {"bf16": 100}, "expert_us_one_thread": {"bf16": 30}}], "disk_gbps": 1}],
      "links": {"shm_us": 10, "shm_gbps": 1}})";
  const Plan single =
      make_plan(config, bytes, layout, placement, parse_hardware(one_thread, "m.json"), options);
  EXPECT_NEAR(single.batches[0].experts_s - base.batches[0].experts_s,
              config.num_moe_layers() * 30e-6, 1e-12);
  for (const RankPlan& r : single.ranks) EXPECT_EQ(r.threads, 1.0) << "rank " << r.rank;
  EXPECT_NEAR(single.batches[0].coordinator_s - base.batches[0].coordinator_s, calls * 1e-6, 1e-12);
  // A measured kernel rate replaces the socket's read for the experts only.
  const char* kernel_rate = R"({"hosts": [{"name": "box", "sockets": [{"cores": 2, "mem_gbps": 10,
      "core_gbps": 10, "gflops": 1e9, "expert_gbps": {"bf16": 4}}], "disk_gbps": 1}],
      "links": {"shm_us": 10, "shm_gbps": 1}})";
  const Plan slower =
      make_plan(config, bytes, layout, placement, parse_hardware(kernel_rate, "m.json"), options);
  EXPECT_NEAR(slower.batches[0].experts_s - base.batches[0].experts_s,
              config.num_moe_layers() * (double(bytes.expert) / 2e9 - double(bytes.expert) / 5e9),
              1e-12);
  EXPECT_DOUBLE_EQ(slower.batches[0].coordinator_s, base.batches[0].coordinator_s);
  // A measured matrix-product rate replaces it for the coordinator's dense weights (not its KV).
  const char* dense_rate = R"({"hosts": [{"name": "box", "sockets": [{"cores": 2, "mem_gbps": 10,
      "core_gbps": 10, "gflops": 1e9, "linear_gbps": {"bf16": 5}}], "disk_gbps": 1}],
      "links": {"shm_us": 10, "shm_gbps": 1}})";
  const Plan dense =
      make_plan(config, bytes, layout, placement, parse_hardware(dense_rate, "m.json"), options);
  double dense_bytes = double(bytes.head);
  for (uint64_t b : bytes.dense_layer) dense_bytes += double(b);
  EXPECT_NEAR(dense.batches[0].coordinator_s - base.batches[0].coordinator_s,
              dense_bytes / 5e9 - dense_bytes / 10e9, 1e-12);
  EXPECT_DOUBLE_EQ(dense.batches[0].experts_s, base.batches[0].experts_s);
}

TEST(Plan, ACalibrationNamesItselfAndAnotherVersionIsRefused) {
  const std::string calibrated = R"({"calibration": {"version": 1, "date": "2026-12-07"},
      "hosts": [{"name": "box", "sockets": [{"cores": 2, "mem_gbps": 10, "gflops": 5,
      "expert_gbps": {"int4": 3}}], "disk_gbps": 1}]})";
  const Hardware hw = parse_hardware(calibrated, "hw.json");
  bool named = false;
  for (const PlanConstant& c : hw.constants)
    if (c.name == "box socket 0 expert kernel read int4")
      named = c.source == "calibration hw.json (2026-12-07)" && c.value == 3;
  EXPECT_TRUE(named);
  try {
    std::string old = calibrated;
    old.replace(old.find("\"version\": 1"), 12, "\"version\": 0");
    parse_hardware(old, "hw.json");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("calibration version 0 is not this build's (1)"));
  }
  try {
    std::string bad = calibrated;
    bad.replace(bad.find("\"int4\": 3"), 9, "\"int3\": 3");
    parse_hardware(bad, "hw.json");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("hw.json: hosts[0].sockets[0].expert_gbps: \"int3\" is not"));
  }
}

TEST(PlanSearch, CandidatesAreRankedBudgetsSplitTheHostAndTheBestRoundTrips) {
  test::TinyModel tiny;
  tiny.config["n_routed_experts"] = 16;
  tiny.config["num_experts_per_tok"] = 4;
  const ModelConfig config = parse_model_config(tiny.config.dump(), "tiny config.json");
  const ModelBytes bytes = model_bytes(config, "int4");
  // Two sockets and two GPUs, 64 GB of memory; GPU 0 too small for the coordinator's weights.
  const Hardware hw = parse_hardware(R"({"hosts": [{"name": "box", "ram_gb": 64,
      "sockets": [{"cores": 4, "mem_gbps": 20, "gflops": 100},
                  {"cores": 4, "mem_gbps": 20, "gflops": 100}],
      "gpus": [{"name": "small", "vram_gb": 1e-6, "hbm_gbps": 500, "pcie_gbps": 10, "tflops": 10},
               {"name": "big", "vram_gb": 8, "hbm_gbps": 500, "pcie_gbps": 10, "tflops": 10}],
      "disk_gbps": 1}]})",
                                     "box.json");
  SearchOptions options;
  options.plan.batches = {1, 8};
  options.plan.samples = 16;
  const std::vector<SearchCandidate> found = search_layouts(config, bytes, hw, options);
  ASSERT_EQ(found.size(), 6u);  // coordinator CPU / GPU 0 x 0, 1, 2 cpu-expert ranks a socket
  uint64_t coordinator_bytes = bytes.head + bytes.kv_per_token * 1024;
  for (uint64_t b : bytes.dense_layer) coordinator_bytes += b;
  for (size_t i = 0; i < found.size(); ++i) {
    const SearchCandidate& c = found[i];
    const bool on_gpu = c.layout.ranks[0].gpu == 0;
    EXPECT_EQ(c.refused.empty(), !on_gpu) << c.summary;
    if (i + 1 < found.size() && found[i + 1].refused.empty()) {
      EXPECT_GE(c.plan.batches[0].decode_tok_s, found[i + 1].plan.batches[0].decode_tok_s);
    }
    // Every GPU not the coordinator's holds a gpu-expert rank with 90 % of its memory.
    int gpu_ranks = 0;
    double ram = 0;
    for (const RankSpec& r : c.layout.ranks) {
      if (r.role == Role::kGpuExpert) {
        ++gpu_ranks;
        EXPECT_DOUBLE_EQ(r.vram_gb,
                         0.9 * hw.hosts[0].gpus[size_t(r.gpu)].vram_gb * 1e9 / (1 << 30));
      }
      if (r.role != Role::kCoordinator) ram += r.ram_gb;
    }
    EXPECT_EQ(gpu_ranks, on_gpu ? 1 : 2) << c.summary;
    // At most 6 ranks on 8 cores: the coordinator computes with all of them.
    EXPECT_EQ(c.plan.ranks[0].threads, 8.0) << c.summary;
    // 64 GB hold every expert of this model: no RAM budget is set.
    EXPECT_EQ(ram, 0) << c.summary;
    EXPECT_THAT(c.summary, HasSubstr("every expert resident"));
  }
  // A host with room for about half of the experts: budgets split what is left of it evenly.
  uint64_t all_experts = uint64_t(config.num_moe_layers()) * 16 * bytes.expert;
  const double ram_gb = (double(coordinator_bytes) + 0.5 * double(all_experts)) / 1e9 / 0.9;
  const Hardware tight = parse_hardware(
      fmt::format(R"({{"hosts": [{{"name": "box", "ram_gb": {}, "sockets": [{{"cores": 4,
          "mem_gbps": 20, "gflops": 100}}], "disk_gbps": 1}}]}})",
                  ram_gb),
      "tight.json");
  for (const SearchCandidate& c : search_layouts(config, bytes, tight, options)) {
    double ram = 0;
    for (const RankSpec& r : c.layout.ranks) ram += r.ram_gb;
    EXPECT_NEAR(ram, 0.5 * double(all_experts) / (1 << 30), 1e-9) << c.summary;
    EXPECT_GT(c.plan.ranks[1].disk_bytes, 0u) << c.summary;
  }
  // Without RAM budgets every expert would stay in RAM: more than that host has.
  SearchOptions unbudgeted = options;
  unbudgeted.ram_budgets = false;
  for (const SearchCandidate& c : search_layouts(config, bytes, tight, unbudgeted))
    EXPECT_THAT(c.refused, HasSubstr("would stay in the RAM of box")) << c.summary;
  // The best as a layout file reads back as the same ranks, and plans to the same speed.
  const SearchCandidate& best = found.front();
  const std::string text = layout_text(best.layout, "best of the test\nsecond line");
  EXPECT_EQ(text.rfind("# best of the test\n# second line\n", 0), 0u) << text;
  const Layout again = parse_layout(text, "best.layout", int(best.layout.ranks.size()));
  ASSERT_EQ(again.ranks.size(), best.layout.ranks.size());
  for (size_t r = 0; r < again.ranks.size(); ++r) {
    EXPECT_EQ(again.ranks[r].role, best.layout.ranks[r].role);
    EXPECT_EQ(again.ranks[r].gpu, best.layout.ranks[r].gpu);
    EXPECT_EQ(again.ranks[r].numa, best.layout.ranks[r].numa);
    EXPECT_NEAR(again.ranks[r].ram_gb, best.layout.ranks[r].ram_gb, 1e-5);
    EXPECT_NEAR(again.ranks[r].vram_gb, best.layout.ranks[r].vram_gb, 1e-5);
  }
}

TEST(Plan, AHardwareDescriptionMissingAFieldIsRefusedNamingIt) {
  try {
    parse_hardware(R"({"hosts": [{"name": "a", "sockets": [{"cores": 4, "gflops": 1}],
                       "disk_gbps": 1}]})",
                   "hw.json");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("hw.json: hosts[0].sockets[0]: missing \"mem_gbps\""));
  }
  try {
    parse_hardware(R"({"hosts": [{"name": "a", "sockets": [{"cores": 4, "mem_gbps": -1,
                       "gflops": 1}], "disk_gbps": 1}]})",
                   "hw.json");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("\"mem_gbps\" must be a finite number >= 0"));
  }
  EXPECT_THROW(parse_hardware("[]", "hw.json"), Error);
  // A rank on a GPU the host does not have.
  const ModelConfig config = every_expert_routed();
  const ModelBytes bytes = model_bytes(config, "bf16");
  const Layout layout = parse_layout("0 coordinator\n1 gpu-expert 0\n", "l", 2);
  try {
    make_plan(config, bytes, layout,
              make_placement(config, layout, PlacementPolicy::kBalanced, bytes.expert),
              parse_hardware(kMachine, "machine.json"), PlanOptions{});
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank 1: GPU 0 is not in host 'box' (0 GPUs)"));
  }
}

TEST(Plan, ConstantsSayWhereTheyCameFrom) {
  const Hardware hw = parse_hardware(kMachine, "machine.json");
  bool link_from_file = false, link_default = false;
  for (const PlanConstant& c : hw.constants) {
    if (c.name == "exchange shm_us") link_from_file = c.source == "machine.json" && c.value == 10;
    if (c.name == "exchange link_us") link_default = c.source == "default";
  }
  EXPECT_TRUE(link_from_file);
  EXPECT_TRUE(link_default);
}

// The subcommand as a script uses it: --np on the embedded model, JSON with the keys scripts rely
// on; a missing layout choice and a bad hardware file are one error line and exit 1.
// A subcommand's main on `args` (its name first, as main() passes it), with its stdout and stderr.
int run_main(int (*main_fn)(int, char**), const char* name, std::vector<std::string> args,
             std::string* out, std::string* err) {
  args.insert(args.begin(), name);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int code = main_fn(int(argv.size()), argv.data());
  *out = ::testing::internal::GetCapturedStdout();
  *err = ::testing::internal::GetCapturedStderr();
  return code;
}

int run_plan(std::vector<std::string> args, std::string* out, std::string* err) {
  return run_main(plan_main, "plan", std::move(args), out, err);
}

TEST(PlanCommand, JsonCarriesDecodeTtftAndTheCriticalPath) {
  test::TempDir dir;
  const std::string hardware = (dir.path() / "machine.json").string();
  std::ofstream(hardware) << kMachine;
  const std::string model =
      (std::filesystem::path(COLIBRI_TEST_DATA) / ".." / ".." / "models" / "glm5-tiny-kjv")
          .string();
  std::string out, err;
  ASSERT_EQ(run_plan({"--model", model, "--hardware", hardware, "--np", "3", "--json"}, &out, &err),
            0)
      << err;
  const json plan = json::parse(out);
  EXPECT_GT(plan["decode_tok_s"]["1"].get<double>(), 0);
  EXPECT_GT(plan["decode_tok_s"]["64"].get<double>(), plan["decode_tok_s"]["1"].get<double>());
  EXPECT_GT(plan["ttft_s"].get<double>(), 0);
  ASSERT_EQ(plan["ranks"].size(), 3u);
  EXPECT_EQ(plan["ranks"][0]["role"], "coordinator");
  EXPECT_EQ(plan["critical_path"].size(), 3u);
  // The owners hold the routed experts in their tiers.
  uint64_t held = 0;
  for (const json& r : plan["ranks"])
    held += r["vram_bytes"].get<uint64_t>() + r["ram_bytes"].get<uint64_t>() +
            r["disk_bytes"].get<uint64_t>();
  EXPECT_GT(held, 0u);

  EXPECT_EQ(run_plan({"--model", model, "--hardware", hardware}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("give --np N, --layout FILE or --search"));
  std::ofstream(hardware) << "{\"hosts\": []}";
  EXPECT_EQ(run_plan({"--model", model, "--hardware", hardware, "--np", "3"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("\"hosts\" must be a non-empty array"));
}

TEST(PlanCommand, SearchWritesTheBestLayoutThatPlansTheSame) {
  test::TempDir dir;
  const std::string hardware = (dir.path() / "machine.json").string();
  std::ofstream(hardware) << kMachine;
  const std::string layout = (dir.path() / "best.layout").string();
  const std::string model =
      (std::filesystem::path(COLIBRI_TEST_DATA) / ".." / ".." / "models" / "glm5-tiny-kjv")
          .string();
  std::string out, err;
  ASSERT_EQ(run_plan({"--model", model, "--hardware", hardware, "--search", "--search-out", layout,
                      "--batches", "1", "--json"},
                     &out, &err),
            0)
      << err;
  const json found = json::parse(out);
  ASSERT_EQ(found["candidates"].size(), 2u);  // 1 or 2 cpu-expert ranks on the one socket
  const double best = found["candidates"][0]["decode_tok_s"]["1"].get<double>();
  EXPECT_GE(best, found["candidates"][1]["decode_tok_s"]["1"].get<double>());
  ASSERT_EQ(run_plan({"--model", model, "--hardware", hardware, "--layout", layout, "--batches",
                      "1", "--json"},
                     &out, &err),
            0)
      << err;
  EXPECT_NEAR(json::parse(out)["decode_tok_s"]["1"].get<double>(), best, best * 1e-6);
  EXPECT_EQ(
      run_plan({"--model", model, "--hardware", hardware, "--search", "--np", "3"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("--search plans its own layouts"));
}

int run_calibrate(std::vector<std::string> args, std::string* out, std::string* err) {
  return run_main(calibrate_main, "calibrate", std::move(args), out, err);
}

// calibrate --quick writes a description with its fingerprint and raw numbers at the default
// path, which plan then reads without --hardware, naming the calibration as its constants' source.
TEST(CalibrateCommand, WritesADescriptionThatPlanReadsByDefault) {
  test::TempDir dir;
  const std::string saved = std::getenv("XDG_CONFIG_HOME") ? std::getenv("XDG_CONFIG_HOME") : "";
  ::setenv("XDG_CONFIG_HOME", dir.path().c_str(), 1);
  const std::string path = default_hardware_path();
  EXPECT_EQ(path, (dir.path() / "colibri-node" / "hardware.json").string());
  const std::string model =
      (std::filesystem::path(COLIBRI_TEST_DATA) / ".." / ".." / "models" / "glm5-tiny-kjv")
          .string();
  std::string out, err;
  EXPECT_EQ(run_plan({"--model", model, "--np", "3"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("no calibration of this machine at " + path));
  ASSERT_EQ(run_calibrate({"--quick"}, &out, &err), 0) << err;
  EXPECT_THAT(out, HasSubstr("experts int4"));
  std::ifstream in(path);
  const json doc = json::parse(in);
  EXPECT_EQ(doc["calibration"]["version"], kCalibrationVersion);
  EXPECT_FALSE(doc["calibration"]["machine"]["cpu"].get<std::string>().empty());
  EXPECT_GT(doc["calibration"]["machine"]["threads"].get<int>(), 0);
  for (const char* format : {"bf16", "int8", "int4"}) {
    const json& e = doc["calibration"]["experts"][format];
    EXPECT_GT(e["call_us"].get<double>(), 0) << format;
    EXPECT_GT(e["gbps"].get<double>(), 0) << format;
    EXPECT_GT(e["gflops"].get<double>(), 0) << format;
  }
  EXPECT_GT(doc["calibration"]["disk"]["gbps"].get<double>(), 0);
  EXPECT_THAT(doc["calibration"]["exchange"].get<std::string>(), HasSubstr("not measured"));
  const Hardware hw = parse_hardware(json(doc).dump(), path);
  ASSERT_EQ(hw.hosts.size(), 1u);
  EXPECT_GT(hw.hosts[0].sockets[0].mem_gbps, 0);
  EXPECT_EQ(hw.hosts[0].sockets[0].expert_us.size(), 3u);
  ASSERT_EQ(run_plan({"--model", model, "--np", "3"}, &out, &err), 0) << err;
  EXPECT_THAT(out, HasSubstr("(calibration " + path));
  EXPECT_THAT(out, HasSubstr("exchange shm_us = 20 us (default)"));
  // Nothing of the disk test is left behind.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path() / "colibri-node")) {
    EXPECT_EQ(entry.path().filename(), "hardware.json");
    ++files;
  }
  EXPECT_EQ(files, 1);
  if (saved.empty())
    ::unsetenv("XDG_CONFIG_HOME");
  else
    ::setenv("XDG_CONFIG_HOME", saved.c_str(), 1);
}

TEST(CalibrateCommand, WritesNothingButARegularFileAndNeedsMpirunForTheExchange) {
  std::string out, err;
  EXPECT_EQ(run_calibrate({"--quick", "--out", "/dev/null"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("/dev/null"));
  EXPECT_TRUE(std::filesystem::is_character_file("/dev/null"));
  EXPECT_EQ(run_calibrate({"--exchange", "--quick", "--out", "/dev/null"}, &out, &err), 1);
  EXPECT_THAT(err, HasSubstr("mpirun -np 2 colibri-node calibrate --exchange"));
}

// ---- tune
// ----------------------------------------------------------------------------------------

// Two knobs of two values; a fake measurement: each setting's tok/s from `rate`, with a fixed
// wobble of +1, -1 and 0 % in turn from job to job (what a shared machine does), p99 and hit
// rate as given.
struct FakeMachine {
  std::function<double(const TuneSetting&)> rate;
  std::function<double(const TuneSetting&)> p99 = [](const TuneSetting&) { return 1.0; };
  std::function<double(const TuneSetting&)> hit = [](const TuneSetting&) { return 1.0; };
  int jobs = 0;
  TuneSample operator()(const TuneSetting& s) {
    const double wobble[] = {1.01, 0.99, 1.0};
    return {rate(s) * wobble[jobs++ % 3], p99(s), hit(s)};
  }
};

std::vector<TuneKnob> two_knobs() {
  return {{"wire", {{"f32", {}, {}}, {"bf16", {"--wire", "bf16"}, {}}}},
          {"threads", {{"default", {}, {}}, {"2", {}, {{"OMP_NUM_THREADS", "2"}}}}}};
}

TEST(Tune, AGainWithinNoiseKeepsTheBaseline) {
  const std::vector<TuneKnob> knobs = two_knobs();
  // bf16 is 2 % faster: under the 3 % gate, whatever the wobble.
  FakeMachine machine{[](const TuneSetting& s) { return s.choice[0] == 1 ? 102.0 : 100.0; }};
  const TuneResult r = tune(knobs, std::ref(machine), TuneGate{}, [](const std::string&) {});
  EXPECT_EQ(r.best.choice, (std::vector<int>{0, 0}));
  ASSERT_EQ(r.trials.size(), 2u);
  EXPECT_FALSE(r.trials[0].kept);
  EXPECT_THAT(r.trials[0].why, HasSubstr("under the +3 % gate"));
  EXPECT_TRUE(r.saved);  // the defaults: nothing to re-run
  EXPECT_EQ(machine.jobs, 2 * 2 * 3);
}

TEST(Tune, ARealGainIsKeptReRunAndSaved) {
  const std::vector<TuneKnob> knobs = two_knobs();
  FakeMachine machine{[](const TuneSetting& s) {
    return (s.choice[0] == 1 ? 110.0 : 100.0) * (s.choice[1] == 1 ? 1.2 : 1.0);
  }};
  const TuneResult r = tune(knobs, std::ref(machine), TuneGate{}, [](const std::string&) {});
  EXPECT_EQ(r.best.choice, (std::vector<int>{1, 1}));
  EXPECT_TRUE(r.saved);
  EXPECT_EQ(r.best.args(knobs), (std::vector<std::string>{"--wire", "bf16"}));
  EXPECT_EQ(r.best.env(knobs).at("OMP_NUM_THREADS"), "2");
  EXPECT_EQ(r.best.describe(knobs), "wire=bf16 threads=2");
  EXPECT_NEAR(r.final_best_tok_s / r.final_baseline_tok_s, 1.32, 0.03);
}

TEST(Tune, TheGateRefusesWorseTailsAndHitRatesAndAGainThatDoesNotHold) {
  const std::vector<TuneKnob> knobs = two_knobs();
  // bf16: +10 %, but its p99 1.5x; threads=2: +10 %, but 1 point less hit rate.
  FakeMachine slow_tail{[](const TuneSetting& s) { return s.choice[0] == 1 ? 110.0 : 100.0; },
                        [](const TuneSetting& s) { return s.choice[0] == 1 ? 1.5 : 1.0; }};
  TuneResult r = tune(knobs, std::ref(slow_tail), TuneGate{}, [](const std::string&) {});
  EXPECT_FALSE(r.trials[0].kept);
  EXPECT_THAT(r.trials[0].why, HasSubstr("p99"));
  FakeMachine misses{[](const TuneSetting& s) { return s.choice[1] == 1 ? 110.0 : 100.0; },
                     [](const TuneSetting&) { return 1.0; },
                     [](const TuneSetting& s) { return s.choice[1] == 1 ? 0.98 : 0.99; }};
  r = tune(knobs, std::ref(misses), TuneGate{}, [](const std::string&) {});
  EXPECT_FALSE(r.trials[1].kept);
  EXPECT_THAT(r.trials[1].why, HasSubstr("hit rate"));
  EXPECT_EQ(r.best.choice, (std::vector<int>{0, 0}));
  // bf16 wins its comparison, then loses its gain in the re-run: the defaults stay.
  int jobs = 0;
  const TuneMeasure fading = [&](const TuneSetting& s) {
    const bool rerun = jobs++ >= 2 * 2 * 3;
    return TuneSample{s.choice[0] == 1 && !rerun ? 110.0 : 100.0, 1.0, 1.0};
  };
  r = tune(knobs, fading, TuneGate{}, [](const std::string&) {});
  EXPECT_TRUE(r.trials[0].kept);
  EXPECT_FALSE(r.saved);
  EXPECT_EQ(r.best.choice, (std::vector<int>{0, 0}));
}

TEST(Tune, TheDefaultKnobsAreExecutionKnobsOnly) {
  std::vector<std::string> names;
  for (const TuneKnob& k : default_tune_knobs(4, true)) {
    names.push_back(k.name);
    EXPECT_TRUE(k.values.front().args.empty() && k.values.front().env.empty()) << k.name;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"wire", "shared-memory", "activations", "split-linears",
                                      "prefetch-ahead", "threads", "replicas"}));
  EXPECT_EQ(default_tune_knobs(4).back().values.size(), 4u);  // threads default, 1, 2, 4
  EXPECT_EQ(default_tune_knobs(1).back().name, "threads");
}

int run_tune(std::vector<std::string> args, std::string* out, std::string* err) {
  return run_main(tune_main, "tune", std::move(args), out, err);
}

// The command with a stand-in launcher whose jobs print the score line, twice as fast with
// --wire bf16: the profile is saved and --apply prints it for the same job; a profile whose
// fingerprint names another binary is not applied, with a line saying so.
TEST(TuneCommand, SavesTheWinnerAndAppliesItOnlyToItsFingerprint) {
  test::TempDir dir;
  const std::filesystem::path launcher = dir.path() / "launch.sh";
  std::ofstream(launcher) << R"(#!/bin/sh
rate=100
for a in "$@"; do [ "$a" = bf16 ] && rate=200; done
echo "score 9 tok in 9 forward calls, 0.1 s ($rate.00 tok/s) | call p50 1.000 ms p99 2.000 ms" >&2
)";
  std::filesystem::permissions(launcher, std::filesystem::perms::owner_all);
  const std::string text = (dir.path() / "text.txt").string();
  std::ofstream(text) << "In the beginning";
  const std::string profile = (dir.path() / "tune.json").string();
  const std::string model =
      (std::filesystem::path(COLIBRI_TEST_DATA) / ".." / ".." / "models" / "glm5-tiny-kjv")
          .string();
  std::string out, err;
  ASSERT_EQ(run_tune({"--model", model, "--np", "3", "--text", text, "--knobs", "wire", "--out",
                      profile, "--launcher", launcher.string(), "--runs", "1"},
                     &out, &err),
            0)
      << err;
  EXPECT_THAT(out, HasSubstr("wire=bf16: 200.00 against 100.00 tok/s: kept, +100.0 %"));
  EXPECT_THAT(out, HasSubstr("wire=bf16 saved in " + profile));
  ASSERT_EQ(run_tune({"--model", model, "--np", "3", "--apply", "--out", profile}, &out, &err), 0);
  EXPECT_EQ(out, "arg --wire\narg bf16\n");
  EXPECT_EQ(err, "");
  // Another rank count is another topology.
  ASSERT_EQ(run_tune({"--model", model, "--np", "4", "--apply", "--out", profile}, &out, &err), 0);
  EXPECT_EQ(out, "");
  EXPECT_THAT(err, HasSubstr("is for another topology; not applied"));
  // Another binary.
  json doc = json::parse(std::ifstream(profile));
  doc["profiles"][0]["fingerprint"]["binary"] = "0000000000000000";
  std::ofstream(profile) << doc.dump();
  ASSERT_EQ(run_tune({"--model", model, "--np", "3", "--apply", "--out", profile}, &out, &err), 0);
  EXPECT_EQ(out, "");
  EXPECT_THAT(err, HasSubstr("is for another binary; not applied"));
}

}  // namespace
}  // namespace colibri
