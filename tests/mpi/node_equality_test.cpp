// The distributed node against the single-process reference (and, closing the oracle chain,
// against the transformers goldens): logits of prefill and incremental decode, greedy tokens,
// for every parity model and placement policy, at the rank count this binary was started with.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "../engine/local_model.h"
#include "../engine/schedule.h"
#include "../engine/scoped_activations.h"
#include "common/npy.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "node/node.h"
#include "rank/expert_backend.h"
#include "tokenizer/tokenizer.h"
#include "transport/local_dispatcher.h"

namespace colibri {
namespace {

const std::filesystem::path kParityDir = std::filesystem::path(COLIBRI_TEST_DATA) / "parity";

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

struct Golden {
  std::vector<int> prompt, teacher_forced, greedy;
  NpyArray logits;
};

Golden read_golden(const std::string& fixture) {
  const auto dir = kParityDir / fixture / "golden";
  std::ifstream meta_file(dir / "meta.json");
  const auto meta = nlohmann::json::parse(meta_file);
  return {meta.at("prompt_ids").get<std::vector<int>>(), meta.at("tf_ids").get<std::vector<int>>(),
          meta.at("greedy_ids").get<std::vector<int>>(), read_npy_f32(dir / "logits.npy")};
}

// Logits of prefill(prompt) then one decode step per teacher-forced token.
std::vector<float> run_sequence(ReferenceModel& model, const Golden& g) {
  KvCache cache(model.config());
  std::vector<float> logits = model.forward(g.prompt, cache);
  for (int token : g.teacher_forced) {
    const int one[] = {token};
    const auto row = model.forward(one, cache);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return logits;
}

// The same with the prompt fed one token per call: the reference then attends in the absorbed
// form, as the engine does for every row (its expanded prefill form reassociates the same sums:
// up to 1.4e-5 apart on dsv3).
std::vector<float> run_one_token_per_call(ReferenceModel& model, const Golden& g) {
  Golden one_by_one = g;
  one_by_one.prompt = {g.prompt.front()};
  one_by_one.teacher_forced.insert(one_by_one.teacher_forced.begin(), g.prompt.begin() + 1,
                                   g.prompt.end());
  return run_sequence(model, one_by_one);
}

// The same on one sequence of an engine.
std::vector<float> run_sequence(Engine& engine, const Golden& g) {
  const int seq = engine.open_sequence();
  std::vector<float> logits = engine.forward(seq, g.prompt);
  for (int token : g.teacher_forced) {
    const int one[] = {token};
    const auto row = engine.forward(seq, one);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  engine.close_sequence(seq);
  return logits;
}

// Runs the parity fixture distributed and checks it against the reference, the single-process
// engine and the transformers goldens.
void expect_equal_to_reference(const std::string& fixture, const std::string& placement,
                               bool host_combine, const std::string& layout_file = "",
                               bool split_linears = false, const std::string& routing_stats = "",
                               int replicas = 0, int repin_every = 0) {
  // Compared with transformers' fp32: NVFP4 weights with fp32 activations on every rank.
  const testing::ScopedActivations f32(kernels::QuantActivations::kF32);
  NodeOptions options;
  options.routing_stats = routing_stats;
  options.replicas = replicas;
  options.repin_every = repin_every;
  // With re-placement, also hints of the next layer's experts to owners whose RAM holds only a
  // few of theirs (the disk tier reads the rest): neither changes a result.
  options.prefetch_ahead = repin_every > 0;
  if (repin_every > 0) options.ram_gb = 16.0 / 1024 / 1024;
  options.model_dir = kParityDir / fixture / "model";
  options.placement = parse_placement_policy(placement);
  options.max_rows = 64;
  options.rank_timeout_s = 60;
  options.host_combine = host_combine;
  options.split_linears = split_linears;
  if (!layout_file.empty()) options.layout_file = layout_file;
  Node node(MPI_COMM_WORLD, options);
  if (!node.is_coordinator()) {
    node.serve();
    return;
  }
  if (node.layout().coordinator_owns_experts()) {
    EXPECT_GT(node.placement().count_owned(node.layout().coordinator()), 0);
  }
  if (replicas > 0) {
    int moe_layers = 0;
    for (bool moe : node.config().layer_is_moe) moe_layers += moe;
    EXPECT_EQ(node.placement().replica_count(), replicas * moe_layers);
  }
  if (placement == "sliced") {
    EXPECT_EQ(node.placement().slice_ranks, node.layout().owner_ranks());
    EXPECT_EQ(node.placement().slice_bounds, (std::vector<int64_t>{0, 8, 16}));
  }
  if (split_linears) {
    EXPECT_GT(node.split_linear_count(), 0);
    // Every layer's heads split too (the fixtures have at least as many heads as ranks at np 2).
    if (world_size() == 2) {
      EXPECT_EQ(node.split_heads_count(), node.config().num_layers);
    }
  }
  const Golden g = read_golden(fixture);
  Engine& engine = node.engine();
  const std::vector<float> distributed = run_sequence(engine, g);
  GenerateRequest request;
  request.prompt = g.prompt;
  request.max_new_tokens = int(g.greedy.size());
  const int seq = engine.open_sequence();
  const GenerateResult greedy =
      generate(sequence_forward(engine, seq), node.config().vocab_size, request);
  engine.close_sequence(seq);
  if (repin_every > 0 && node.layout().owner_ranks().size() > 1) {
    // Experts moved while the sequences ran, the table's epoch with them.
    ASSERT_NE(node.repin_stats(), nullptr);
    EXPECT_GT(node.repin_stats()->moves, 0u);
    EXPECT_EQ(node.placement().epoch, node.repin_stats()->changes);
    const PrefetchStats& p = engine.prefetch_stats();
    for (size_t l = 0; l < p.pairs.size(); ++l)
      EXPECT_LE(p.set_hits[l], std::min(p.set_predicted[l], p.set_routed[l]));
    EXPECT_GT(p.totals().pairs, 0u);
    EXPECT_LE(p.totals().pair_hits, p.totals().pairs);
    std::printf("[np %d %s] re-placement: %llu rounds moved %llu holders\n", world_size(),
                fixture.c_str(), static_cast<unsigned long long>(node.repin_stats()->changes),
                static_cast<unsigned long long>(node.repin_stats()->moves));
  }
  node.shutdown();

  // The single-process reference and engine, in this process, with every expert local.
  const ModelConfig& config = node.config();
  const Checkpoint checkpoint(options.model_dir, config.fp8_block, config.int4_group_size);
  const ModelWeights weights = load_model_weights(config, checkpoint);
  ReferenceModel reference(config, weights);
  const std::vector<float> expected = run_one_token_per_call(reference, g);
  // The NVFP4 copy's single process keeps its linears NVFP4, as the node does.
  const bool nvfp4 = fixture == "glm5_nvfp4";
  testing::LocalModel local(options.model_dir, /*keep_stored=*/nvfp4);
  const std::vector<float> single_process =
      run_sequence(*local.engine(EngineOptions{options.max_rows, 0, 1}), g);

  ASSERT_EQ(distributed.size(), expected.size());
  ASSERT_EQ(distributed.size(), g.logits.data.size());
  float max_vs_reference = 0, max_vs_transformers = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    max_vs_reference = std::max(max_vs_reference, std::abs(distributed[i] - expected[i]));
    max_vs_transformers =
        std::max(max_vs_transformers, std::abs(distributed[i] - g.logits.data[i]));
  }
  // With one expert owner every row sums its experts in the single-process order: bitwise
  // equal to the single-process engine, split linears or not (each rank computes whole output
  // values). More owners reorder the sum of partials. The engine attends in the absorbed form
  // where the reference expands prefill keys: equal within 1e-5, or 5e-5 with prompt chunks'
  // attention blocked (online softmax; COLIBRI_BLOCKED_ATTENTION=0: the row path).
  if (node.layout().owner_ranks().size() == 1) {
    EXPECT_EQ(distributed, single_process);
  }
  EXPECT_LE(max_vs_reference, attention_blocked() ? 5e-5f : 1e-5f);
  // The compressed-tensors INT4 and NVFP4 copies (routed experts, and NVFP4's linears, run as
  // stored): within 1e-4 of transformers on their weights dequantized.
  EXPECT_LE(max_vs_transformers, fixture.starts_with("kimi_w4a16") || nvfp4 ? 1e-4f : 1e-3f);
  const int vocab = config.vocab_size;
  for (size_t row = 0; row * vocab < expected.size(); ++row) {
    const std::span<const float> a(&distributed[row * vocab], size_t(vocab)),
        b(&expected[row * vocab], size_t(vocab));
    EXPECT_EQ(argmax(a), argmax(b)) << "position " << row;
  }
  EXPECT_EQ(greedy.tokens, g.greedy);
  std::printf("[np %d %s %s%s%s%s] max |logit diff| vs reference %.3g, vs transformers %.3g\n",
              world_size(), fixture.c_str(), placement.c_str(), host_combine ? " host combine" : "",
              node.layout().coordinator_owns_experts() ? " coordinator owns experts" : "",
              split_linears ? " split linears" : "", max_vs_reference, max_vs_transformers);
}

using Case = std::tuple<std::string, std::string>;  // fixture, placement
class NodeEquality : public ::testing::TestWithParam<Case> {};

TEST_P(NodeEquality, LogitsAndGreedyTokensEqualTheReference) {
  const auto& [fixture, placement] = GetParam();
  expect_equal_to_reference(fixture, placement, false);
}

// --combine host: on one host, every expert rank's partial goes to the lowest expert rank (rank
// 1), which sums them and replies once; at np 2 it is the only one and replies alone.
class NodeHostCombine : public ::testing::TestWithParam<std::string> {};

TEST_P(NodeHostCombine, LogitsAndGreedyTokensEqualTheReference) {
  expect_equal_to_reference(GetParam(), "round-robin", true);
}

// expect_equal_to_reference with a layout whose coordinator row has a RAM budget: the
// coordinator owns a share of the routed experts (a third at np 2), computes it while the expert
// ranks compute theirs, and adds its partial first.
void expect_equal_with_coordinator_experts(const std::string& fixture, bool host_combine,
                                           bool split_linears,
                                           const std::string& placement = "balanced") {
  const auto file = std::filesystem::temp_directory_path() /
                    ("coordinator-experts-" + std::to_string(world_size()) + ".layout");
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    std::ofstream layout(file);
    layout << "0 coordinator - - 1\n";
    for (int r = 1; r < world_size(); ++r) layout << r << " cpu-expert - - 2\n";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  expect_equal_to_reference(fixture, placement, host_combine, file.string(), split_linears);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove(file);
}

// The coordinator owning experts; with --combine host too, where the expert ranks' partials reach
// it summed by their host leader.
using CoordinatorExpertsCase = std::tuple<std::string, bool>;  // fixture, host combine
class NodeCoordinatorExperts : public ::testing::TestWithParam<CoordinatorExpertsCase> {};

TEST_P(NodeCoordinatorExperts, LogitsAndGreedyTokensEqualTheReference) {
  if (world_size() == 1) GTEST_SKIP() << "a single process owns every expert anyway";
  const auto& [fixture, host_combine] = GetParam();
  expect_equal_with_coordinator_experts(fixture, host_combine, false);
}

INSTANTIATE_TEST_SUITE_P(Models, NodeCoordinatorExperts,
                         ::testing::Combine(::testing::Values("glm5", "dsv3"), ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) +
                                  (std::get<1>(param_info.param) ? "_host_combine" : "");
                         });

// --split-linears: the coordinator's projections, dense MLPs and lm_head split by output rows
// across it and every cpu-expert rank, and its attention by heads, alone and with the
// coordinator owning experts.
using SplitCase = std::tuple<std::string, bool>;  // fixture, coordinator owns experts
class NodeSplitLinears : public ::testing::TestWithParam<SplitCase> {};

TEST_P(NodeSplitLinears, LogitsAndGreedyTokensEqualTheReference) {
  if (world_size() == 1) GTEST_SKIP() << "one process has no rank to split its linears with";
  const auto& [fixture, coordinator_experts] = GetParam();
  if (coordinator_experts)
    expect_equal_with_coordinator_experts(fixture, false, true);
  else
    expect_equal_to_reference(fixture, "balanced", false, "", true);
}

INSTANTIATE_TEST_SUITE_P(Models, NodeSplitLinears,
                         ::testing::Combine(::testing::Values("glm5", "glm52", "dsv3", "kimi",
                                                              "glm5_nvfp4"),
                                            ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) +
                                  (std::get<1>(param_info.param) ? "_coordinator_experts" : "");
                         });

// --placement sliced: two owners each hold a slice of every routed expert's intermediate rows
// (the coordinator and an expert rank at np 2, with and without --split-linears; two expert ranks
// at np 3). The fixtures' experts have 16 intermediate rows: two slices of 8 at most. The dsv3
// fixture's FP8 blocks are wider than a slice (refused, SliceExperts tests).
using SlicedCase = std::tuple<std::string, bool>;  // fixture, --split-linears
class NodeSliced : public ::testing::TestWithParam<SlicedCase> {};

TEST_P(NodeSliced, LogitsAndGreedyTokensEqualTheReference) {
  const auto& [fixture, split_linears] = GetParam();
  if (world_size() == 2) {
    expect_equal_with_coordinator_experts(fixture, false, split_linears, "sliced");
  } else if (world_size() == 3 && !split_linears) {
    expect_equal_to_reference(fixture, "sliced", false);
  } else {
    GTEST_SKIP() << "two owners (np 2 with the coordinator owning experts, np 3) slice the "
                    "fixtures' 16 intermediate rows; --split-linears at np 2 only";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, NodeSliced,
                         ::testing::Combine(::testing::Values("glm5", "glm52", "kimi"),
                                            ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) +
                                  (std::get<1>(param_info.param) ? "_split_linears" : "");
                         });

// --placement heat from a statistics file whose routing is skewed (expert e of every layer
// routed about (e + 1)^-1.5 as often as expert 0), with replicas of the hottest where there are
// two owners or more; the run's routes are merged into the file at shutdown.
// With --repin-every 4 the real routing (about uniform on these random models) drifts from the
// skewed statistics: layers are re-placed and their experts move between steps while the
// sequences run.
using HeatCase = std::tuple<std::string, bool>;  // fixture, --repin-every
class NodeHeat : public ::testing::TestWithParam<HeatCase> {};

TEST_P(NodeHeat, LogitsAndGreedyTokensEqualTheReference) {
  const auto& [fixture, repin] = GetParam();
  const auto model_dir = kParityDir / fixture / "model";
  const auto file =
      std::filesystem::temp_directory_path() /
      ("heat-" + fixture + (repin ? "-repin-" : "-") + std::to_string(world_size()) + ".stats");
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const ModelConfig config = load_model_config(model_dir);
  const Checkpoint checkpoint(model_dir, config.fp8_block, config.int4_group_size);
  const ModelIdentity id{model_hash(model_dir, checkpoint), weights_fingerprint(checkpoint)};
  RoutingStats skewed;
  skewed.reset(config.num_layers, config.n_routed_experts);
  for (int l = 0; l < config.num_layers; ++l)
    for (int e = 0; e < config.n_routed_experts; ++e)
      skewed.count[size_t(l) * config.n_routed_experts + e] =
          config.layer_is_moe[size_t(l)] ? std::round(1000 * std::pow(e + 1, -1.5)) : 0;
  skewed.tokens = 1000;
  if (rank == 0) write_routing_stats(file, skewed, id);
  MPI_Barrier(MPI_COMM_WORLD);
  const int replicas = world_size() > 2 ? 2 : 0;  // two owners at least
  expect_equal_to_reference(fixture, "heat", false, "", false, file.string(), replicas,
                            repin && world_size() > 1 ? 4 : 0);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    const RoutingStats merged =
        read_routing_stats(file, config.num_layers, config.n_routed_experts, id);
    EXPECT_GT(merged.tokens, skewed.tokens);  // this run's routes, added
    std::filesystem::remove(file);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, NodeHeat,
                         ::testing::Combine(::testing::Values("glm5", "dsv3", "kimi"),
                                            ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) +
                                  (std::get<1>(param_info.param) ? "_repin" : "");
                         });

