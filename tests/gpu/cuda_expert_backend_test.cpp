// The CUDA expert backend against the CPU expert backend on every parity model, with its routed
// experts as stored (fp32; NVFP4 for glm5_nvfp4; compressed-tensors INT4 for kimi_w4a16 and, with
// zero points, kimi_w4a16_asym), converted to the container (int4 g64, int4 per row, int8 rows)
// and rounded to BF16 in memory (as a BF16 checkpoint is kept):
//   - every MoE layer: the partial of one request (random rows, random top-k routing) within
//     1e-4 of the largest CPU value (both sum in fp32, in different orders within each dot
//     product; the expert order of each row is the same);
//   - the VRAM tier: a third of the experts in VRAM, misses uploaded or computed on the CPU;
//   - end to end: a one-process engine with GPU experts against one with CPU experts, same
//     weights: prompt logits within 1e-4 relative (of the largest |logit|), greedy tokens equal.
// Skips without a device. The data directory is $COLIBRI_TEST_DATA when set (the GPU check
// runs this binary in another checkout), else the one it was built from.
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "coordinator/engine.h"
#include "cpu/quant.h"
#include "cuda/device.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "rank/cuda_expert_backend.h"
#include "rank/expert_backend.h"
#include "tools/convert.h"
#include "transport/local_dispatcher.h"

namespace colibri {
namespace {

std::filesystem::path parity_dir() {
  const char* env = std::getenv("COLIBRI_TEST_DATA");
  return std::filesystem::path(env && *env ? env : COLIBRI_TEST_DATA) / "parity";
}

struct Case {
  std::string model;
  int expert_bits;  // 0: as stored (fp32 experts; glm5_nvfp4: NVFP4; kimi_w4a16*: INT4 groups
                    // of 32, with zero points for _asym); 4 or 8: converted; 16: BF16 (rounded in
                    // memory)
  int group_size;   // int4: 64 or 0 (per row)
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  os << c.model << "_";
  if (c.expert_bits == 0) return os << "stored";
  if (c.expert_bits == 16) return os << "bf16";
  return os << "int" << c.expert_bits
            << (c.group_size ? "_g" + std::to_string(c.group_size) : "_row");
}

// The model of a case, loaded once per case; converted containers are written to a temp dir.
struct Model {
  std::filesystem::path dir, temp;
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;
  ModelWeights weights;
  std::vector<int> prompt;

  explicit Model(const Case& c) {
    const std::filesystem::path source = parity_dir() / c.model / "model";
    dir = source;
    if (c.expert_bits == 4 || c.expert_bits == 8) {
      std::ostringstream name;
      name << "colibri-gpu-backend-" << c << "-" << ::getpid();
      temp = std::filesystem::temp_directory_path() / name.str();
      std::filesystem::remove_all(temp);
      ConvertOptions convert;
      convert.input_dir = source;
      convert.output_dir = temp;
      convert.expert_bits = c.expert_bits;
      convert.group_size = c.group_size;
      convert.dense_bits = 32;
      convert.io_bits = 32;
      convert_checkpoint(convert);
      dir = temp;
    }
    config = load_model_config(dir);
    checkpoint = std::make_unique<Checkpoint>(dir, config.fp8_block);
    LoadOptions load;
    load.keep_stored = true;
    weights = load_model_weights(config, *checkpoint, load);
    if (c.expert_bits == 16)
      for (LayerWeights& layer : weights.layers)
        for (MlpWeights& e : layer.experts)
          for (Matrix* w : {&e.gate, &e.up, &e.down}) {
            if (w->data.empty()) continue;
            w->bf16.resize(w->data.size());
            for (size_t i = 0; i < w->data.size(); ++i) w->bf16[i] = f32_to_bf16(w->data[i]);
            w->data.clear();
          }
    std::ifstream meta(parity_dir() / c.model / "golden" / "meta.json");
    prompt = nlohmann::json::parse(meta).at("prompt_ids").get<std::vector<int>>();
  }
  ~Model() {
    if (!temp.empty()) std::filesystem::remove_all(temp);
  }
};

class CudaExpertBackendParity : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::string why_none;
    if (cuda::device_count(&why_none) == 0) GTEST_SKIP() << "no CUDA device: " << why_none;
    // The CUDA kernels multiply fp32 activations: compare with the CPU kernels doing the same.
    saved_ = kernels::quant_activations_selected();
    kernels::set_quant_activations(kernels::QuantActivations::kF32);
  }
  void TearDown() override { kernels::set_quant_activations(saved_); }
  kernels::QuantActivations saved_ = kernels::QuantActivations::kInt8;
};

