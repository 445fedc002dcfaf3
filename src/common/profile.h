// Per-rank profiling: phase timers per layer, counters, and trace events; reports are gathered
// by the coordinator and printed as one table, written as JSON (--profile-json) and as a
// Chrome/Perfetto trace (--trace).
#pragma once

#include <array>
#include <cereal/types/array.hpp>
#include <cereal/types/map.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace colibri {

enum class Phase : int {
  // coordinator
  kEmbed,
  kAttention,
  kIndexer,
  kRouter,
  kSharedExpert,
  kLocalExperts,  // the routed experts it owns itself (one process, or a ram_gb budget)
  kDispatch,
  kWaitSlowest,  // from the end of dispatch until the last owner's partial arrived
  kCombine,
  kDenseMlp,
  kLmHead,
  kSampling,
  // expert ranks
  kRecvWait,
  kCompute,
  kSend,
  kCount
};
constexpr int kPhaseCount = int(Phase::kCount);
const char* phase_name(Phase phase);

struct TraceEvent {
  int phase = 0;
  int layer = -1;
  double start_us = 0;  // since the rank's profiler epoch (aligned across ranks by MPI_Wtime)
  double duration_us = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(phase, layer, start_us, duration_us);
  }
};

// An expert rank's RAM and disk tiers as its ExpertStore counts them (rank/expert_store.h), from
// start-up on (start-up loading is not counted). The store, the rank's report, the printed and
// JSON profile read this one type.
struct StoreCounters {
  uint64_t pinned_hits = 0;      // acquires served from the pinned tier
  uint64_t ram_hits = 0;         // acquires served from the RAM cache
  uint64_t disk_hits = 0;        // acquires of an expert read from disk for them
  uint64_t waits = 0;            // acquires that blocked on a read
  uint64_t disk_bytes_read = 0;  // weight bytes read from disk after start-up
  uint64_t loader_us = 0;        // time spent reading (loader thread and demand reads)
  uint64_t loader_wait_us = 0;   // time acquires spent blocked on reads
  uint64_t hint_reads = 0;       // experts read because a hint named them (--prefetch-ahead)
  uint64_t hint_hits = 0;        // acquires served by such a read before anything else touched it

  template <class Archive>
  void serialize(Archive& ar) {
    ar(pinned_hits, ram_hits, disk_hits, waits, disk_bytes_read, loader_us, loader_wait_us,
       hint_reads, hint_hits);
  }
};

// A GPU expert rank's device and VRAM tier as its CUDA expert backend counts them.
struct DeviceCounters {
  uint64_t vram_bytes = 0;    // device memory of the expert slots
  uint64_t gpu_requests = 0;  // requests computed on the device
  uint64_t gpu_us = 0;        // their device time (rows up, kernels, partial down; CUDA events)
  // The VRAM tier (rank/vram_tier.h): request experts found in VRAM, missed and uploaded, missed
  // and computed on the CPU; slots taken over; bytes and copy-stream time of those uploads.
  uint64_t vram_hits = 0, vram_uploads = 0, vram_cpu_experts = 0, vram_evictions = 0;
  uint64_t vram_upload_bytes = 0, vram_upload_us = 0;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(vram_bytes, gpu_requests, gpu_us, vram_hits, vram_uploads, vram_cpu_experts, vram_evictions,
       vram_upload_bytes, vram_upload_us);
  }
};

// Coordinator: one MoE layer's exchanges as the coordinator saw them (the critical path of the
// layer): per owner rank, the time from the end of dispatch until its partial arrived and the rows
// sent to it; which owner's partial arrived last, and by how much after the one before it.
// Partials the coordinator finds in the same look at its pending receives arrived together: an
// exchange whose last two did is a tie, counted apart (no owner was the slowest).
struct LayerExchange {
  uint64_t exchanges = 0;
  std::map<int, double> reply_us;  // per owner rank, summed over exchanges
  std::map<int, uint64_t> rows;    // per owner rank, rows sent
  std::map<int, uint64_t> last;    // per owner rank, exchanges whose last partial was its alone
  uint64_t ties = 0;               // exchanges whose last partials arrived together
  double last_margin_us = 0;       // summed: last arrival minus the one before (0 alone or tied)

  template <class Archive>
  void serialize(Archive& ar) {
    ar(exchanges, reply_us, rows, last, ties, last_margin_us);
  }
};

struct RankReport {
  int rank = 0;
  std::string host;
  std::string role;    // "coordinator" or "expert"; print_profile splits busy/wait by it
  double wall_us = 0;  // profiler lifetime
  std::array<double, kPhaseCount> phase_us{};                   // totals
  std::vector<std::array<double, kPhaseCount>> layer_phase_us;  // [layer][phase]
  uint64_t rows = 0;     // token rows served (expert ranks) or dispatched (coordinator)
  uint64_t experts = 0;  // (row, expert) pairs computed
  uint64_t bytes_in = 0, bytes_out = 0;
  std::map<int, uint64_t> bytes_to_rank;  // per link, bytes sent to each peer
  // Coordinator: per expert rank, time from the end of dispatch until its partial arrived (its
  // compute plus transfer), summed over exchanges.
  std::map<int, double> reply_us;
  uint64_t slowest_count = 0;      // times this rank's partial arrived last in a layer exchange
  uint64_t weight_bytes_read = 0;  // model bytes this rank loaded
  std::vector<TraceEvent> events;
  uint64_t dropped_events = 0;  // trace events not kept once events reached the cap
  StoreCounters store;          // expert ranks: their RAM and disk tiers
  DeviceCounters device;        // GPU expert ranks: their device and VRAM tier
  // Coordinator: bytes of requests and replies to and from expert ranks on other hosts (with
  // --combine host, every message that crosses hosts has the coordinator at one end).
  uint64_t bytes_cross_host = 0;
  // Coordinator: bytes of rows and partials (of bytes_in and bytes_out) that went through the
  // shared segments of expert ranks on its host instead of MPI messages.
  uint64_t bytes_shared = 0;
  std::vector<LayerExchange> layer_exchanges;  // coordinator: [layer]; empty on dense layers

