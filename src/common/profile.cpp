#include "common/profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <iterator>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/output_file.h"

namespace colibri {

namespace {
// Indexed by Phase.
constexpr const char* kPhaseNames[] = {"embed",         "attention",     "indexer",  "router",
                                       "shared_expert", "local_experts", "dispatch", "wait_slowest",
                                       "combine",       "dense_mlp",     "lm_head",  "sampling",
                                       "recv_wait",     "compute",       "send"};
static_assert(std::size(kPhaseNames) == size_t(kPhaseCount), "one name per Phase");
}  // namespace

const char* phase_name(Phase phase) {
  const int p = int(phase);
  return p >= 0 && p < kPhaseCount ? kPhaseNames[p] : "unknown";
}

// ---- Profiler --------------------------------------------------------------------------------

Profiler::Profiler(int rank, std::string host, std::string role, int num_layers, bool keep_trace)
    : epoch_(std::chrono::steady_clock::now()), keep_trace_(keep_trace) {
  report_.rank = rank;
  report_.host = std::move(host);
  report_.role = std::move(role);
  report_.layer_phase_us.resize(size_t(std::max(num_layers, 0)));
}

double Profiler::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - epoch_)
      .count();
}

void Profiler::restart_epoch() {
  const auto epoch = std::chrono::steady_clock::now();
  const double shift_us = std::chrono::duration<double, std::micro>(epoch - epoch_).count();
  for (TraceEvent& event : report_.events) event.start_us -= shift_us;
  epoch_ = epoch;
}

void Profiler::add(Phase phase, int layer, double start_us, double duration_us) {
  const int p = int(phase);
  assert(p >= 0 && p < kPhaseCount);
  report_.phase_us[size_t(p)] += duration_us;
  if (layer >= 0) {
    if (size_t(layer) >= report_.layer_phase_us.size())
      report_.layer_phase_us.resize(size_t(layer) + 1);
    report_.layer_phase_us[size_t(layer)][size_t(p)] += duration_us;
  }
  if (keep_trace_) {
    if (report_.events.size() < kMaxTraceEvents)
      report_.events.push_back(TraceEvent{p, layer, start_us, duration_us});
    else
      ++report_.dropped_events;
  }
}

LayerExchange& Profiler::exchange_of(int layer) {
  if (size_t(layer) >= report_.layer_exchanges.size())
    report_.layer_exchanges.resize(size_t(layer) + 1);
  return report_.layer_exchanges[size_t(layer)];
}

void Profiler::add_rows(int layer, int rank, uint64_t rows) {
  if (layer < 0) return;
  exchange_of(layer).rows[rank] += rows;
}

void Profiler::add_reply(int layer, int rank, double reply_us) {
  report_.reply_us[rank] += reply_us;
  if (layer < 0) return;
  exchange_of(layer).reply_us[rank] += reply_us;
  arrivals_.emplace_back(reply_us, rank);
}

void Profiler::end_exchange(int layer) {
  if (layer < 0 || arrivals_.empty()) {
    arrivals_.clear();
    return;
  }
  // Several transports (a composite) each add their partials' arrivals: the last of all counts.
  std::sort(arrivals_.begin(), arrivals_.end());
  LayerExchange& e = exchange_of(layer);
  ++e.exchanges;
  const size_t n = arrivals_.size();
  if (n > 1 && arrivals_[n - 1].first == arrivals_[n - 2].first) {
    ++e.ties;
  } else {
    ++e.last[arrivals_.back().second];
    if (n > 1) e.last_margin_us += arrivals_[n - 1].first - arrivals_[n - 2].first;
  }
  arrivals_.clear();
}

RankReport Profiler::report() const {
  RankReport out = report_;
  out.wall_us = now_us();
  return out;
}

// ---- summaries -------------------------------------------------------------------------------

namespace {

bool is_coordinator(const RankReport& r) {
  return r.role == "coordinator";
}

double phase(const RankReport& r, Phase p) {
  return r.phase_us[size_t(p)];
}

}  // namespace

double busy_us(const RankReport& r) {
  if (!is_coordinator(r)) return phase(r, Phase::kCompute) + phase(r, Phase::kSend);
  double sum = 0;
  for (int p = int(Phase::kEmbed); p <= int(Phase::kSampling); ++p)
    if (Phase(p) != Phase::kWaitSlowest) sum += r.phase_us[size_t(p)];
  return sum;
}

