// The single-process reference forward pass: plain, fp32, one sequence, proven equal to
// transformers by the parity tests. It is the oracle of the engine (coordinator/engine.h), which
// serves production; tests and tools use it, the program does not. Keep it simple.
#pragma once

#include <span>
#include <vector>

#include "common/profile.h"
#include "model/config.h"
#include "model/forward_fn.h"
#include "model/rope.h"
#include "model/weights.h"
#include "moe/experts.h"
#include "oracle/reference_attention.h"
#include "oracle/reference_kv_cache.h"

namespace colibri {

class ReferenceModel {
 public:
  // `experts` runs the routed experts; LocalExperts over `weights` when null.
  ReferenceModel(const ModelConfig& config, const ModelWeights& weights,
                 ExpertExecutor* experts = nullptr);

  // Runs `tokens` at positions cache.length()... and appends them to the cache. Returns logits
  // [tokens.size(), vocab], or only the last row's [vocab] when all_logits is false.
  std::vector<float> forward(std::span<const int> tokens, KvCache& cache, bool all_logits = true);

  const ModelConfig& config() const { return config_; }
  // Optional: phase timings go here (attention, indexer, router, shared expert, lm_head, ...).
  void set_profiler(Profiler* profiler);
  Profiler* profiler() const { return profiler_; }

 private:
  const ModelConfig& config_;
  const ModelWeights& weights_;
  Rope rope_;
  MlaAttention attention_;
  LocalExperts local_experts_;
  ExpertExecutor* experts_;
  Profiler* profiler_ = nullptr;
};

// The reference's ForwardFn over `cache` (both must outlive it).
inline ForwardFn reference_forward(ReferenceModel& model, KvCache& cache) {
  return [&model, &cache](std::span<const int> tokens, bool all_logits) {
    return model.forward(tokens, cache, all_logits);
  };
}

}  // namespace colibri
