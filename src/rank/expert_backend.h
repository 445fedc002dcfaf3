// The expert seam on the owner's side: an expert backend prefetches a layer's experts and
// computes the (row, expert) pairs of one request into a partial. The CPU backend runs the
// kernels in kernels/cpu over the rank's ExpertStore tiers (pinned, RAM cache, disk), or over all
// experts in memory in a single process; a CUDA backend adds a VRAM tier on top of the same store.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/config.h"
#include "model/weights.h"
#include "moe/dispatch_plan.h"
#include "rank/expert_store.h"

namespace colibri {

// The request's rows as host fp32 (as sent, or converted into `buffer`); refuses a request with
// fewer values than n_rows * hidden, naming the layer.
const float* host_f32_rows(const ExpertRequest& request, int hidden, std::vector<float>& buffer);

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;
  // What a device backend did (common/profile.h); zero for the CPU backend.
  virtual DeviceCounters device_stats() const { return {}; }
  // Starts reading the experts of `layer` that are not resident; returns at once.
  virtual void prefetch(int layer, std::span<const int> experts) = 0;
  // Experts of `layer` likely requested soon (ExpertStore::hint); nothing where all are resident.
  virtual void hint(int /*layer*/, std::span<const int> /*experts*/) {}
  // partial [n_rows, hidden] (fp32, host) = for each row, the sum over its pairs of
  // weight * expert(row), experts taken in ascending order.
  virtual void compute(const ExpertRequest& request, float* partial) = 0;
};

class CpuExpertBackend final : public ExpertBackend {
 public:
  // An expert rank: the experts it owns, in tiers.
  CpuExpertBackend(const ModelConfig& config, ExpertStore& store);
  // A single process: every routed expert in `weights`.
  CpuExpertBackend(const ModelConfig& config, const ModelWeights& weights);

  void prefetch(int layer, std::span<const int> experts) override;
  void hint(int layer, std::span<const int> experts) override;
  void compute(const ExpertRequest& request, float* partial) override;

 private:
  const ModelConfig& config_;
  ExpertStore* store_ = nullptr;
  const ModelWeights* weights_ = nullptr;
  std::vector<float> rows_f32_;  // request rows converted from the wire type
  std::vector<int> requested_;
};

}  // namespace colibri