TEST_P(CudaExpertBackendParity, EveryMoeLayerMatchesTheCpuBackend) {
  const Model m(GetParam());
  const ModelConfig& cfg = m.config;
  if (GetParam().expert_bits == 4 || GetParam().expert_bits == 8) {
    ASSERT_TRUE(m.weights.layers.back().experts.front().quantized()) << "experts not converted";
  }
  if (GetParam().expert_bits == 16) {
    ASSERT_TRUE(m.weights.layers.back().experts.front().gate.stored_bf16()) << "not BF16";
  }
  if (GetParam().model == "glm5_nvfp4") {
    ASSERT_EQ(m.weights.layers.back().experts.front().gate.format(), WeightFormat::kNvfp4);
  }
  if (GetParam().model == "kimi_w4a16_asym") {
    const MlpWeights& e = m.weights.layers.back().experts.front();
    ASSERT_TRUE(e.quantized() && e.quant.gate.has_zero_points() && e.quant.down.has_zero_points())
        << "the asymmetric fixture's experts did not load with their zero points";
  }
  CpuExpertBackend cpu(cfg, m.weights);
  CudaExpertBackend gpu(cfg, m.weights, 0, 0);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  int moe_layers = 0;
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    if (!cfg.layer_is_moe[size_t(layer)]) continue;
    ++moe_layers;
    for (int n : {1, 7}) {
      std::vector<float> x(size_t(n) * cfg.hidden_size);
      for (float& v : x) v = uniform(rng);
      std::vector<RoutedPair> pairs;
      std::vector<int> ids(size_t(cfg.n_routed_experts));
      std::iota(ids.begin(), ids.end(), 0);
      for (int r = 0; r < n; ++r) {
        std::shuffle(ids.begin(), ids.end(), rng);
        const int k = std::min(cfg.num_experts_per_tok, cfg.n_routed_experts);
        for (int j = 0; j < k; ++j)
          pairs.push_back({uint32_t(r), uint32_t(ids[size_t(j)]), 0.1f + std::fabs(uniform(rng))});
      }
      ExpertRequest request;
      request.layer = layer;
      request.n_rows = n;
      request.rows = host_f32(x.data(), x.size());
      request.pairs = pairs;
      std::vector<float> want(x.size()), got(x.size(), std::nanf(""));
      cpu.compute(request, want.data());
      gpu.compute(request, got.data());
      float scale = 0, worst = 0;
      for (float v : want) scale = std::max(scale, std::fabs(v));
      ASSERT_GT(scale, 0.0f) << "layer " << layer << ": all-zero partial proves nothing";
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << "layer " << layer << " element " << i;
        worst = std::max(worst, std::fabs(got[i] - want[i]));
      }
      EXPECT_LE(worst, 1e-4f * scale) << "layer " << layer << ", " << n << " rows";
    }
  }
  EXPECT_GT(moe_layers, 0) << "the model has no MoE layer";
}

// A random request on `layer`: n rows, each routed to top-k distinct experts.
ExpertRequest random_request(const ModelConfig& cfg, int layer, int n, std::mt19937& rng,
                             std::vector<float>& x, std::vector<RoutedPair>& pairs) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  x.resize(size_t(n) * cfg.hidden_size);
  for (float& v : x) v = uniform(rng);
  pairs.clear();
  std::vector<int> ids(size_t(cfg.n_routed_experts));
  std::iota(ids.begin(), ids.end(), 0);
  for (int r = 0; r < n; ++r) {
    std::shuffle(ids.begin(), ids.end(), rng);
    const int k = std::min(cfg.num_experts_per_tok, cfg.n_routed_experts);
    for (int j = 0; j < k; ++j)
      pairs.push_back({uint32_t(r), uint32_t(ids[size_t(j)]), 0.1f + std::fabs(uniform(rng))});
  }
  ExpertRequest request;
  request.layer = layer;
  request.n_rows = n;
  request.rows = host_f32(x.data(), x.size());
  request.pairs = pairs;
  return request;
}

// The VRAM tier: a third of the experts' slots, with misses always uploaded, always computed on
// the CPU, or by the default rule; every request still matches the CPU backend, and the counters
// show which path ran.
TEST_P(CudaExpertBackendParity, VramTierOverHostExpertsMatchesTheCpuBackend) {
  const Model m(GetParam());
  const ModelConfig& cfg = m.config;
  CpuExpertBackend cpu(cfg, m.weights);
  uint64_t slot_bytes = 0;
  int owned = 0;
  {
    CudaExpertBackend all(cfg, m.weights, 0, 0);
    ASSERT_TRUE(all.all_resident());
    owned = all.slots();
    ASSERT_GT(owned, 0);
    slot_bytes = all.device_bytes() / uint64_t(owned);
  }
  const int slots = std::max(1, owned / 3);
  for (int mode = 0; mode < 3; ++mode) {
    VramCostModel cost;
    if (mode == 0) {  // always upload
      cost.upload_latency_us = 0;
      cost.cpu_bytes_per_us = 1e-3;
    } else if (mode == 1) {  // always the CPU
      cost.upload_latency_us = 1e12;
      cost.promote_after = 0;
    }
    CudaExpertBackend gpu(cfg, m.weights, 0, uint64_t(slots) * slot_bytes, cost);
    ASSERT_EQ(gpu.slots(), slots);
    ASSERT_FALSE(gpu.all_resident());
    std::mt19937 rng(23 + unsigned(mode));
    for (int pass = 0; pass < 2; ++pass)
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        if (!cfg.layer_is_moe[size_t(layer)]) continue;
        for (int n : {1, 5}) {
          std::vector<float> x;
          std::vector<RoutedPair> pairs;
          const ExpertRequest request = random_request(cfg, layer, n, rng, x, pairs);
          std::vector<float> want(x.size()), got(x.size(), std::nanf(""));
          cpu.compute(request, want.data());
          gpu.compute(request, got.data());
          float scale = 0, worst = 0;
          for (float v : want) scale = std::max(scale, std::fabs(v));
          ASSERT_GT(scale, 0.0f);
          for (size_t i = 0; i < got.size(); ++i) {
            ASSERT_TRUE(std::isfinite(got[i])) << "mode " << mode << " layer " << layer;
            worst = std::max(worst, std::fabs(got[i] - want[i]));
          }
          EXPECT_LE(worst, 1e-4f * scale)
              << "mode " << mode << " layer " << layer << ", " << n << " rows";
        }
      }
    const DeviceCounters s = gpu.device_stats();
    EXPECT_GT(s.vram_hits + s.vram_uploads + s.vram_cpu_experts, 0u);
    if (mode == 0) {
      EXPECT_GT(s.vram_uploads, 0u);
      EXPECT_EQ(s.vram_upload_bytes, s.vram_uploads * slot_bytes);
    }
    if (mode == 1) {
      EXPECT_EQ(s.vram_uploads, 0u);
      EXPECT_GT(s.vram_cpu_experts, 0u);
      EXPECT_GT(s.vram_hits, 0u);
    }
  }
}