INSTANTIATE_TEST_SUITE_P(Models, NodeHostCombine, ::testing::Values("glm5", "dsv3"),
                         [](const auto& param_info) { return param_info.param; });

std::string equality_case_name(const ::testing::TestParamInfo<Case>& param_info) {
  std::string name = std::get<0>(param_info.param) + "_" + std::get<1>(param_info.param);
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

INSTANTIATE_TEST_SUITE_P(Models, NodeEquality,
                         ::testing::Combine(::testing::Values("glm5", "glm52", "dsv3", "kimi"),
                                            ::testing::Values("round-robin", "contiguous",
                                                              "balanced", "heat")),
                         equality_case_name);

// kimi's routed experts in compressed-tensors INT4 (pack-quantized groups of 32, symmetric and
// with zero points), loaded as stored on every rank.
INSTANTIATE_TEST_SUITE_P(CompressedTensors, NodeEquality,
                         ::testing::Combine(::testing::Values("kimi_w4a16", "kimi_w4a16_asym"),
                                            ::testing::Values("round-robin", "balanced")),
                         equality_case_name);

// The NVFP4 copy of glm5 (NVIDIA ModelOpt: every Linear NVFP4 but layer 0's attention, the router
// and lm_head), its routed experts and the coordinator's linears loaded as stored on every rank.
INSTANTIATE_TEST_SUITE_P(Nvfp4, NodeEquality,
                         ::testing::Combine(::testing::Values("glm5_nvfp4"),
                                            ::testing::Values("round-robin", "balanced")),
                         equality_case_name);

// Each owner's resident expert bytes are the sum of `held(layer, expert)` over the experts it owns,
// and node.expert_bytes() (what the RAM budgets take) is one expert's; a coordinator that owns
// no expert runs `on_coordinator`, then stops the node.
void expect_experts_resident_as(Node& node, const std::function<uint64_t(int, int)>& held,
                                const std::function<void()>& on_coordinator = {}) {
  const ModelConfig& config = node.config();
  uint64_t owned = 0, one_expert = 0;
  for (int l = 0; l < config.num_layers; ++l) {
    if (!config.layer_is_moe[size_t(l)]) continue;
    for (int e = 0; e < config.n_routed_experts; ++e) {
      one_expert = held(l, e);
      if (node.placement().holds(l, e, node.rank())) owned += one_expert;
    }
  }
  EXPECT_EQ(node.expert_bytes(), one_expert);
  if (world_size() > 1 && !node.is_coordinator()) {
    EXPECT_GT(owned, 0u);
    EXPECT_EQ(node.resident_expert_bytes(), owned) << "rank " << node.rank();
  }
  if (node.is_coordinator()) {
    if (on_coordinator) on_coordinator();
    node.shutdown();
  } else {
    node.serve();
  }
}

// NVFP4 routed experts are resident as stored: each matrix's codes, block scales and global
// scale, and every rank's memory line has its nvfp4 weights.
TEST(NodeMemory, Nvfp4ExpertsAreResidentAsStored) {
  NodeOptions options;
  options.model_dir = kParityDir / "glm5_nvfp4" / "model";
  Node node(MPI_COMM_WORLD, options);
  const Checkpoint checkpoint(options.model_dir, node.config().fp8_block,
                              node.config().int4_group_size);
  const auto held = [&](int l, int e) {
    uint64_t bytes = 0;
    for (const char* m : {"gate_proj", "up_proj", "down_proj"}) {
      const Checkpoint::Nvfp4Tensors* t =
          checkpoint.nvfp4_tensors(expert_prefix(l, e) + m + ".weight");
      EXPECT_NE(t, nullptr) << expert_prefix(l, e) << m;
      if (t) bytes += t->weight->nbytes + t->scale->nbytes + sizeof(float);
    }
    return bytes;
  };
  expect_experts_resident_as(node, held, [&] {
    ASSERT_EQ(node.memory_report().size(), size_t(world_size()));
    for (const std::string& line : node.memory_report())
      EXPECT_NE(line.find(", nvfp4 "), std::string::npos) << line;
  });
}

// compressed-tensors INT4 routed experts with zero points are resident as held: each matrix's
// packed words (whole rows of nibbles here), its scales at 4 bytes and an fp32 offset a zero
// point (one a scale).
TEST(NodeMemory, AsymmetricInt4ExpertsAreResidentAsHeld) {
  NodeOptions options;
  options.model_dir = kParityDir / "kimi_w4a16_asym" / "model";
  Node node(MPI_COMM_WORLD, options);
  EXPECT_TRUE(node.config().int4_zero_points);
  const Checkpoint checkpoint(options.model_dir, node.config().fp8_block,
                              node.config().int4_group_size);
  const auto held = [&](int l, int e) {
    uint64_t bytes = 0;
    for (const char* m : {"gate_proj", "up_proj", "down_proj"}) {
      const std::string name = expert_prefix(l, e) + m + ".weight";
      const TensorView* packed = checkpoint.find(name + "_packed");
      const TensorView* scale = checkpoint.find(name + "_scale");
      EXPECT_TRUE(packed && scale && checkpoint.find(name + "_zero_point")) << name;
      if (packed && scale) bytes += packed->nbytes + 8 * uint64_t(scale->numel());
    }
    return bytes;
  };
  expect_experts_resident_as(node, held);
}

// Every routed expert has exactly one owner; expert ranks load exactly what they own and the
// coordinator loads no routed expert.
TEST(NodePlacement, OwnersLoadExactlyTheirExperts) {
  NodeOptions options;
  options.model_dir = kParityDir / "dsv3" / "model";
  options.placement = PlacementPolicy::kContiguous;
  Node node(MPI_COMM_WORLD, options);
  const ModelConfig& config = node.config();
  const PlacementTable& table = node.placement();
  const Checkpoint checkpoint(options.model_dir, config.fp8_block, config.int4_group_size);

  // Bytes of the routed experts this rank owns, scales included.
  uint64_t owned_bytes = 0, all_expert_bytes = 0;
  for (int l = 0; l < config.num_layers; ++l) {
    if (!config.layer_is_moe[size_t(l)]) continue;
    for (int e = 0; e < config.n_routed_experts; ++e) {
      const int owner = table.owner_of(l, e);
      ASSERT_GE(owner, 0);
      if (world_size() > 1) {
        EXPECT_NE(owner, node.layout().coordinator()) << "layer " << l << " expert " << e;
      }
      uint64_t bytes = 0;
      for (const char* m : {"gate_proj", "up_proj", "down_proj"})
        for (const char* suffix : {".weight", ".weight_scale_inv"})
          if (const TensorView* v = checkpoint.find(expert_prefix(l, e) + m + suffix))
            bytes += v->nbytes;
      all_expert_bytes += bytes;
      if (owner == node.rank()) owned_bytes += bytes;
    }
  }
  const uint64_t read = node.profiler().counters().weight_bytes_read;
  if (node.is_coordinator() && world_size() > 1) {
    uint64_t total = 0;
    for (const auto& name : checkpoint.names()) total += checkpoint.find(name)->nbytes;
    EXPECT_LE(read, total - all_expert_bytes) << "the coordinator read routed-expert bytes";
    EXPECT_GT(read, 0u);
  } else if (!node.is_coordinator()) {
    EXPECT_EQ(read, owned_bytes);
    EXPECT_GT(owned_bytes, 0u) << "rank " << node.rank() << " owns nothing";
  }
  // Every (layer, expert) is counted once across ranks.
  uint64_t owned_sum = 0;
  MPI_Allreduce(&owned_bytes, &owned_sum, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(owned_sum, all_expert_bytes);
  if (node.is_coordinator()) {
    node.shutdown();
  } else {
    node.serve();
  }
}

// Gathered reports add up: rows and (row, expert) pairs the coordinator sent equal what the
// owners served, and every rank reports.
TEST(NodeProfile, ReportsAccountForEveryRowAndPair) {
  NodeOptions options;
  options.model_dir = kParityDir / "glm5" / "model";
  Node node(MPI_COMM_WORLD, options);
  int tokens = 0;
  if (node.is_coordinator()) {
    const Golden g = read_golden("glm5");
    tokens = int(run_sequence(node.engine(), g).size()) / node.config().vocab_size;
    node.shutdown();
  } else {
    node.serve();
  }
  const std::vector<RankReport> reports = node.gather_reports();
  if (!node.is_coordinator()) return;
  ASSERT_EQ(int(reports.size()), world_size());
  if (world_size() == 1) return;
  const ModelConfig& c = node.config();
  const RankReport& coordinator = reports[size_t(node.layout().coordinator())];
  EXPECT_EQ(coordinator.experts, uint64_t(tokens) * c.num_experts_per_tok * c.num_moe_layers());
  uint64_t rows = 0, pairs = 0, bytes_in = 0, slowest = 0;
  for (const RankReport& r : reports) {
    EXPECT_EQ(r.rank, int(&r - reports.data()));
    if (r.rank == coordinator.rank) continue;
    rows += r.rows;
    pairs += r.experts;
    bytes_in += r.bytes_in;
    slowest += r.slowest_count;
    EXPECT_GT(r.phase_us[int(Phase::kCompute)], 0.0) << "rank " << r.rank;
  }
  EXPECT_EQ(rows, coordinator.rows);
  EXPECT_EQ(pairs, coordinator.experts);
  EXPECT_EQ(bytes_in, coordinator.bytes_out);
  // One slowest rank per exchange: one exchange per MoE layer per forward call.
  const uint64_t forwards = 1 + read_golden("glm5").teacher_forced.size();
  EXPECT_EQ(slowest, forwards * uint64_t(c.num_moe_layers()));
}

// Batches of 1, 3 and 8 sequences through the distributed engine, mixing prefill chunks and
// decode rows, with sequences finishing and joining, equal separate reference runs.
using BatchCase = std::tuple<std::string, int>;  // fixture, sequences
class NodeBatches : public ::testing::TestWithParam<BatchCase> {};

TEST_P(NodeBatches, BatchedSequencesEqualSeparateReferenceRuns) {
  const auto& [fixture, count] = GetParam();
  NodeOptions options;
  options.model_dir = kParityDir / fixture / "model";
  options.max_rows = 64;
  options.max_seqs = 4;
  options.kv_tokens = 512;
  options.rank_timeout_s = 60;
  Node node(MPI_COMM_WORLD, options);
  testing::OracleCheck check;
  if (node.is_coordinator()) {
    const Checkpoint checkpoint(options.model_dir, node.config().fp8_block,
                                node.config().int4_group_size);
    const ModelWeights weights = load_model_weights(node.config(), checkpoint);
    ReferenceModel oracle(node.config(), weights);
    check =
        testing::expect_engine_matches_oracle(node.engine(), oracle, count, 17, world_size() <= 2);
    node.shutdown();
  } else {
    node.serve();
  }
  const std::vector<RankReport> reports = node.gather_reports();
  if (!node.is_coordinator()) return;
  // One dispatch and one combine per MoE layer per call, however many sequences the call holds.
  if (world_size() > 1) {
    uint64_t exchanges = 0;
    for (const RankReport& r : reports) exchanges += r.slowest_count;
    EXPECT_EQ(exchanges, uint64_t(check.forward_calls) * node.config().num_moe_layers());
  }
  std::printf("[np %d %s B=%d] max |logit diff| engine vs reference %.3g in %d calls\n",
              world_size(), fixture.c_str(), count, check.worst, check.forward_calls);
}

INSTANTIATE_TEST_SUITE_P(Models, NodeBatches,
                         ::testing::Combine(::testing::Values("glm5", "glm52", "dsv3", "kimi"),
                                            ::testing::Values(1, 3, 8)),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) + "_B" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

// --micro-batches 2 at this rank count: the schedule of micro_batch_sequences (prompt chunks,
// one of them cut in two, beside decode rows) gives bitwise the logits of calls run whole, with
// the expert ranks alone or with the coordinator owning a share of the experts (its own and the
// expert ranks' exchanges composed). Each split call makes two exchanges per MoE layer.
struct MicroBatchRun {
  std::vector<std::vector<float>> logits;
  int calls = 0;
  uint64_t split_calls = 0, exchanges = 0;
};

MicroBatchRun run_micro_batches(const std::string& fixture, int micro_batches,
                                const std::string& layout_file) {
  NodeOptions options;
  options.model_dir = kParityDir / fixture / "model";
  options.max_rows = 64;
  options.max_seqs = 4;
  options.kv_tokens = 512;
  options.rank_timeout_s = 60;
  options.micro_batches = micro_batches;
  options.micro_batch_rows = 4;
  if (!layout_file.empty()) options.layout_file = layout_file;
  Node node(MPI_COMM_WORLD, options);
  MicroBatchRun run;
  if (node.is_coordinator()) {
    EXPECT_EQ(node.engine().splits(), micro_batches == 2);
    const testing::ScheduleRun schedule = testing::run_schedule(
        node.engine(), testing::micro_batch_sequences(node.config().vocab_size), 48);
    run.logits = schedule.logits;
    run.calls = schedule.steps;
    run.split_calls = node.engine().split_calls();
    node.shutdown();
  } else {
    node.serve();
  }
  for (const RankReport& r : node.gather_reports()) run.exchanges += r.slowest_count;
  // (With the coordinator owning experts, an exchange may leave the expert ranks out.)
  if (node.is_coordinator() && world_size() > 1 && layout_file.empty()) {
    EXPECT_EQ(run.exchanges,
              uint64_t(run.calls + int(run.split_calls)) * node.config().num_moe_layers());
  }
  return run;
}

using MicroBatchCase = std::tuple<std::string, bool>;  // fixture, coordinator owns experts
class NodeMicroBatches : public ::testing::TestWithParam<MicroBatchCase> {};

TEST_P(NodeMicroBatches, LogitsBitwiseThoseOfWholeCalls) {
  const auto& [fixture, coordinator_experts] = GetParam();
  if (coordinator_experts && world_size() == 1) GTEST_SKIP() << "one process owns every expert";
  const auto file = std::filesystem::temp_directory_path() /
                    ("micro-batches-" + std::to_string(world_size()) + ".layout");
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (coordinator_experts && rank == 0) {
    std::ofstream layout(file);
    layout << "0 coordinator - - 1\n";
    for (int r = 1; r < world_size(); ++r) layout << r << " cpu-expert - - 2\n";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string layout = coordinator_experts ? file.string() : "";
  const MicroBatchRun whole = run_micro_batches(fixture, 1, layout);
  const MicroBatchRun split = run_micro_batches(fixture, 2, layout);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank != 0) return;
  if (coordinator_experts) std::filesystem::remove(file);
  EXPECT_EQ(whole.split_calls, 0u);
  EXPECT_GT(split.split_calls, 0u);
  ASSERT_EQ(whole.logits.size(), split.logits.size());
  for (size_t i = 0; i < whole.logits.size(); ++i) {
    ASSERT_FALSE(whole.logits[i].empty());
    ASSERT_EQ(whole.logits[i].size(), split.logits[i].size());
    EXPECT_EQ(0, std::memcmp(whole.logits[i].data(), split.logits[i].data(),
                             whole.logits[i].size() * sizeof(float)))
        << "sequence " << i;
  }
  std::printf("[np %d %s%s] %d calls, %llu as two micro-batches: logits bitwise equal\n",
              world_size(), fixture.c_str(), coordinator_experts ? " coordinator owns experts" : "",
              split.calls, static_cast<unsigned long long>(split.split_calls));
}

INSTANTIATE_TEST_SUITE_P(Models, NodeMicroBatches,
                         ::testing::Combine(::testing::Values("glm5", "glm52", "dsv3", "kimi"),
                                            ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) +
                                  (std::get<1>(param_info.param) ? "_coordinator_experts" : "");
                         });

// A bf16 wire halves the row bytes of the exchange. Its error against the fp32 wire is measured
// on the embedded (trained) model: random tiny models route chaotically, so a rounding there can
// flip an expert choice and says nothing about the wire.
TEST(NodeWire, Bf16HalvesRowBytesWithinItsErrorBound) {
  if (world_size() == 1) GTEST_SKIP() << "no exchange in a single process";
  const std::filesystem::path model_dir = COLIBRI_EMBEDDED_MODEL;
  const Tokenizer tokenizer = Tokenizer::load(model_dir / "tokenizer.json");
  std::ifstream text_file(std::filesystem::path(COLIBRI_TEST_DATA) / "embedded" / "heldout.txt");
  const std::string text((std::istreambuf_iterator<char>(text_file)), {});
  std::vector<int> ids = tokenizer.encode(text, false);
  ids.resize(std::min<size_t>(ids.size(), 200));
  std::vector<float> logits[2];
  uint64_t bytes[2] = {0, 0};
  bool coordinator = false;
  int vocab = 0;
  for (int wire = 0; wire < 2; ++wire) {
    NodeOptions options;
    options.model_dir = model_dir;
    options.max_rows = 64;
    options.rank_timeout_s = 60;
    options.wire_type = wire == 0 ? ElemType::kF32 : ElemType::kBF16;
    Node node(MPI_COMM_WORLD, options);
    coordinator = node.is_coordinator();
    vocab = node.config().vocab_size;
    if (coordinator) {
      const int seq = node.engine().open_sequence();
      logits[wire] = node.engine().forward(seq, ids);
      node.shutdown();
      bytes[wire] = node.profiler().counters().bytes_out + node.profiler().counters().bytes_in;
    } else {
      node.serve();
    }
  }
  if (!coordinator) return;
  ASSERT_EQ(logits[0].size(), ids.size() * size_t(vocab));
  const float diff = testing::max_abs_diff(logits[0], logits[1]);
  // Mean negative log-likelihood of the next token under each wire.
  double nll[2] = {0, 0};
  for (int wire = 0; wire < 2; ++wire)
    for (size_t t = 0; t + 1 < ids.size(); ++t) {
      const float* row = &logits[wire][t * size_t(vocab)];
      const double max = *std::max_element(row, row + vocab);
      double sum = 0;
      for (int v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - max);
      nll[wire] += (max + std::log(sum) - double(row[ids[t + 1]])) / double(ids.size() - 1);
    }
  // Zero would mean the wire did not change anything. Measured at np 2 and 3: max |logit diff|
  // 0.24-0.31 (logits reach about 20), mean nll 4e-4 apart; the bounds leave 3x and 20x.
  EXPECT_GT(diff, 0.0f);
  EXPECT_LE(diff, 1.0f);
  EXPECT_LE(std::abs(nll[1] - nll[0]), 0.01);
  EXPECT_LT(double(bytes[1]), 0.6 * double(bytes[0]));
  std::printf(
      "[np %d] bf16 wire: %llu vs %llu bytes (%.3f), max |logit diff| %.3g, mean nll %.5f vs "
      "%.5f\n",
      world_size(), (unsigned long long)bytes[1], (unsigned long long)bytes[0],
      double(bytes[1]) / double(bytes[0]), diff, nll[1], nll[0]);
}

// Rows and partials through the shared segments of the expert ranks on the coordinator's host
// (every rank here) give the bits of plain MPI messages, on both wires; with them on, the
// coordinator counts the segment bytes (each dispatched row there and back), with them off none.
TEST(NodeSharedMemory, SegmentsGiveTheBitsOfMessages) {
  if (world_size() == 1) GTEST_SKIP() << "no exchange in a single process";
  const Golden g = read_golden("glm5");
  for (ElemType wire : {ElemType::kF32, ElemType::kBF16}) {
    std::vector<float> logits[2];
    uint64_t shared_bytes[2] = {0, 0}, bytes_out[2] = {0, 0}, rows = 0, row_bytes = 0;
    bool coordinator = false;
    for (int shared = 0; shared < 2; ++shared) {
      NodeOptions options;
      options.model_dir = kParityDir / "glm5" / "model";
      options.max_rows = 64;
      options.rank_timeout_s = 60;
      options.wire_type = wire;
      options.shared_memory = shared == 1;
      Node node(MPI_COMM_WORLD, options);
      coordinator = node.is_coordinator();
      if (!coordinator) {
        node.serve();
        continue;
      }
      logits[shared] = run_sequence(node.engine(), g);
      node.shutdown();
      shared_bytes[shared] = node.profiler().counters().bytes_shared;
      bytes_out[shared] = node.profiler().counters().bytes_out;
      rows = node.profiler().counters().rows;
      row_bytes = uint64_t(node.config().hidden_size) * elem_bytes(wire);
    }
    if (!coordinator) continue;
    SCOPED_TRACE(elem_type_name(wire));
    ASSERT_FALSE(logits[0].empty());
    EXPECT_EQ(logits[0], logits[1]);
    EXPECT_EQ(shared_bytes[0], 0u);
    EXPECT_GT(rows, 0u);
    EXPECT_EQ(shared_bytes[1], 2 * rows * row_bytes);
    EXPECT_EQ(bytes_out[0], bytes_out[1]);  // the same requests, wherever their rows went
  }
}

}  // namespace
}  // namespace colibri
