// The production forward pass on the coordinator: one call runs a Batch of rows from many
// sequences through every layer. Each MoE layer routes all rows, builds one DispatchPlan (the
// count phase), dispatches once, computes the shared expert while the owners work, and combines
// once, however many sequences the batch holds. The dense math (embedding, attention over the
// KvManager's blocks, router, shared expert, dense MLP, lm_head) goes through a
// CoordinatorCompute (CPU by default, or CUDA); routed experts through a Dispatcher.
// ReferenceModel is its oracle.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "common/profile.h"
#include "coordinator/batch.h"
#include "coordinator/coordinator_compute.h"
#include "coordinator/kv_manager.h"
#include "coordinator/repin.h"
#include "model/config.h"
#include "model/forward_fn.h"
#include "model/weights.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "moe/routing_stats.h"
#include "transport/transport.h"

namespace colibri {

// How well the next MoE layer's router on a layer's rows predicts that next layer's experts (every
// step with --prefetch-ahead, else one step in 16): per layer, routed (row, expert) pairs, those
// predicted for their row, and over each step's set of distinct experts, the predicted, the
// routed and those both.
struct PrefetchStats {
  std::vector<uint64_t> pairs, pair_hits;                     // [layers]
  std::vector<uint64_t> set_predicted, set_routed, set_hits;  // [layers]

  struct Totals {
    uint64_t pairs = 0, pair_hits = 0, set_predicted = 0, set_hits = 0;
  };
  Totals totals() const;  // summed over the layers
};

// What the dispatch did with the placement: (row, expert) pairs sent to each owner rank, and
// those that went to a replica rather than the expert's first owner.
struct PlacementCounters {
  std::map<int, uint64_t> pairs_to_rank;
  uint64_t replica_pairs = 0;
};

struct EngineOptions {
  int max_rows = 256;  // rows per forward call; the exchange buffers are sized for it
  int kv_tokens = 0;   // KV pool in tokens; 0: the model's context, at most kDefaultKvTokens
  int max_seqs = 1;    // sequences open at once
  // --prefetch-ahead: at each MoE layer, the next MoE layer's router applied to this layer's
  // normed rows predicts its experts; their owners get a hint before this layer's dispatch.
  bool prefetch_ahead = false;
  static constexpr int kDefaultKvTokens = 32768;
};

class Engine {
 public:
  Engine(const ModelConfig& config, const ModelWeights& weights, const LivePlacement& placement,
         Dispatcher& dispatcher, const EngineOptions& options, Profiler* profiler = nullptr,
         const ComputeFactory& compute = {});
  ~Engine();

  int open_sequence() { return kv_.open(); }
  void close_sequence(int seq) { kv_.close(seq); }
  void clear_sequence(int seq) { kv_.clear(seq); }
  int length(int seq) const { return kv_.length(seq); }

  // One forward call. Returns the logits of the rows marked `logits`, in row order
  // [those rows, vocab]. An invalid batch (rows out of order, a full KV pool, more rows than
  // max_rows) is an Error before any sequence's contents or length change (blocks already
  // reserved for other sequences of the batch stay theirs).
  std::vector<float> forward(const Batch& batch);
  // One sequence: appends `tokens` in calls of at most max_rows rows. Returns the logits of every
  // token, or only of the last when all_logits is false.
  std::vector<float> forward(int seq, std::span<const int> tokens, bool all_logits = true);

  const ModelConfig& config() const { return config_; }
  Profiler* profiler() const { return profiler_; }
  KvManager& kv() { return kv_; }
  uint64_t kv_bytes() const { return kv_.bytes(); }
  int max_rows() const { return options_.max_rows; }
  // The routes this engine sent since it was built: per (layer, expert) the routed rows.
  const RoutingStats& routes() const { return routes_; }
  const PrefetchStats& prefetch_stats() const { return prefetch_; }
  const PlacementCounters& placement_counters() const { return placement_counters_; }
  const PlacementTable& placement() const { return placement_.current(); }
  std::shared_ptr<const PlacementTable> shared_placement() const { return placement_.share(); }
  // Live re-placement's counters (--repin-every), read by /metrics; null without it.
  void set_repin_stats(const RepinStats* stats) { repin_stats_ = stats; }
  const RepinStats* repin_stats() const { return repin_stats_; }
  // Called at the end of every forward call that succeeded, with its rows: a step boundary, no
  // exchange in flight (live re-placement runs there).
  void set_step_hook(std::function<void(int rows)> hook) { step_hook_ = std::move(hook); }

 private:
  void check(const Batch& batch);
  // Refuses logits holding a NaN or ±Inf (an lm_head whose products overflow), naming the row.
  void check_logits(const Batch& batch, std::span<const float> logits) const;

  const ModelConfig& config_;
  const ModelWeights& weights_;
  const LivePlacement& placement_;
  Dispatcher& dispatcher_;
  EngineOptions options_;
  Profiler* profiler_;
  KvManager kv_;
  std::unique_ptr<CoordinatorCompute> compute_;  // empty factory: CpuCompute
  DispatchPlan plan_;
  RoutingStats routes_;
  // --prefetch-ahead: the next MoE layer of each layer (-1: none), the prediction for it, scores.
  void predict_next(int layer, int n, bool hint);
  static constexpr uint64_t kPredictionSampling = 16;
  uint64_t steps_ = 0;  // forward calls
  void score_prediction(int layer, const Routing& routing, int n);
  std::vector<int> next_moe_;
  Routing predicted_;
  int predicted_layer_ = -1;
  PrefetchStats prefetch_;
  PlacementCounters placement_counters_;
  const RepinStats* repin_stats_ = nullptr;
  std::vector<OwnerHint> hints_;
  std::vector<int> seen_;  // [experts] scratch: marks of the step's experts
  std::function<void(int rows)> step_hook_;
  std::vector<int> seq_end_;  // [max_seqs] per call: last position + 1
};

int default_kv_tokens(const ModelConfig& config);

// The engine's ForwardFn over sequence slot `seq`.
inline ForwardFn sequence_forward(Engine& engine, int seq) {
  return [&engine, seq](std::span<const int> tokens, bool all_logits) {
    return engine.forward(seq, tokens, all_logits);
  };
}

}  // namespace colibri