TEST_P(CudaExpertBackendParity, EngineLogitsAndGreedyTokensMatchTheCpuBackend) {
  const Model m(GetParam());
  const ModelConfig& cfg = m.config;
  const LivePlacement placement(
      make_placement(cfg, default_layout(1, {0}, {0}, {0}), PlacementPolicy::kBalanced, 0));
  CpuExpertBackend cpu(cfg, m.weights);
  CudaExpertBackend gpu(cfg, m.weights, 0, 0);
  LocalDispatcher cpu_dispatch(cpu, cfg.hidden_size), gpu_dispatch(gpu, cfg.hidden_size);
  EngineOptions options;
  options.max_rows = 64;
  options.kv_tokens = 256;
  Engine cpu_engine(cfg, m.weights, placement, cpu_dispatch, options);
  Engine gpu_engine(cfg, m.weights, placement, gpu_dispatch, options);

  const int vocab = cfg.vocab_size;
  const auto run = [&](Engine& engine, std::vector<float>& prompt_logits) {
    const int seq = engine.open_sequence();
    prompt_logits = engine.forward(seq, m.prompt, true);
    std::vector<int> tokens;
    std::vector<float> last(prompt_logits.end() - vocab, prompt_logits.end());
    for (int step = 0; step < 8; ++step) {
      const int next = int(std::max_element(last.begin(), last.end()) - last.begin());
      tokens.push_back(next);
      last = engine.forward(seq, std::vector<int>{next}, false);
    }
    engine.close_sequence(seq);
    return tokens;
  };
  std::vector<float> cpu_logits, gpu_logits;
  const std::vector<int> cpu_tokens = run(cpu_engine, cpu_logits);
  const std::vector<int> gpu_tokens = run(gpu_engine, gpu_logits);
  ASSERT_EQ(gpu_logits.size(), cpu_logits.size());
  float scale = 0, worst = 0;
  for (size_t i = 0; i < cpu_logits.size(); ++i) {
    ASSERT_TRUE(std::isfinite(gpu_logits[i])) << "logit " << i;
    scale = std::max(scale, std::fabs(cpu_logits[i]));
    worst = std::max(worst, std::fabs(gpu_logits[i] - cpu_logits[i]));
  }
  ASSERT_GT(scale, 0.0f);
  EXPECT_LE(worst, 1e-4f * scale) << "max |logit difference| " << worst << " of max |logit| "
                                  << scale;
  EXPECT_EQ(gpu_tokens, cpu_tokens) << "greedy tokens differ";
  RecordProperty("max_relative_logit_error", std::to_string(worst / scale));
  EXPECT_GT(gpu.stats().requests, 0u);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* model : {"dsv3", "glm5", "glm52", "kimi"})
    for (const Case& c : {Case{model, 0, 0}, Case{model, 4, 64}, Case{model, 4, 0},
                          Case{model, 8, 0}, Case{model, 16, 0}})
      out.push_back(c);
  // NVFP4 experts as stored (ModelOpt): each expert's global scales reach its VRAM slot.
  out.push_back(Case{"glm5_nvfp4", 0, 0});
  // compressed-tensors INT4 as stored (groups of 32), symmetric and with zero points: the
  // offsets in each VRAM slot after the scales, added by the kernels.
  out.push_back(Case{"kimi_w4a16", 0, 0});
  out.push_back(Case{"kimi_w4a16_asym", 0, 0});
  return out;
}

INSTANTIATE_TEST_SUITE_P(ParityModels, CudaExpertBackendParity, testing::ValuesIn(cases()),
                         [](const testing::TestParamInfo<Case>& param_info) {
                           std::ostringstream name;
                           name << param_info.param;
                           return name.str();
                         });

}  // namespace
}  // namespace colibri
