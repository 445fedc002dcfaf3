// What the server counts, for GET /metrics in the Prometheus text format: requests by HTTP
// status, queue and running sequences, KV blocks, tokens, prefix-cache hits, and latency
// histograms under vLLM's names (time to first token, inter-token latency, end-to-end, queue
// time). Written by the scheduler thread and the HTTP threads, read by the HTTP threads.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/profile.h"

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

// --kv-cache-dir's counters (KvCacheDirCounters), set by the scheduler.
struct KvCacheDirMetrics {
  bool enabled = false;
  uint64_t loads = 0, tokens_loaded = 0, files_written = 0, bytes_written = 0, files_refused = 0,
           files_evicted = 0, writes_failed = 0, files = 0, bytes = 0;
  double load_seconds = 0;
};

class ServeMetrics {
 public:
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
  void set_gauges(const ServeGauges& gauges);
  void set_phases(const std::array<double, kPhaseCount>& phase_us);
  // Per expert rank: dispatch-to-partial time summed (RankReport::reply_us).
  void set_rank_replies(const std::map<int, double>& reply_us);
  void set_placement(const PlacementMetrics& placement);
  void set_kv_cache_dir(const KvCacheDirMetrics& kv_cache_dir);
  ServeGauges gauges() const;

  std::string render() const;

 private:
  mutable std::mutex mutex_;
  std::map<int, uint64_t> responses_;
  std::map<std::string, uint64_t> finished_;
  uint64_t prompt_tokens_ = 0, cached_prompt_tokens_ = 0, generated_tokens_ = 0;
  uint64_t prefix_queries_ = 0, prefix_hits_ = 0, steps_ = 0;
  Histogram ttft_, itl_, e2e_, queue_, step_rows_, step_seconds_;
  ServeGauges gauges_;
  std::array<double, kPhaseCount> phase_us_{};
  std::map<int, double> reply_us_;
  PlacementMetrics placement_;
  KvCacheDirMetrics kv_cache_dir_;
};

}  // namespace colibri
