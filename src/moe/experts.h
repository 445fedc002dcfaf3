// Routed-expert execution. `ExpertExecutor` is the seam between the coordinator and the expert
// owners: the reference runs every expert in-process; the distributed node sends rows to owners.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "model/config.h"
#include "model/weights.h"
#include "moe/router.h"

namespace colibri {

// y[n, hidden] = down(silu(gate(x)) * up(x)) for n rows; a quantized MLP runs
// kernels::quant_expert_ffn on its container bytes.
void mlp_forward(const MlpWeights& w, const float* x, int n, float* y);

// Two phases so the caller can compute the shared expert while routed experts run elsewhere:
// begin() hands over the rows (x and routing must stay valid until finish()), finish() writes
// out[n, hidden] = sum over each row's routed experts of weight * expert(x_row).
class ExpertExecutor {
 public:
  virtual ~ExpertExecutor() = default;
  virtual void begin(int layer, const float* x, int n, const Routing& routing) = 0;
  virtual void finish(float* out) = 0;
};

// out[n, hidden] = sum of weight * expert(x[row]) over the pairs (zeroed first), experts in
// ascending order, so every row sums its experts in the same order wherever they run.
// Experts missing from `layer` are an error: their owner is another rank.
void run_expert_pairs(const LayerWeights& layer, int hidden, const float* x, int n,
                      std::span<const RoutedPair> pairs, float* out);
// The same, with each expert's weights from `expert_weights`, called once per expert in
// ascending order just before that expert runs (an expert store may read it then).
using ExpertLookup = std::function<const MlpWeights&(uint32_t expert)>;
void run_expert_pairs(const ExpertLookup& expert_weights, int hidden, const float* x, int n,
                      std::span<const RoutedPair> pairs, float* out);

// Runs every routed expert in-process from local weights.
class LocalExperts : public ExpertExecutor {
 public:
  LocalExperts(const ModelConfig& config, const ModelWeights& weights)
      : config_(config), weights_(weights) {}
  void begin(int layer, const float* x, int n, const Routing& routing) override;
  void finish(float* out) override;

 private:
  const ModelConfig& config_;
  const ModelWeights& weights_;
  int layer_ = -1, n_ = 0;
  const float* x_ = nullptr;
  const Routing* routing_ = nullptr;
};

}  // namespace colibri
