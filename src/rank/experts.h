// Routed-expert execution. `ExpertExecutor` is the seam between the coordinator and the expert
// owners: the reference runs every expert in-process; the distributed node sends rows to owners.
#pragma once

#include <vector>

#include "coordinator/router.h"
#include "model/config.h"
#include "model/weights.h"

namespace colibri {

// y[n, hidden] = down(silu(gate(x)) * up(x)) for n rows.
void mlp_forward(const MlpWeights& w, const float* x, int n, float* y);

class ExpertExecutor {
 public:
  virtual ~ExpertExecutor() = default;
  // out[n, hidden] = sum over each row's routed experts of weight * expert(x_row). Overwrites out.
  virtual void run(int layer, const float* x, int n, const Routing& routing, float* out) = 0;
};

// Runs the experts from local weights, in ascending expert order per row.
class LocalExperts : public ExpertExecutor {
 public:
  LocalExperts(const ModelConfig& config, const ModelWeights& weights)
      : config_(config), weights_(weights) {}
  void run(int layer, const float* x, int n, const Routing& routing, float* out) override;

 private:
  const ModelConfig& config_;
  const ModelWeights& weights_;
};

}  // namespace colibri
