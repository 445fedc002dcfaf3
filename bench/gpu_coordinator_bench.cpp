// Decode step time of the engine with the coordinator's forward on the GPU (CudaCompute) against
// the CPU coordinator, on a model directory (launch/gpu-check.sh makes a GLM-5.2-shaped slice
// with colibri-gen-bench-model). Routed experts run on the CPU in this process (LocalDispatcher
// over the CPU expert backend), as expert ranks would. Then the GPU coordinator alone (routed
// experts answered with zeros) at a longer context, with the HBM bytes a decode step must read
// at least (every device weight once, the keys attention and the indexer read) against the
// device-to-device copy bandwidth measured in the same run. Median of --steps after warm-up.
// Prints a table and JSON lines.
//
//   gpu_coordinator_bench --model DIR [--context 128] [--long-context 4096] [--steps 20]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "coordinator/cuda_compute.h"
#include "coordinator/engine.h"
#include "coordinator/gpu_staging.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "gpu_bench.h"
#include "machine.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "rank/expert_backend.h"
#include "transport/local_dispatcher.h"

namespace colibri {
namespace {

struct Options {
  std::string model;
  int context = 128, long_context = 4096, steps = 20;
};

constexpr const char* kFlags = "--model DIR [--context 128] [--long-context 4096] [--steps 20]";

[[noreturn]] void usage(const std::string& why) {
  bench::usage_exit("gpu_coordinator_bench", kFlags, why);
}

Options parse(int argc, char** argv) {
  Options o;
  bench::parse_flag_pairs(
      argc, argv,
      [&](const std::string& arg, const std::string& value) {
        if (arg == "--model")
          o.model = value;
        else if (arg == "--context")
          o.context = std::stoi(value);
        else if (arg == "--long-context")
          o.long_context = std::stoi(value);
        else if (arg == "--steps")
          o.steps = std::stoi(value);
        else
          return false;
        return true;
      },
      usage);
  if (o.model.empty() || o.context < 1 || o.long_context < 1 || o.steps < 1)
    usage("--model is required; sizes must be positive");
  return o;
}

using bench::median;

// Routed experts answered with zeros: the coordinator's own work alone.
class ZeroDispatcher final : public Dispatcher {
 public:
  void dispatch(const DispatchPlan&, ConstView) override {}
  void combine(View out) override { std::memset(out.data, 0, out.bytes()); }
  void shutdown() override {}
};

// Prefills `context` random tokens, then times `steps` greedy-free decode steps (token 1); the
// median step in microseconds.
double decode_step_us(Engine& engine, int context, int steps) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> token(0, engine.config().vocab_size - 1);
  std::vector<int> prompt(static_cast<size_t>(context));
  for (int& t : prompt) t = token(rng);
  const int seq = engine.open_sequence();
  engine.forward(seq, prompt, false);
  std::vector<double> us;
  for (int step = 0; step < steps + 3; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<float> logits = engine.forward(seq, std::vector<int>{token(rng)}, false);
    const auto stop = std::chrono::steady_clock::now();
    if (step >= 3) us.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  engine.close_sequence(seq);
  return median(us);
}

// Weight bytes a decode step reads on the device: every product weight once in the form the
// device holds it (gpu_staging.h: NVFP4 as stored, BF16, or fp32; not the embedding table: one
// row per token), norms and routers in fp32.
uint64_t step_weight_bytes(const ModelConfig& c, const ModelWeights& w) {
  uint64_t bytes = device_weight_bytes(w.lm_head) + 4 * w.final_norm.size();
  for (const LayerWeights& l : w.layers) {
    const AttentionWeights& a = l.attn;
    for (const Matrix* m : {&a.q_a_proj, &a.q_b_proj, &a.q_proj, &a.kv_a_proj, &a.o_proj})
      bytes += device_weight_bytes(*m);
    bytes += device_weight_bytes(a.kv_b_proj, true);
    if (a.indexer)
      bytes += device_weight_bytes(a.indexer->wq_b) + device_weight_bytes(a.indexer->wk) +
               device_weight_bytes(a.indexer->weights_proj);
    const MlpWeights& mlp = l.is_moe ? l.shared_experts : l.dense_mlp;
    if (mlp.quantized())
      bytes += 2 * uint64_t(mlp.quant.gate.rows * mlp.quant.gate.cols * 3);
    else
      bytes += device_weight_bytes(mlp.gate) + device_weight_bytes(mlp.up) +
               device_weight_bytes(mlp.down);
    if (l.is_moe) bytes += 4 * uint64_t(c.n_routed_experts) * uint64_t(c.hidden_size);
    bytes += 4 * (l.input_norm.size() + l.post_attention_norm.size());
  }
  return bytes;
}

// KV bytes a decode step at `context` reads at least: per layer the attended keys' latent and
// rope key (the indexer's top-k where it selects), and on full indexer layers every indexer key.
uint64_t step_kv_bytes(const ModelConfig& c, const ModelWeights& w, int context) {
  const uint64_t keys =
      uint64_t(c.has_indexer() ? std::min(context + 1, c.index_topk) : context + 1);
  uint64_t bytes = 0;
  for (const LayerWeights& l : w.layers) {
    bytes += keys * uint64_t(c.kv_lora_rank + c.qk_rope_head_dim) * 4;
    if (l.attn.indexer) bytes += uint64_t(context + 1) * uint64_t(c.index_head_dim) * 4;
  }
  return bytes;
}

int run(const Options& o) {
  std::string why_none;
  if (cuda::device_count(&why_none) == 0) {
    std::fprintf(stderr, "gpu_coordinator_bench: no CUDA device: %s\n", why_none.c_str());
    return 1;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const ModelConfig config = load_model_config(o.model);
  const Checkpoint checkpoint(o.model, config.fp8_block);
  LoadOptions load;
  load.keep_stored = true;
  const ModelWeights weights = load_model_weights(config, checkpoint, load);
  const LivePlacement placement(
      make_placement(config, default_layout(1, {0}, {0}, {0}), PlacementPolicy::kBalanced, 0));
  CpuExpertBackend experts(config, weights);
  LocalDispatcher dispatch(experts, config.hidden_size);
  ZeroDispatcher zero;
  EngineOptions options;
  options.max_rows = 256;
  options.kv_tokens = std::max(o.context, o.long_context) + 64;
  const ComputeFactory gpu = [](const ModelConfig& c, const ModelWeights& w, KvManager& kv,
                                int max_rows,
                                Profiler* profiler) -> std::unique_ptr<CoordinatorCompute> {
    return std::make_unique<CudaCompute>(c, w, kv, max_rows, 0, profiler);
  };

  const double copy_gbs = bench::copy_bandwidth_gbs(size_t(1) << 30, 20, nullptr);
  double gpu_us = 0, cpu_us = 0, alone_us = 0;
  {
    Engine engine(config, weights, placement, dispatch, options, nullptr, gpu);
    gpu_us = decode_step_us(engine, o.context, o.steps);
  }
  {
    Engine engine(config, weights, placement, dispatch, options);
    cpu_us = decode_step_us(engine, o.context, o.steps);
  }
  {
    Engine engine(config, weights, placement, zero, options, nullptr, gpu);
    alone_us = decode_step_us(engine, o.long_context, o.steps);
  }
  const uint64_t hbm_bytes =
      step_weight_bytes(config, weights) + step_kv_bytes(config, weights, o.long_context);
  const double hbm_gbs = double(hbm_bytes) / (alone_us * 1e-6) / 1e9;
  std::printf("device %s; cpu %s; load %s\n", prop.name, bench::cpu_model().c_str(),
              bench::load_average().c_str());
  std::printf("model %s: %d layers, hidden %d, vocab %d\n", o.model.c_str(), config.num_layers,
              config.hidden_size, config.vocab_size);
  std::printf(
      "decode step at context %d, experts on the CPU: GPU coordinator %.0f us, CPU "
      "coordinator %.0f us (%.2fx)\n",
      o.context, gpu_us, cpu_us, cpu_us / gpu_us);
  std::printf(
      "GPU coordinator alone at context %d: %.0f us for >= %.1f MB = %.0f GB/s, %.3f of "
      "d2d copy %.0f GB/s\n",
      o.long_context, alone_us, double(hbm_bytes) / 1e6, hbm_gbs, hbm_gbs / copy_gbs, copy_gbs);
  std::printf(
      "{\"bench\":\"gpu_coordinator_decode\",\"device\":\"%s\",\"layers\":%d,\"hidden\":%d,"
      "\"context\":%d,\"gpu_step_us\":%.1f,\"cpu_step_us\":%.1f,\"long_context\":%d,"
      "\"coordinator_alone_us\":%.1f,\"hbm_bytes\":%llu,\"hbm_gbs\":%.1f,\"copy_gbs\":%.1f,"
      "\"fraction_of_copy\":%.4f,\"steps\":%d}\n",
      prop.name, config.num_layers, config.hidden_size, o.context, gpu_us, cpu_us, o.long_context,
      alone_us, (unsigned long long)hbm_bytes, hbm_gbs, copy_gbs, hbm_gbs / copy_gbs, o.steps);
  return 0;
}

}  // namespace
}  // namespace colibri

int main(int argc, char** argv) {
  try {
    return colibri::run(colibri::parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_coordinator_bench: %s\n", e.what());
    return 1;
  }
}
