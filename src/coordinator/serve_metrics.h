// What the server counts, for GET /metrics in the Prometheus text format: requests by HTTP
// status, queue and running sequences, KV blocks, tokens, prefix-cache hits, and latency
// histograms under vLLM's names (time to first token, inter-token latency, end-to-end, queue
// time); and the same numbers, with the engine's view of the cluster (per-layer critical path,
// routed rows per expert, the placement), as the dashboard's JSON (GET /dashboard/state,
// docs/DASHBOARD.md). Written by the scheduler thread and the HTTP threads, read by the HTTP
// threads.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/profile.h"
#include "moe/placement.h"
#include "moe/routing_stats.h"

namespace colibri {

// A cumulative histogram with fixed upper bounds (seconds or counts).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void observe(double value);
  // Prometheus lines `name_bucket{le=..}`, `name_sum`, `name_count`.
  void render(std::string& out, const std::string& name, const std::string& help) const;
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<uint64_t>& counts() const { return counts_; }
  // The q-quantile of the observations counted in `counts` (this histogram's buckets, or a
  // difference of two readings of them), interpolated within its bucket as Prometheus'
  // histogram_quantile does; 0 when empty; the largest bound for one in the +Inf bucket.
  double quantile(const std::vector<uint64_t>& counts, double q) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // [bounds + 1], not cumulative
  double sum_ = 0;
  uint64_t count_ = 0;
};

// KV pool and scheduler state, set by the scheduler after every step.
struct ServeGauges {
  int waiting = 0;  // requests in the queue
  int running = 0;  // sequences prefilling or decoding
  int kv_blocks_total = 0;
  int kv_blocks_free = 0;
  int kv_blocks_running = 0;  // held by running sequences
  int kv_blocks_cached = 0;   // held by finished conversations kept for prefix reuse
  int cached_sequences = 0;
  bool ready = false;
};

// The placement as the engine used it (Engine::placement_counters, prefetch_stats, repin_stats).
struct PlacementMetrics {
  uint32_t epoch = 0;
  std::map<int, uint64_t> pairs_to_rank;
  uint64_t replica_pairs = 0;
  bool repin = false;  // --repin-every
  uint64_t repin_rounds = 0, repin_changes = 0, repin_moves = 0;
  double repin_seconds = 0;
  bool prefetch = false;  // --prefetch-ahead
  uint64_t prefetch_pairs = 0, prefetch_pair_hits = 0, prefetch_hinted = 0,
           prefetch_hinted_hits = 0;
};

// One rank of the job as the layout describes it (for the dashboard; set once at start-up).
struct RankInfo {
  int rank = 0;
  std::string host;
  std::string role;  // layout role name: coordinator, cpu-expert, gpu-expert
  std::string tier;  // where it keeps its routed experts: vram, ram, ram+disk; none: owns none
};

// The engine's counters that the dashboard reads and /metrics' per-layer lines render, copied by
// the scheduler thread from the coordinator's Profiler (the same RankReport the profile table
// prints), the engine's routes and the placement table.
struct EngineView {
  LiveCounters coordinator;  // its wall, busy, wait, rows and pairs dispatched, bytes
  std::map<int, uint64_t> bytes_to_rank;
  std::vector<std::array<double, kPhaseCount>> layer_phase_us;  // [layer][phase]
  std::vector<LayerExchange> layer_exchanges;                   // [layer]
  RoutingStats routes;                                          // routed rows since start
  std::shared_ptr<const PlacementTable> placement;
};

// One point of the dashboard's time series, taken about once a second: rates and latency
// percentiles over the interval since the one before.
struct SeriesPoint {
  double t_s = 0;  // since the server started
  double generated_tok_per_s = 0, prompt_tok_per_s = 0;
  int running = 0, waiting = 0;
  double kv_usage = 0;
  double ttft_p50_s = 0, ttft_p95_s = 0, itl_p50_s = 0, itl_p95_s = 0, itl_p99_s = 0;
  uint64_t itl_count = 0;  // tokens whose inter-token latency the interval counted
};

// --kv-cache-dir's counters (KvCacheDirCounters), set by the scheduler.
struct KvCacheDirMetrics {
  bool enabled = false;
  uint64_t loads = 0, tokens_loaded = 0, files_written = 0, bytes_written = 0, files_refused = 0,
           files_evicted = 0, writes_failed = 0, files = 0, bytes = 0;
  double load_seconds = 0;
};

