// The CUDA coordinator (CudaCompute) against the CPU engine on every parity model: the same
// Engine, weights, placement and CPU expert backend, only the compute differs. Two sequences in
// one batch: their prompts prefilled in one call (every row's logits), then greedy decode steps
// with one row of each per call. Logits within 2e-2 absolute, greedy tokens identical.
//
// glm5_nvfp4 (ModelOpt NVFP4 projections, dense MLP and shared experts) runs its NVFP4 products
// as stored on the GPU (codes and block scales, cuda::matrix_linear with fp32 activations), and
// the CPU engine with fp32 activations too (--activations f32: the products of the dequantized
// weights); its device holds the NVFP4 weights' stored bytes (checked).
//
// The bound: CudaCompute keeps the weights as the CPU engine reads them (BF16 as stored; NVFP4
// as stored; fp32 where the values are not BF16, products in fp32 without TF32) and gives BF16
// products their fp32 activations as a BF16 hi + lo pair (16 significant bits, relative error
// <= 2^-17). What
// remains is fp32 summation order, expf/cosf against libm, and the online softmax: about 1e-6
// relative per operation, so ~1e-4 of the logit scale through these 3-6 layer models, whose
// logits reach ~14: ~1.5e-3, an order below 2e-2. (Plain BF16 rounding would not hold it:
// rounding only the fp32 weights of dsv3 and glm5 to BF16 moves their CPU logits by 0.023 and
// 0.040.) Greedy tokens must match: the models' smallest top-1 margin on the prompt is ~0.03,
// well above that error. The test prints the worst difference and the logit scale.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "coordinator/cuda_compute.h"
#include "coordinator/engine.h"
#include "cpu/quant.h"
#include "cuda/device.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "rank/expert_backend.h"
#include "transport/local_dispatcher.h"

namespace colibri {
namespace {

std::filesystem::path parity_dir() {
  const char* env = std::getenv("COLIBRI_TEST_DATA");
  return std::filesystem::path(env && *env ? env : COLIBRI_TEST_DATA) / "parity";
}

constexpr float kLogitBound = 2e-2f;

class CudaCoordinatorParity : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string why_none;
    if (cuda::device_count(&why_none) == 0) GTEST_SKIP() << "no CUDA device: " << why_none;
    // The GPU's NVFP4 products take fp32 activations: compare with the CPU's doing the same.
    saved_ = kernels::quant_activations_selected();
    kernels::set_quant_activations(kernels::QuantActivations::kF32);
  }
  void TearDown() override { kernels::set_quant_activations(saved_); }
  kernels::QuantActivations saved_ = kernels::QuantActivations::kInt8;
};

// The stored bytes (codes and block scales) of the NVFP4 matrices CudaCompute keeps as stored:
// every product but kv_b_proj (dequantized at load) and the embedding table.
uint64_t nvfp4_product_bytes(const ModelWeights& w) {
  uint64_t bytes = 0;
  const auto add = [&](const Matrix& m) {
    if (m.format() == WeightFormat::kNvfp4) bytes += m.nvfp4.codes.size() + m.nvfp4.scales.size();
  };
  add(w.lm_head);
  for (const LayerWeights& l : w.layers) {
    const AttentionWeights& a = l.attn;
    for (const Matrix* m : {&a.q_a_proj, &a.q_b_proj, &a.q_proj, &a.kv_a_proj, &a.o_proj}) add(*m);
    if (a.indexer)
      for (const Matrix* m : {&a.indexer->wq_b, &a.indexer->wk, &a.indexer->weights_proj}) add(*m);
    for (const MlpWeights* mlp : {&l.shared_experts, &l.dense_mlp})
      for (const Matrix* m : {&mlp->gate, &mlp->up, &mlp->down}) add(*m);
  }
  return bytes;
}

struct Generation {
  std::vector<std::vector<float>> logits;  // per call
  std::vector<int> tokens;                 // greedy, per step and sequence
};