  template <class Archive>
  void serialize(Archive& ar) {
    ar(rank, host, role, wall_us, phase_us, layer_phase_us, rows, experts, bytes_in, bytes_out,
       bytes_to_rank, reply_us, slowest_count, weight_bytes_read, events, dropped_events, store,
       device, bytes_cross_host, bytes_shared, layer_exchanges);
  }
};

// A rank's counters while the job runs: what the coordinator asks each expert rank for between
// steps while serving (Dispatcher::live_counters), for the dashboard and /metrics. The same
// numbers as the rank's end-of-run report (RankReport), taken at that moment.
struct LiveCounters {
  int rank = -1;
  double wall_us = 0;               // the rank's profiler lifetime
  double busy_us = 0, wait_us = 0;  // busy_us() and wait_us() of its report
  uint64_t rows = 0, experts = 0;   // rows served, (row, expert) pairs computed
  uint64_t bytes_in = 0, bytes_out = 0;
  StoreCounters store;    // its RAM and disk tiers
  DeviceCounters device;  // a GPU expert rank's device and VRAM tier

  template <class Archive>
  void serialize(Archive& ar) {
    ar(rank, wall_us, busy_us, wait_us, rows, experts, bytes_in, bytes_out, store, device);
  }
};

// Coordinator: everything it does between the exchanges (dispatch included, as an expert rank's
// send is). Expert ranks: compute + send. What the profile table's busy and wait columns show.
double busy_us(const RankReport& r);
// Coordinator: waiting for the owners' partials; expert ranks: waiting for a request.
double wait_us(const RankReport& r);
// The live counters of a rank's report (its store and device counters as the report has them).
LiveCounters live_counters(const RankReport& r);

struct RunSummary {
  int prefill_tokens = 0;
  double prefill_seconds = 0;
  int decode_tokens = 0;
  double decode_seconds = 0;
  double ttft_seconds = 0;
};

// Not thread-safe: one Profiler per rank, used from the rank's driving thread.
class Profiler {
 public:
  // Trace events kept per rank (24 bytes each); later ones are counted in dropped_events.
  static constexpr size_t kMaxTraceEvents = 2'000'000;

  Profiler(int rank, std::string host, std::string role, int num_layers, bool keep_trace);

  double now_us() const;
  // Restarts the clock; every rank calls it right after the same barrier so traces line up.
  // Events already recorded are shifted onto the new epoch; totals are kept.
  void restart_epoch();
  // Adds a finished interval to the totals (layer -1: outside any layer) and the trace.
  void add(Phase phase, int layer, double start_us, double duration_us);

  class Scope {
   public:
    Scope(Profiler& profiler, Phase phase, int layer)
        : profiler_(profiler), phase_(phase), layer_(layer), start_us_(profiler.now_us()) {}
    ~Scope() { profiler_.add(phase_, layer_, start_us_, profiler_.now_us() - start_us_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Profiler& profiler_;
    Phase phase_;
    int layer_;
    double start_us_;
  };
  Scope scope(Phase phase, int layer = -1) { return Scope(*this, phase, layer); }

  RankReport& counters() { return report_; }

  // Coordinator, one MoE layer's exchange: `rows` sent to owner `rank` (at dispatch), its partial
  // arrived `reply_us` after the end of dispatch (adds to reply_us and the layer's share of it),
  // and end_exchange() once every partial of the layer arrived: the last of them is the layer's
  // critical path.
  void add_rows(int layer, int rank, uint64_t rows);
  void add_reply(int layer, int rank, double reply_us);
  void end_exchange(int layer);
  // Final report with wall time filled in.
  RankReport report() const;

 private:
  std::chrono::steady_clock::time_point epoch_;
  bool keep_trace_;
  RankReport report_;
  LayerExchange& exchange_of(int layer);
  // The exchange in progress: its partials' arrivals, (reply_us, rank).
  std::vector<std::pair<double, int>> arrivals_;
};

// A Profiler::Scope that costs nothing without a profiler.
class OptionalScope {
 public:
  OptionalScope(Profiler* profiler, Phase phase, int layer = -1)
      : profiler_(profiler),
        phase_(phase),
        layer_(layer),
        start_us_(profiler ? profiler->now_us() : 0) {}
  ~OptionalScope() {
    if (profiler_) profiler_->add(phase_, layer_, start_us_, profiler_->now_us() - start_us_);
  }
  OptionalScope(const OptionalScope&) = delete;
  OptionalScope& operator=(const OptionalScope&) = delete;

 private:
  Profiler* profiler_;
  Phase phase_;
  int layer_;
  double start_us_;
};

// One table (per rank: busy %, wait %, rows, experts, bytes in/out, slowest count), then the
// coordinator phase split and, for a run from the command line, the run line
// "prefill N tok in X s | decode M tok in Y s (Z tok/s) | TTFT T s" (none after --serve, whose
// requests' figures are in /metrics).
void print_profile(std::FILE* out, const std::vector<RankReport>& reports,
                   const std::optional<RunSummary>& run);
void write_profile_json(const std::filesystem::path& path, const std::vector<RankReport>& reports,
                        const RunSummary& run);
// Chrome trace-event JSON: one process per rank (pid = rank, named "rank r (role)@host").
void write_trace(const std::filesystem::path& path, const std::vector<RankReport>& reports);

}  // namespace colibri