// The scheduler's step-cost model and its prefill rule (--max-itl-ms), set after every step.
struct StepCostMetrics {
  double fixed_s = 0, row_s = 0, kilo_key_s = 0;  // the fit: per call, per row, per 1000 keys
  int observations = 0;                           // timed calls it is fitted to
  double mean_abs_error_s = 0;                    // of the fit over them
  double decode_s = 0;     // predicted time of a call of the running sequences' decode rows only
  double itl_bound_s = 0;  // --max-itl-ms; 0: off
};

class ServeMetrics {
 public:
  static constexpr size_t kSeriesPoints = 600;  // 10 minutes at one a second

  ServeMetrics();

  void count_response(int status);
  void count_finished(const std::string& reason);  // stop, length, error, cancelled
  void add_prompt_tokens(uint64_t n, uint64_t cached);
  void add_generated_tokens(uint64_t n);
  void prefix_query(bool hit);
  void observe_ttft(double s);
  void observe_itl(double s);
  void observe_e2e(double s);
  void observe_queue(double s);
  void observe_step(int rows, double s);
  // A call that carried prompt rows: how many, whether --max-itl-ms cut them, and whether even
  // the least rows were predicted beyond it.
  void observe_prefill_chunk(int prompt_rows, bool cut, bool over_bound);
  void set_step_cost(const StepCostMetrics& step_cost);
  void set_gauges(const ServeGauges& gauges);
  void set_phases(const std::array<double, kPhaseCount>& phase_us);
  // Per expert rank: dispatch-to-partial time summed (RankReport::reply_us).
  void set_rank_replies(const std::map<int, double>& reply_us);
  void set_placement(const PlacementMetrics& placement);
  void set_engine_view(EngineView view);
  void set_cluster(std::string model, std::vector<RankInfo> ranks);
  void set_kv_cache_dir(const KvCacheDirMetrics& kv_cache_dir);
  // Every rank's own counters as it answered the scheduler's poll just now
  // (SchedulerOptions::live_counters), and how long the poll took.
  void set_live_counters(std::vector<LiveCounters> counters, double poll_s);
  ServeGauges gauges() const;

  std::string render() const;
  // GET /dashboard/state: the JSON of docs/DASHBOARD.md (schema version kDashboardVersion).
  std::string dashboard_state() const;
  static constexpr int kDashboardVersion = 1;

 private:
  // Everything /metrics and the dashboard show: a reader copies it under the lock and writes it
  // out after, so that it holds the scheduler thread (which sets it every step) for the copy only.
  struct Data {
    Data();
    std::map<int, uint64_t> responses_;
    std::map<std::string, uint64_t> finished_;
    uint64_t prompt_tokens_ = 0, cached_prompt_tokens_ = 0, generated_tokens_ = 0;
    uint64_t prefix_queries_ = 0, prefix_hits_ = 0, steps_ = 0, chunks_cut_ = 0,
             chunks_over_bound_ = 0;
    Histogram ttft_, itl_, e2e_, queue_, step_rows_, step_seconds_, chunk_rows_;
    StepCostMetrics step_cost_;
    ServeGauges gauges_;
    std::array<double, kPhaseCount> phase_us_{};
    std::map<int, double> reply_us_;
    PlacementMetrics placement_;
    KvCacheDirMetrics kv_cache_dir_;
    std::shared_ptr<const EngineView> view_;  // replaced whole; copies share it
    std::string model_;
    std::vector<RankInfo> ranks_;
    std::vector<LiveCounters> live_;  // by rank, ascending; the ranks that answered
    double live_at_s_ = -1;           // when, since the server started; -1: never
    uint64_t live_polls_ = 0;         // polls, and their time summed
    double live_poll_s_ = 0;
    std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
    std::deque<SeriesPoint> series_;  // a point a second at most, the last kSeriesPoints
  };
  Data snapshot() const;

  mutable std::mutex mutex_;
  Data d_;
  // The time series: a point taken as the gauges are set (every step), a second apart at least.
  void sample_series();
  std::chrono::steady_clock::time_point last_sample_ = d_.started_;
  uint64_t last_generated_ = 0, last_prompt_ = 0;
  std::vector<uint64_t> last_ttft_, last_itl_;
};

}  // namespace colibri