// Prefill both prompts in one call, then `steps` calls of one row per sequence.
Generation generate(Engine& engine, const std::vector<int>& prompt_a,
                    const std::vector<int>& prompt_b, int steps) {
  const int vocab = engine.config().vocab_size;
  Generation run;
  const int a = engine.open_sequence(), b = engine.open_sequence();
  Batch batch;
  for (size_t i = 0; i < prompt_a.size(); ++i) batch.add(a, prompt_a[i], int(i), true);
  for (size_t i = 0; i < prompt_b.size(); ++i) batch.add(b, prompt_b[i], int(i), true);
  run.logits.push_back(engine.forward(batch));
  const auto argmax = [&](const std::vector<float>& l, size_t row) {
    const auto begin = l.begin() + std::ptrdiff_t(row * size_t(vocab));
    return int(std::max_element(begin, begin + vocab) - begin);
  };
  int next_a = argmax(run.logits.back(), prompt_a.size() - 1);
  int next_b = argmax(run.logits.back(), prompt_a.size() + prompt_b.size() - 1);
  for (int step = 0; step < steps; ++step) {
    run.tokens.push_back(next_a);
    run.tokens.push_back(next_b);
    batch.clear();
    batch.add(a, next_a, engine.length(a), true);
    batch.add(b, next_b, engine.length(b), true);
    run.logits.push_back(engine.forward(batch));
    next_a = argmax(run.logits.back(), 0);
    next_b = argmax(run.logits.back(), 1);
  }
  engine.close_sequence(a);
  engine.close_sequence(b);
  return run;
}

TEST_P(CudaCoordinatorParity, LogitsAndGreedyTokensMatchTheCpuEngine) {
  const std::filesystem::path dir = parity_dir() / GetParam() / "model";
  const ModelConfig config = load_model_config(dir);
  const Checkpoint checkpoint(dir, config.fp8_block);
  LoadOptions load;
  load.keep_stored = true;
  const ModelWeights weights = load_model_weights(config, checkpoint, load);
  std::ifstream meta(parity_dir() / GetParam() / "golden" / "meta.json");
  const std::vector<int> prompt =
      nlohmann::json::parse(meta).at("prompt_ids").get<std::vector<int>>();
  ASSERT_GE(prompt.size(), 4u);
  // A second prompt of another length: the first prompt's tail reversed.
  const std::vector<int> prompt_b(prompt.rbegin(),
                                  prompt.rbegin() + std::ptrdiff_t(prompt.size() / 2 + 3));

  const LivePlacement placement(
      make_placement(config, default_layout(1, {0}, {0}, {0}), PlacementPolicy::kBalanced, 0));
  CpuExpertBackend experts(config, weights);
  LocalDispatcher dispatch(experts, config.hidden_size);
  EngineOptions options;
  options.max_rows = 64;
  options.kv_tokens = 256;
  options.max_seqs = 2;
  Engine cpu(config, weights, placement, dispatch, options);
  const CudaCompute* compute = nullptr;
  Engine gpu(config, weights, placement, dispatch, options, nullptr,
             [&compute](const ModelConfig& c, const ModelWeights& w, KvManager& kv, int max_rows,
                        Profiler* profiler) -> std::unique_ptr<CoordinatorCompute> {
               auto made = std::make_unique<CudaCompute>(c, w, kv, max_rows, 0, profiler);
               compute = made.get();
               return made;
             });
  ASSERT_NE(compute, nullptr);
  // NVFP4 weights are held as stored: their codes and block scales, nothing widened.
  const uint64_t nvfp4_bytes = nvfp4_product_bytes(weights);
  EXPECT_EQ(compute->weight_bytes().nvfp4, nvfp4_bytes);
  if (GetParam() == "glm5_nvfp4") {
    EXPECT_GT(nvfp4_bytes, 0u) << "the NVFP4 fixture loaded no NVFP4 coordinator weight";
  }
  const int steps = 6;
  const Generation expect = generate(cpu, prompt, prompt_b, steps);
  const Generation got = generate(gpu, prompt, prompt_b, steps);
  ASSERT_EQ(got.logits.size(), expect.logits.size());
  float worst = 0, scale = 0;
  for (size_t call = 0; call < expect.logits.size(); ++call) {
    ASSERT_EQ(got.logits[call].size(), expect.logits[call].size()) << "call " << call;
    for (size_t i = 0; i < expect.logits[call].size(); ++i) {
      ASSERT_TRUE(std::isfinite(got.logits[call][i])) << "call " << call << " logit " << i;
      scale = std::max(scale, std::fabs(expect.logits[call][i]));
      const float diff = std::fabs(got.logits[call][i] - expect.logits[call][i]);
      if (diff > worst) worst = diff;
      EXPECT_LE(diff, kLogitBound) << "call " << call << " (0: prefill) logit " << i;
      if (diff > kLogitBound) break;
    }
  }
  ASSERT_GT(scale, 0.0f);
  EXPECT_EQ(got.tokens, expect.tokens) << "greedy tokens differ";
  std::printf("%s: max |logit difference| %.3g of max |logit| %.3g\n", GetParam().c_str(), worst,
              scale);
  RecordProperty("max_abs_logit_error", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(ParityModels, CudaCoordinatorParity,
                         testing::Values("dsv3", "glm5", "glm52", "kimi", "glm5_nvfp4"));

}  // namespace
}  // namespace colibri
