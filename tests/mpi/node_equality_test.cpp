// The distributed node against the single-process reference (and, closing the oracle chain,
// against the transformers goldens): logits of prefill and incremental decode, greedy tokens,
// for every parity model and placement policy, at the rank count this binary was started with.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/npy.h"
#include "coordinator/sampler.h"
#include "model/generate.h"
#include "node/node.h"

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

using Case = std::tuple<std::string, std::string>;  // fixture, placement
class NodeEquality : public ::testing::TestWithParam<Case> {};

TEST_P(NodeEquality, LogitsAndGreedyTokensEqualTheReference) {
  const auto& [fixture, placement] = GetParam();
  NodeOptions options;
  options.model_dir = kParityDir / fixture / "model";
  options.placement = parse_placement_policy(placement);
  options.max_rows = 64;
  options.rank_timeout_s = 60;
  Node node(MPI_COMM_WORLD, options);
  if (!node.is_coordinator()) {
    node.serve();
    return;
  }
  const Golden g = read_golden(fixture);
  const std::vector<float> distributed = run_sequence(node.model(), g);
  GenerateRequest request;
  request.prompt = g.prompt;
  request.max_new_tokens = int(g.greedy.size());
  const GenerateResult greedy = generate(node.model(), request);
  node.shutdown();

  // The single-process reference, in this process, with every expert local.
  const ModelConfig& config = node.config();
  const Checkpoint checkpoint(options.model_dir, config.fp8_block);
  const ModelWeights weights = load_model_weights(config, checkpoint);
  ReferenceModel reference(config, weights);
  const std::vector<float> expected = run_sequence(reference, g);

  ASSERT_EQ(distributed.size(), expected.size());
  ASSERT_EQ(distributed.size(), g.logits.data.size());
  float max_vs_reference = 0, max_vs_transformers = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    max_vs_reference = std::max(max_vs_reference, std::abs(distributed[i] - expected[i]));
    max_vs_transformers =
        std::max(max_vs_transformers, std::abs(distributed[i] - g.logits.data[i]));
  }
  // With one expert owner every row sums its experts in the reference's order: bitwise equal.
  // More owners reorder the sum of partials.
  if (world_size() <= 2) {
    EXPECT_EQ(distributed, expected) << "max |diff| " << max_vs_reference;
  } else {
    EXPECT_LE(max_vs_reference, 1e-5f);
  }
  EXPECT_LE(max_vs_transformers, 1e-3f);
  const int vocab = config.vocab_size;
  for (size_t row = 0; row * vocab < expected.size(); ++row) {
    const std::span<const float> a(&distributed[row * vocab], size_t(vocab)),
        b(&expected[row * vocab], size_t(vocab));
    EXPECT_EQ(argmax(a), argmax(b)) << "position " << row;
  }
  EXPECT_EQ(greedy.tokens, g.greedy);
  std::printf("[np %d %s %s] max |logit diff| vs reference %.3g, vs transformers %.3g\n",
              world_size(), fixture.c_str(), placement.c_str(), max_vs_reference,
              max_vs_transformers);
}

INSTANTIATE_TEST_SUITE_P(Models, NodeEquality,
                         ::testing::Combine(::testing::Values("glm5", "glm52", "dsv3", "kimi"),
                                            ::testing::Values("round-robin", "contiguous",
                                                              "balanced")),
                         [](const auto& param_info) {
                           std::string name =
                               std::get<0>(param_info.param) + "_" + std::get<1>(param_info.param);
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Every routed expert has exactly one owner; expert ranks load exactly what they own and the
// coordinator loads no routed expert.
TEST(NodePlacement, OwnersLoadExactlyTheirExperts) {
  NodeOptions options;
  options.model_dir = kParityDir / "dsv3" / "model";
  options.placement = PlacementPolicy::kContiguous;
  Node node(MPI_COMM_WORLD, options);
  const ModelConfig& config = node.config();
  const PlacementTable& table = node.placement();
  const Checkpoint checkpoint(options.model_dir, config.fp8_block);

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
    tokens = int(run_sequence(node.model(), g).size()) / node.config().vocab_size;
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

}  // namespace
}  // namespace colibri