double wait_us(const RankReport& r) {
  return phase(r, is_coordinator(r) ? Phase::kWaitSlowest : Phase::kRecvWait);
}

LiveCounters live_counters(const RankReport& r) {
  LiveCounters c;
  c.rank = r.rank;
  c.wall_us = r.wall_us;
  c.busy_us = busy_us(r);
  c.wait_us = wait_us(r);
  c.rows = r.rows;
  c.experts = r.experts;
  c.bytes_in = r.bytes_in;
  c.bytes_out = r.bytes_out;
  c.store = r.store;
  c.device = r.device;
  return c;
}

namespace {

double percent(double part, double whole) {
  return whole > 0 ? 100.0 * part / whole : 0.0;
}

double decode_tok_per_s(const RunSummary& run) {
  return run.decode_seconds > 0 ? run.decode_tokens / run.decode_seconds : 0.0;
}

std::string human_bytes(uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = double(bytes) / 1024.0;
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, kUnits[unit]);
}

// JSON string literal; invalid UTF-8 (a host name off the wire) is replaced, not thrown on.
std::string json_string(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

// ---- table -----------------------------------------------------------------------------------

void print_profile(std::FILE* out, const std::vector<RankReport>& reports,
                   const std::optional<RunSummary>& served) {
  size_t role_w = 4, host_w = 4;
  for (const RankReport& r : reports) {
    role_w = std::max(role_w, r.role.size());
    host_w = std::max(host_w, r.host.size());
  }
  fmt::print(out,
             "{:>4}  {:<{}}  {:<{}}  {:>6}  {:>6}  {:>10}  {:>10}  {:>10}  {:>10}  {:>7}  {:>12}\n",
             "rank", "role", role_w, "host", host_w, "busy %", "wait %", "rows", "experts",
             "bytes in", "bytes out", "slowest", "weights read");
  for (const RankReport& r : reports) {
    fmt::print(out,
               "{:>4}  {:<{}}  {:<{}}  {:>6.1f}  {:>6.1f}  {:>10}  {:>10}  {:>10}  {:>10}  {:>7}  "
               "{:>12}\n",
               r.rank, r.role, role_w, r.host, host_w, percent(busy_us(r), r.wall_us),
               percent(wait_us(r), r.wall_us), r.rows, r.experts, human_bytes(r.bytes_in),
               human_bytes(r.bytes_out), r.slowest_count, human_bytes(r.weight_bytes_read));
  }
  // Expert tiers, when any rank read an expert after start-up.
  const bool tiers = std::any_of(reports.begin(), reports.end(), [](const RankReport& r) {
    return r.store.disk_hits + r.store.ram_hits > 0;
  });
  if (tiers) {
    fmt::print(out, "{:>4}  {:>10}  {:>10}  {:>10}  {:>12}  {:>12}  {:>12}  {:>11}  {:>9}\n",
               "rank", "pinned hit", "ram hit", "disk hit", "disk read", "loader ms", "waited ms",
               "hinted read", "hint hit");
    for (const RankReport& r : reports) {
      if (r.store.pinned_hits + r.store.ram_hits + r.store.disk_hits == 0) continue;
      fmt::print(out,
                 "{:>4}  {:>10}  {:>10}  {:>10}  {:>12}  {:>12.1f}  {:>12.1f}  {:>11}  {:>9}\n",
                 r.rank, r.store.pinned_hits, r.store.ram_hits, r.store.disk_hits,
                 human_bytes(r.store.disk_bytes_read), double(r.store.loader_us) / 1e3,
                 double(r.store.loader_wait_us) / 1e3, r.store.hint_reads, r.store.hint_hits);
    }
  }
  // GPU expert ranks.
  if (std::any_of(reports.begin(), reports.end(),
                  [](const RankReport& r) { return r.device.vram_bytes > 0; })) {
    fmt::print(out,
               "{:>4}  {:>12}  {:>12}  {:>12}  {:>12}  {:>10}  {:>10}  {:>10}  {:>12}  {:>10}\n",
               "rank", "vram experts", "gpu reqs", "gpu ms", "gpu us/req", "vram hit", "uploaded",
               "cpu miss", "upload", "upload ms");
    for (const RankReport& r : reports) {
      if (r.device.vram_bytes == 0) continue;
      fmt::print(
          out,
          "{:>4}  {:>12}  {:>12}  {:>12.1f}  {:>12.1f}  {:>10}  {:>10}  {:>10}  {:>12}  "
          "{:>10.1f}\n",
          r.rank, human_bytes(r.device.vram_bytes), r.device.gpu_requests,
          double(r.device.gpu_us) / 1e3,
          r.device.gpu_requests ? double(r.device.gpu_us) / double(r.device.gpu_requests) : 0.0,
          r.device.vram_hits, r.device.vram_uploads, r.device.vram_cpu_experts,
          human_bytes(r.device.vram_upload_bytes), double(r.device.vram_upload_us) / 1e3);
    }
  }
  // The coordinator's requests and replies that crossed to and from other hosts.
  for (const RankReport& r : reports)
    if (r.bytes_cross_host > 0)
      fmt::print(out, "rank {}: {} ({} bytes) crossed hosts in the exchange\n", r.rank,
                 human_bytes(r.bytes_cross_host), r.bytes_cross_host);
  for (const RankReport& r : reports) {
    if (r.dropped_events > 0)
      fmt::print(out, "rank {}: trace full, {} events dropped after the first {}\n", r.rank,
                 r.dropped_events, r.events.size());
  }

  const auto coordinator = std::find_if(reports.begin(), reports.end(), is_coordinator);
  if (coordinator != reports.end()) {
    fmt::print(out, "coordinator phases (rank {}, wall {:.3f} ms):\n", coordinator->rank,
               coordinator->wall_us / 1e3);
    for (int p = 0; p < kPhaseCount; ++p) {
      const double us = coordinator->phase_us[size_t(p)];
      if (us == 0) continue;
      fmt::print(out, "  {:<14} {:>12.3f} ms  {:>5.1f} %\n", phase_name(Phase(p)), us / 1e3,
                 percent(us, coordinator->wall_us));
    }
  }

  if (!served) return;
  const RunSummary& run = *served;
  fmt::print(
      out,
      "prefill {} tok in {:.3f} s | decode {} tok in {:.3f} s ({:.2f} tok/s) | TTFT {:.3f} s\n",
      run.prefill_tokens, run.prefill_seconds, run.decode_tokens, run.decode_seconds,
      decode_tok_per_s(run), run.ttft_seconds);
}

// ---- JSON ------------------------------------------------------------------------------------

void write_profile_json(const std::filesystem::path& path, const std::vector<RankReport>& reports,
                        const RunSummary& run) {
  using Json = nlohmann::ordered_json;
  Json doc;
  doc["run"] = {
      {"prefill_tokens", run.prefill_tokens}, {"prefill_seconds", run.prefill_seconds},
      {"decode_tokens", run.decode_tokens},   {"decode_seconds", run.decode_seconds},
      {"ttft_seconds", run.ttft_seconds},     {"decode_tok_per_s", decode_tok_per_s(run)}};
  Json ranks = Json::array();
  for (const RankReport& r : reports) {
    Json to_rank = Json::object();
    for (const auto& [peer, bytes] : r.bytes_to_rank) to_rank[std::to_string(peer)] = bytes;
    Json replies = Json::object();
    for (const auto& [peer, us] : r.reply_us) replies[std::to_string(peer)] = us;
    Json phases = Json::object();
    for (int p = 0; p < kPhaseCount; ++p) phases[phase_name(Phase(p))] = r.phase_us[size_t(p)];
    Json layers = Json::array();
    for (size_t l = 0; l < r.layer_phase_us.size(); ++l) {
      Json layer = {{"layer", l}};
      for (int p = 0; p < kPhaseCount; ++p) {
        const double us = r.layer_phase_us[l][size_t(p)];
        if (us != 0) layer[phase_name(Phase(p))] = us;
      }
      if (l < r.layer_exchanges.size() && r.layer_exchanges[l].exchanges > 0) {
        const LayerExchange& e = r.layer_exchanges[l];
        Json last = Json::object(), reply = Json::object(), rows = Json::object();
        for (const auto& [peer, n] : e.last) last[std::to_string(peer)] = n;
        for (const auto& [peer, us] : e.reply_us) reply[std::to_string(peer)] = us;
        for (const auto& [peer, n] : e.rows) rows[std::to_string(peer)] = n;
        layer["exchanges"] = e.exchanges;
        layer["last_reply_count"] = std::move(last);
        layer["tied_exchanges"] = e.ties;
        layer["last_margin_us"] = e.last_margin_us;
        layer["reply_us"] = std::move(reply);
        layer["rows_to_rank"] = std::move(rows);
      }
      layers.push_back(std::move(layer));
    }
    ranks.push_back({{"rank", r.rank},
                     {"host", r.host},
                     {"role", r.role},
                     {"wall_us", r.wall_us},
                     {"busy_pct", percent(busy_us(r), r.wall_us)},
                     {"wait_pct", percent(wait_us(r), r.wall_us)},
                     {"rows", r.rows},
                     {"experts", r.experts},
                     {"bytes_in", r.bytes_in},
                     {"bytes_out", r.bytes_out},
                     {"bytes_to_rank", std::move(to_rank)},
                     {"reply_us", std::move(replies)},
                     {"slowest_count", r.slowest_count},
                     {"weight_bytes_read", r.weight_bytes_read},
                     {"pinned_hits", r.store.pinned_hits},
                     {"ram_hits", r.store.ram_hits},
                     {"disk_hits", r.store.disk_hits},
                     {"disk_bytes_read", r.store.disk_bytes_read},
                     {"loader_us", r.store.loader_us},
                     {"loader_wait_us", r.store.loader_wait_us},
                     {"hint_reads", r.store.hint_reads},
                     {"hint_hits", r.store.hint_hits},
                     {"waits", r.store.waits},
                     {"vram_bytes", r.device.vram_bytes},
                     {"gpu_requests", r.device.gpu_requests},
                     {"gpu_us", r.device.gpu_us},
                     {"bytes_cross_host", r.bytes_cross_host},
                     {"bytes_shared", r.bytes_shared},
                     {"vram_hits", r.device.vram_hits},
                     {"vram_uploads", r.device.vram_uploads},
                     {"vram_cpu_experts", r.device.vram_cpu_experts},
                     {"vram_evictions", r.device.vram_evictions},
                     {"vram_upload_bytes", r.device.vram_upload_bytes},
                     {"vram_upload_us", r.device.vram_upload_us},
                     {"trace_events", r.events.size()},
                     {"dropped_events", r.dropped_events},
                     {"phases_us", std::move(phases)},
                     {"layers", std::move(layers)}});
  }
  doc["ranks"] = std::move(ranks);
  const std::string text = doc.dump(1, ' ', false, Json::error_handler_t::replace) + "\n";
  write_file_atomically(path,
                        [&](std::FILE* file) { std::fwrite(text.data(), 1, text.size(), file); });
}

// ---- Chrome trace ----------------------------------------------------------------------------

void write_trace(const std::filesystem::path& path, const std::vector<RankReport>& reports) {
  // Reports come over the wire: check them before a byte is written.
  for (const RankReport& r : reports) {
    for (size_t i = 0; i < r.events.size(); ++i) {
      const TraceEvent& e = r.events[i];
      if (e.phase < 0 || e.phase >= kPhaseCount)
        fail("{}: rank {} trace event {} has phase {} (expected 0..{})", path.string(), r.rank, i,
             e.phase, kPhaseCount - 1);
      if (!std::isfinite(e.start_us) || !std::isfinite(e.duration_us) || e.duration_us < 0)
        fail("{}: rank {} trace event {} has start {} us, duration {} us", path.string(), r.rank, i,
             e.start_us, e.duration_us);
    }
  }
  // Streamed rather than built as one nlohmann document: a rank may hold millions of events.
  write_file_atomically(path, [&](std::FILE* file) {
    fmt::print(file, "{{\"displayTimeUnit\":\"ms\",\"traceEvents\":[");
    bool first = true;
    auto separator = [&] {
      const char* sep = first ? "\n" : ",\n";
      first = false;
      return sep;
    };
    for (const RankReport& r : reports) {
      const std::string name = fmt::format("rank {} ({})@{}", r.rank, r.role, r.host);
      fmt::print(file,
                 "{}{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{},\"tid\":0,"
                 "\"args\":{{\"name\":{}}}}}",
                 separator(), r.rank, json_string(name));
    }
    for (const RankReport& r : reports) {
      for (const TraceEvent& e : r.events) {
        fmt::print(file,
                   "{}{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"pid\":{},\"tid\":0,"
                   "\"ts\":{:.3f},\"dur\":{:.3f},\"args\":{{\"layer\":{}}}}}",
                   separator(), phase_name(Phase(e.phase)), e.layer >= 0 ? "layer" : "run", r.rank,
                   e.start_us, e.duration_us, e.layer);
      }
    }
    fmt::print(file, "\n]}}\n");
  });
}

}  // namespace colibri
