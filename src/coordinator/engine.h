// The production forward pass on the coordinator: one call runs a Batch of rows from many
// sequences through every layer. Each MoE layer routes all rows, builds one DispatchPlan (the
// count phase), dispatches once, computes the shared expert while the owners work, and combines
// once, however many sequences the batch holds. The dense math (embedding, attention over the
// KvManager's blocks, router, shared expert, dense MLP, lm_head) goes through a
// CoordinatorCompute (CPU by default, or CUDA); routed experts through a Dispatcher.
// ReferenceModel is its oracle. With --micro-batches 2 a call of many rows runs as two
// micro-batches, each with its own CPU compute and exchange slot, interleaved so that one's
// attention and shared expert run while the other's routed experts are out (Engine::forward).
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
// predicted for their row, and over each exchange's set of distinct experts (a step's, or one
// micro-batch's with --micro-batches 2), the predicted, the
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
  // --micro-batches 2: a call of at least micro_batch_rows rows runs as two micro-batches in
  // flight, one's attention and shared expert while the other's routed experts are out (two
  // exchange slots of the Dispatcher), with the bits of the call run whole. 1: whole.
  int micro_batches = 1;
  int micro_batch_rows = kDefaultMicroBatchRows;
  static constexpr int kDefaultKvTokens = 32768;
  static constexpr int kDefaultMicroBatchRows = 8;
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
  // Whether calls of many rows run as two micro-batches: asked for (--micro-batches 2), the
  // dispatcher holds two exchanges (Dispatcher::exchange_slots) and the compute is the CPU's.
  bool splits() const { return bool(second_compute_); }
  // Forward calls that ran as two micro-batches.
  uint64_t split_calls() const { return split_calls_; }
  // Where `batch` splits into two micro-batches whose rows compute the bits they compute whole:
  // the first row of the second, or 0 where the call runs whole (fewer than
  // micro_batch_rows rows, or no such row). Each half holds 2 rows or more (a call of one row
  // takes other attention and product kernels), and on a model with the DSA indexer neither half
  // cuts off a single row that sees every position from a run of rows alike (MlaHeads::run).
  static int split_row(const ModelConfig& config, const Batch& batch, int min_rows);
  std::shared_ptr<const PlacementTable> shared_placement() const { return placement_.share(); }
  // Live re-placement's counters (--repin-every), read by /metrics; null without it.
  void set_repin_stats(const RepinStats* stats) { repin_stats_ = stats; }
  const RepinStats* repin_stats() const { return repin_stats_; }
  // Called at the end of every forward call that succeeded, with its rows: a step boundary, no
  // exchange in flight (live re-placement runs there).
  void set_step_hook(std::function<void(int rows)> hook) { step_hook_ = std::move(hook); }

 private:
  void check(const Batch& batch);
  // The rows of one forward call that go through the layers together: the whole call, or one of
  // its two micro-batches, each with its compute and its exchange slot.
  struct Prediction {
    Routing routing;
    int layer = -1;  // the MoE layer `routing` predicts; -1: none
  };
  struct MicroBatch {
    const Batch* batch = nullptr;
    CoordinatorCompute* compute = nullptr;
    int slot = 0;
    DispatchPlan plan;
    Prediction prediction;
    bool in_flight = false;  // its exchange is dispatched and not yet combined
  };
  // Layer l of a micro-batch up to its dispatch (a MoE layer), or all of it (a dense layer).
  void start_layer(MicroBatch& mb, const PlacementTable& placement, int l);
  // The rest of MoE layer l: its shared expert, the combine, the sum.
  void finish_layer(MicroBatch& mb, int l);
  // After an Error within a call: combines (and drops) the exchanges still in flight, so that
  // the dispatcher's slots are free and no reply is left for a later call to take.
  void drain_exchanges() noexcept;
  // Refuses logits holding a NaN or ±Inf (an lm_head whose products overflow), naming the row.
  void check_logits(const Batch& batch, std::span<const float> logits) const;

  const ModelConfig& config_;
  const ModelWeights& weights_;
  const LivePlacement& placement_;
  Dispatcher& dispatcher_;
  EngineOptions options_;
  Profiler* profiler_;
  KvManager kv_;
  std::unique_ptr<CoordinatorCompute> compute_;         // empty factory: CpuCompute
  std::unique_ptr<CoordinatorCompute> second_compute_;  // --micro-batches 2: the second's
  MicroBatch micro_[2];
  Batch halves_[2];  // a split call's rows
  RoutingStats routes_;
  // --prefetch-ahead: the next MoE layer of each layer (-1: none), the prediction for it, scores.
  void predict_next(MicroBatch& mb, int layer, int n, bool hint);
  static constexpr uint64_t kPredictionSampling = 16;
  uint64_t steps_ = 0;        // forward calls
  uint64_t split_calls_ = 0;  // of them, those run as two micro-batches
  void score_prediction(const Prediction& predicted, int layer, const Routing& routing, int n);
  std::vector<int> next_moe_;
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
