// The per-layer compute of the coordinator's forward pass, behind one narrow interface: the
// Engine keeps the control flow (batch checks, KV bookkeeping, the layer loop, routing plan,
// dispatch and combine); a CoordinatorCompute holds the residual stream and runs the dense math
// on the CPU (CpuCompute, the oracle) or on a CUDA device (cuda_compute.h). The residual stream
// h [n, hidden] lives where the compute runs; the routed experts see host views of the normed
// rows and write their combined partial into a host buffer.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/profile.h"
#include "coordinator/attention_backend.h"
#include "coordinator/batch.h"
#include "coordinator/kv_manager.h"
#include "model/config.h"
#include "model/weights.h"
#include "moe/router.h"

namespace colibri {

class CoordinatorCompute {
 public:
  virtual ~CoordinatorCompute() = default;

  // Start of a forward call (the batch's KV blocks are reserved): h = embed(tokens).
  virtual void begin(const Batch& batch) = 0;
  // h += attention(input_norm(h)) (writes the rows' keys into the KV cache), then
  // normed = post_attention_norm(h).
  virtual void attention(int layer) = 0;
  // The routing of the normed rows of a MoE layer, on the host.
  virtual Routing route(int layer) = 0;
  // Host copy of normed [n, hidden] for the routed experts' dispatch (valid until the next layer).
  virtual const float* normed_host() = 0;
  // Starts the shared expert on normed (MoE layers with one); it may run while experts work.
  virtual void shared_expert(int layer) = 0;
  // Host buffer [n, hidden] the routed experts' combine writes into.
  virtual float* routed_host() = 0;
  // MoE layer end: h += routed partial (+ shared expert).
  virtual void add_moe(int layer) = 0;
  // Dense layer: h += mlp(normed).
  virtual void dense_mlp(int layer) = 0;
  // final_norm then lm_head over the rows marked `logits`: [those rows, vocab] on the host.
  virtual std::vector<float> logits(const Batch& batch) = 0;
};

// Builds the compute of an Engine over its KV bookkeeping.
using ComputeFactory = std::function<std::unique_ptr<CoordinatorCompute>(
    const ModelConfig&, const ModelWeights&, KvManager&, int max_rows, Profiler*)>;

// Today's CPU forward: kernels/cpu over the weights as loaded, attention by CpuAttention over
// KvManager's blocks. Errors name the layer and step when the residual stream turns non-finite.
class CpuCompute final : public CoordinatorCompute {
 public:
  CpuCompute(const ModelConfig& config, const ModelWeights& weights, KvManager& kv,
             Profiler* profiler);
  ~CpuCompute() override;

  void begin(const Batch& batch) override;
  void attention(int layer) override;
  Routing route(int layer) override;
  const float* normed_host() override { return normed_.data(); }
  void shared_expert(int layer) override;
  float* routed_host() override { return delta_.data(); }
  void add_moe(int layer) override;
  void dense_mlp(int layer) override;
  std::vector<float> logits(const Batch& batch) override;

 private:
  // An Error naming the layer and the step when the residual stream holds a NaN or Inf.
  void check_residual(int layer, const char* after) const;
  void add_delta();

  const ModelConfig& config_;
  const ModelWeights& weights_;
  Profiler* profiler_;
  std::unique_ptr<AttentionBackend> attention_;
  const Batch* batch_ = nullptr;
  std::vector<float> h_, normed_, delta_, shared_;  // [n, hidden]
};

}  // namespace colibri
