// The per-layer compute of the coordinator's forward pass, behind one narrow interface: the
// Engine keeps the control flow (batch checks, KV bookkeeping, the layer loop, routing plan,
// dispatch and combine); a CoordinatorCompute holds the residual stream and runs the dense math
// on the CPU (CpuCompute, the oracle) or on a CUDA device (cuda_compute.h). The residual stream
// h [n, hidden] lives where the compute runs; the routed experts see views of the normed rows and
// write their combined partial into a view, in device memory when the compute and the dispatcher
// both take it (no host round trip), else on the host.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/buffer.h"
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
  // The normed rows [n, hidden] (fp32) for the routed experts' dispatch, valid until the next
  // layer: in the compute's device memory when `where` is Device::kCuda and the compute runs
  // there, else a host copy. The view says which it is.
  virtual ConstView normed(Device where) = 0;
  // Starts the shared expert on normed (MoE layers with one); it may run while experts work.
  virtual void shared_expert(int layer) = 0;
  // The buffer [n, hidden] (fp32) the routed experts' combine writes into, on the device or the
  // host as `where` asks and the compute allows; add_moe reads it from there.
  virtual View routed(Device where) = 0;
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
  ConstView normed(Device where) override;
  void shared_expert(int layer) override;
  View routed(Device where) override;
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
