#include "coordinator/serve_metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace colibri {

void Histogram::observe(double value) {
  const size_t i =
      size_t(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name,
                     sum_, name, count_);
}

double Histogram::quantile(const std::vector<uint64_t>& counts, double q) const {
  uint64_t total = 0;
  for (uint64_t c : counts) total += c;
  if (total == 0 || counts.size() != counts_.size()) return 0;
  const double rank = q * double(total);
  uint64_t below = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (double(below + counts[i]) >= rank && counts[i] > 0) {
      if (i == bounds_.size()) return bounds_.empty() ? 0 : bounds_.back();  // +Inf bucket
      const double lower = i == 0 ? 0 : bounds_[i - 1];
      return lower + (bounds_[i] - lower) * (rank - double(below)) / double(counts[i]);
    }
    below += counts[i];
  }
  return bounds_.empty() ? 0 : bounds_.back();
}

namespace {

std::vector<uint64_t> minus(const std::vector<uint64_t>& now, const std::vector<uint64_t>& then) {
  std::vector<uint64_t> d(now);
  for (size_t i = 0; i < d.size() && i < then.size(); ++i) d[i] -= then[i];
  return d;
}

std::vector<double> latency_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.15, 0.2,
          0.3,   0.4,    0.5,   0.75, 1.0,  2.5,  5.0,  10.0, 20.0, 40.0, 80.0};
}

}  // namespace

ServeMetrics::Data::Data()
    : ttft_(latency_bounds()),
      itl_(latency_bounds()),
      e2e_(latency_bounds()),
      queue_(latency_bounds()),
      step_rows_({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}),
      step_seconds_(latency_bounds()),
      chunk_rows_({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}),
      view_(std::make_shared<const EngineView>()) {}

ServeMetrics::ServeMetrics() = default;

ServeMetrics::Data ServeMetrics::snapshot() const {
  std::lock_guard lock(mutex_);
  return d_;
}

void ServeMetrics::count_response(int status) {
  std::lock_guard lock(mutex_);
  ++d_.responses_[status];
}
void ServeMetrics::count_finished(const std::string& reason) {
  std::lock_guard lock(mutex_);
  ++d_.finished_[reason];
}
void ServeMetrics::add_prompt_tokens(uint64_t n, uint64_t cached) {
  std::lock_guard lock(mutex_);
  d_.prompt_tokens_ += n;
  d_.cached_prompt_tokens_ += cached;
}
void ServeMetrics::add_generated_tokens(uint64_t n) {
  std::lock_guard lock(mutex_);
  d_.generated_tokens_ += n;
}
void ServeMetrics::prefix_query(bool hit) {
  std::lock_guard lock(mutex_);
  ++d_.prefix_queries_;
  d_.prefix_hits_ += hit ? 1 : 0;
}
void ServeMetrics::observe_ttft(double s) {
  std::lock_guard lock(mutex_);
  d_.ttft_.observe(s);
}
void ServeMetrics::observe_itl(double s) {
  std::lock_guard lock(mutex_);
  d_.itl_.observe(s);
}
void ServeMetrics::observe_e2e(double s) {
  std::lock_guard lock(mutex_);
  d_.e2e_.observe(s);
}
void ServeMetrics::observe_queue(double s) {
  std::lock_guard lock(mutex_);
  d_.queue_.observe(s);
}
void ServeMetrics::observe_step(int rows, double s) {
  std::lock_guard lock(mutex_);
  ++d_.steps_;
  d_.step_rows_.observe(rows);
  d_.step_seconds_.observe(s);
}
void ServeMetrics::observe_prefill_chunk(int prompt_rows, bool cut, bool over_bound) {
  std::lock_guard lock(mutex_);
  d_.chunk_rows_.observe(prompt_rows);
  d_.chunks_cut_ += cut ? 1 : 0;
  d_.chunks_over_bound_ += over_bound ? 1 : 0;
}
void ServeMetrics::set_step_cost(const StepCostMetrics& step_cost) {
  std::lock_guard lock(mutex_);
  d_.step_cost_ = step_cost;
}
void ServeMetrics::set_gauges(const ServeGauges& gauges) {
  std::lock_guard lock(mutex_);
  d_.gauges_ = gauges;
  sample_series();
}

void ServeMetrics::sample_series() {
  const auto now = std::chrono::steady_clock::now();
  const double dt = std::chrono::duration<double>(now - last_sample_).count();
  if (dt < 1.0) return;
  SeriesPoint p;
  p.t_s = std::chrono::duration<double>(now - d_.started_).count();
  p.generated_tok_per_s = double(d_.generated_tokens_ - last_generated_) / dt;
  p.prompt_tok_per_s = double(d_.prompt_tokens_ - last_prompt_) / dt;
  p.running = d_.gauges_.running;
  p.waiting = d_.gauges_.waiting;
  p.kv_usage = d_.gauges_.kv_blocks_total
                   ? double(d_.gauges_.kv_blocks_total - d_.gauges_.kv_blocks_free) /
                         d_.gauges_.kv_blocks_total
                   : 0.0;
  const std::vector<uint64_t> ttft = minus(d_.ttft_.counts(), last_ttft_);
  const std::vector<uint64_t> itl = minus(d_.itl_.counts(), last_itl_);
  p.ttft_p50_s = d_.ttft_.quantile(ttft, 0.5);
  p.ttft_p95_s = d_.ttft_.quantile(ttft, 0.95);
  p.itl_p50_s = d_.itl_.quantile(itl, 0.5);
  p.itl_p95_s = d_.itl_.quantile(itl, 0.95);
  p.itl_p99_s = d_.itl_.quantile(itl, 0.99);
  for (uint64_t c : itl) p.itl_count += c;
  d_.series_.push_back(p);
  if (d_.series_.size() > kSeriesPoints) d_.series_.pop_front();
  last_sample_ = now;
  last_generated_ = d_.generated_tokens_;
  last_prompt_ = d_.prompt_tokens_;
  last_ttft_ = d_.ttft_.counts();
  last_itl_ = d_.itl_.counts();
}
void ServeMetrics::set_phases(const std::array<double, kPhaseCount>& phase_us) {
  std::lock_guard lock(mutex_);
  d_.phase_us_ = phase_us;
}
void ServeMetrics::set_rank_replies(const std::map<int, double>& reply_us) {
  std::lock_guard lock(mutex_);
  d_.reply_us_ = reply_us;
}
void ServeMetrics::set_placement(const PlacementMetrics& placement) {
  std::lock_guard lock(mutex_);
  d_.placement_ = placement;
}

void ServeMetrics::set_engine_view(EngineView view) {
  std::shared_ptr<const EngineView> old = std::make_shared<const EngineView>(std::move(view));
  std::lock_guard lock(mutex_);
  d_.view_.swap(old);  // the old view is freed after the lock, by `old`
}
void ServeMetrics::set_live_counters(std::vector<LiveCounters> counters, double poll_s) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(mutex_);
  d_.live_.swap(counters);  // the old ones are freed after the lock
  d_.live_at_s_ = std::chrono::duration<double>(now - d_.started_).count();
  ++d_.live_polls_;
  d_.live_poll_s_ += poll_s;
}
void ServeMetrics::set_cluster(std::string model, std::vector<RankInfo> ranks) {
  std::lock_guard lock(mutex_);
  d_.model_ = std::move(model);
  d_.ranks_ = std::move(ranks);
}

void ServeMetrics::set_kv_cache_dir(const KvCacheDirMetrics& kv_cache_dir) {
  std::lock_guard lock(mutex_);
  d_.kv_cache_dir_ = kv_cache_dir;
}

ServeGauges ServeMetrics::gauges() const {
  std::lock_guard lock(mutex_);
  return d_.gauges_;
}

std::string ServeMetrics::render() const {
  const Data d = snapshot();
  std::string out;
  const auto metric = [&](const char* name, const char* type, const char* help, auto value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, value);
  };
  out +=
      "# HELP colibri_http_responses_total HTTP responses by status code\n"
      "# TYPE colibri_http_responses_total counter\n";
  for (const auto& [status, n] : d.responses_)
    out += fmt::format("colibri_http_responses_total{{status=\"{}\"}} {}\n", status, n);
  out +=
      "# HELP colibri_request_finished_total generation requests by how they ended\n"
      "# TYPE colibri_request_finished_total counter\n";
  for (const char* reason : {"stop", "length", "error", "cancelled"}) {
    const auto it = d.finished_.find(reason);
    out += fmt::format("colibri_request_finished_total{{finished_reason=\"{}\"}} {}\n", reason,
                       it == d.finished_.end() ? 0 : it->second);
  }
  metric("colibri_ready", "gauge", "1 once the weights are loaded and one forward has run",
         d.gauges_.ready ? 1 : 0);
  metric("colibri_num_requests_waiting", "gauge", "requests in the queue", d.gauges_.waiting);
  metric("colibri_num_requests_running", "gauge", "sequences prefilling or decoding",
         d.gauges_.running);
  metric("colibri_kv_blocks_total", "gauge", "KV pool blocks", d.gauges_.kv_blocks_total);
  metric("colibri_kv_blocks_free", "gauge", "KV pool blocks free", d.gauges_.kv_blocks_free);
  metric("colibri_kv_blocks_running", "gauge", "KV blocks held by running sequences",
         d.gauges_.kv_blocks_running);
  metric("colibri_kv_blocks_cached", "gauge",
         "KV blocks held by finished conversations kept for prefix reuse",
         d.gauges_.kv_blocks_cached);
  metric("colibri_prefix_cache_sequences", "gauge", "finished conversations kept for prefix reuse",
         d.gauges_.cached_sequences);
  metric("colibri_kv_cache_usage_perc", "gauge", "fraction of KV blocks in use",
         d.gauges_.kv_blocks_total ? double(d.gauges_.kv_blocks_total - d.gauges_.kv_blocks_free) /
                                         d.gauges_.kv_blocks_total
                                   : 0.0);
  metric("colibri_prompt_tokens_total", "counter", "prompt tokens of admitted requests",
         d.prompt_tokens_);
  metric("colibri_prompt_tokens_cached_total", "counter",
         "prompt tokens whose KV was reused from the prefix cache or loaded from --kv-cache-dir",
         d.cached_prompt_tokens_);
  metric("colibri_generation_tokens_total", "counter", "generated tokens", d.generated_tokens_);
  metric("colibri_prefix_cache_queries_total", "counter",
         "admissions that looked up the prefix cache", d.prefix_queries_);
  metric("colibri_prefix_cache_hits_total", "counter", "admissions that reused cached KV blocks",
         d.prefix_hits_);
  if (d.kv_cache_dir_.enabled) {
    const KvCacheDirMetrics& k = d.kv_cache_dir_;
    metric("colibri_kv_cache_dir_hits_total", "counter",
           "admissions that loaded a prompt prefix from --kv-cache-dir", k.loads);
    metric("colibri_kv_cache_dir_prompt_tokens_total", "counter",
           "prompt tokens whose KV was loaded from --kv-cache-dir", k.tokens_loaded);
    metric("colibri_kv_cache_dir_load_seconds_total", "counter",
           "engine-thread time spent loading prefixes from --kv-cache-dir", k.load_seconds);
    metric("colibri_kv_cache_dir_files_written_total", "counter",
           "prefix files written to --kv-cache-dir", k.files_written);
    metric("colibri_kv_cache_dir_bytes_written_total", "counter",
           "bytes of prefix files written to --kv-cache-dir", k.bytes_written);
    metric("colibri_kv_cache_dir_files_refused_total", "counter",
           "files of --kv-cache-dir not used: another model or shape, truncated or damaged",
           k.files_refused);
    metric("colibri_kv_cache_dir_files_evicted_total", "counter",
           "prefix files removed for --kv-cache-dir-gb", k.files_evicted);
    metric("colibri_kv_cache_dir_writes_failed_total", "counter",
           "prefix files not written (an I/O error, or the writer too far behind)",
           k.writes_failed);
    metric("colibri_kv_cache_dir_files", "gauge", "prefix files in --kv-cache-dir", k.files);
    metric("colibri_kv_cache_dir_bytes", "gauge", "bytes of prefix files in --kv-cache-dir",
           k.bytes);
  }
  metric("colibri_engine_steps_total", "counter", "forward calls of the scheduler", d.steps_);
  d.ttft_.render(out, "colibri_time_to_first_token_seconds",
                 "queue + prefill until the first token");
  d.itl_.render(out, "colibri_time_per_output_token_seconds", "inter-token latency");
  d.e2e_.render(out, "colibri_e2e_request_latency_seconds", "arrival to the last token");
  d.queue_.render(out, "colibri_request_queue_time_seconds", "arrival to admission");
  d.step_rows_.render(out, "colibri_iteration_tokens", "rows per forward call");
  d.step_seconds_.render(out, "colibri_iteration_seconds", "time of one forward call");
  d.chunk_rows_.render(out, "colibri_prefill_chunk_tokens",
                       "prompt rows per forward call that carried prompt rows");
  metric("colibri_prefill_chunks_cut_total", "counter",
         "forward calls whose prompt rows --max-itl-ms cut below --max-batch-tokens",
         d.chunks_cut_);
  metric("colibri_prefill_chunks_over_bound_total", "counter",
         "of those, calls predicted beyond --max-itl-ms even with the least prompt rows "
         "(--max-batch-tokens / 16): the bound is below what the machine can do",
         d.chunks_over_bound_);
  metric("colibri_prefill_itl_bound_seconds", "gauge",
         "--max-itl-ms: bound on a call's predicted time while sequences decode (0: off)",
         d.step_cost_.itl_bound_s);
  const StepCostMetrics& cost = d.step_cost_;
  metric("colibri_step_cost_fixed_seconds", "gauge", "step-cost model: seconds per forward call",
         cost.fixed_s);
  metric("colibri_step_cost_row_seconds", "gauge", "step-cost model: seconds per row", cost.row_s);
  metric("colibri_step_cost_kilokey_seconds", "gauge",
         "step-cost model: seconds per thousand keys the rows attend to", cost.kilo_key_s);
  metric("colibri_step_cost_observations", "gauge",
         "step-cost model: timed forward calls it is fitted to", cost.observations);
  metric("colibri_step_cost_mean_abs_error_seconds", "gauge",
         "step-cost model: mean absolute error of the fit over those calls", cost.mean_abs_error_s);
  metric("colibri_step_cost_decode_seconds", "gauge",
         "step-cost model: predicted time of a call of the running sequences' decode rows alone",
         cost.decode_s);
  out +=
      "# HELP colibri_coordinator_phase_seconds_total coordinator time per phase "
      "(wait_slowest: waiting for the expert ranks' partials)\n"
      "# TYPE colibri_coordinator_phase_seconds_total counter\n";
  for (int p = 0; p < int(Phase::kRecvWait); ++p)
    out += fmt::format("colibri_coordinator_phase_seconds_total{{phase=\"{}\"}} {}\n",
                       phase_name(Phase(p)), d.phase_us_[size_t(p)] * 1e-6);
  out +=
      "# HELP colibri_expert_rank_reply_seconds_total per expert rank, time from the end of "
      "dispatch until its partial arrived (its compute plus transfer), summed over exchanges\n"
      "# TYPE colibri_expert_rank_reply_seconds_total counter\n";
  for (const auto& [rank, us] : d.reply_us_)
    out +=
        fmt::format("colibri_expert_rank_reply_seconds_total{{rank=\"{}\"}} {}\n", rank, us * 1e-6);
  // Each rank's own counters, as it last answered (the scheduler asks about once a second).
  const auto per_rank = [&](const char* name, const char* type, const char* help, auto value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    for (const LiveCounters& c : d.live_)
      out += fmt::format("{}{{rank=\"{}\"}} {}\n", name, c.rank, value(c));
  };
  if (d.live_polls_ > 0) {
    metric("colibri_rank_counters_polls_total", "counter",
           "times the scheduler asked the ranks for their own counters (between steps)",
           d.live_polls_);
    metric("colibri_rank_counters_poll_seconds_total", "counter",
           "time those polls held the scheduler (one round trip to every expert rank each)",
           d.live_poll_s_);
  }
  if (!d.live_.empty()) {
    per_rank("colibri_rank_busy_seconds_total", "counter",
             "per rank, its own busy time (expert ranks: compute and send), as it last answered",
             [](const LiveCounters& c) { return c.busy_us * 1e-6; });
    per_rank("colibri_rank_wait_seconds_total", "counter",
             "per rank, its own time waiting for a request, as it last answered",
             [](const LiveCounters& c) { return c.wait_us * 1e-6; });
    per_rank("colibri_rank_pairs_total", "counter",
             "per rank, (row, expert) pairs it computed, as it last answered",
             [](const LiveCounters& c) { return c.experts; });
    out +=
        "# HELP colibri_rank_tier_hits_total per rank and tier, expert uses served from that "
        "tier (pinned, ram, disk: read for it; vram), as it last answered\n"
        "# TYPE colibri_rank_tier_hits_total counter\n";
    for (const LiveCounters& c : d.live_) {
      const std::pair<const char*, uint64_t> tiers[] = {{"pinned", c.store.pinned_hits},
                                                        {"ram", c.store.ram_hits},
                                                        {"disk", c.store.disk_hits},
                                                        {"vram", c.device.vram_hits}};
      for (const auto& [tier, n] : tiers)
        out += fmt::format("colibri_rank_tier_hits_total{{rank=\"{}\",tier=\"{}\"}} {}\n", c.rank,
                           tier, n);
    }
    per_rank("colibri_rank_disk_read_bytes_total", "counter",
             "per rank, expert bytes read from disk after start-up, as it last answered",
             [](const LiveCounters& c) { return c.store.disk_bytes_read; });
    per_rank("colibri_rank_load_wait_seconds_total", "counter",
             "per rank, time its expert uses waited for reads from disk, as it last answered",
             [](const LiveCounters& c) { return double(c.store.loader_wait_us) * 1e-6; });
    per_rank("colibri_rank_vram_uploads_total", "counter",
             "per GPU expert rank, experts uploaded to VRAM on a miss, as it last answered",
             [](const LiveCounters& c) { return c.device.vram_uploads; });
    per_rank("colibri_rank_vram_upload_bytes_total", "counter",
             "per GPU expert rank, bytes of those uploads, as it last answered",
             [](const LiveCounters& c) { return c.device.vram_upload_bytes; });
  }
  // A counter per MoE layer that had exchanges, value(layer's record).
  const std::vector<LayerExchange>& layers = d.view_->layer_exchanges;
  const auto per_layer = [&](const char* name, const char* help, auto value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} counter\n", name, help, name);
    for (size_t l = 0; l < layers.size(); ++l)
      if (layers[l].exchanges > 0)
        out += fmt::format("{}{{layer=\"{}\"}} {}\n", name, l, value(layers[l]));
  };
  per_layer("colibri_layer_exchanges_total", "per MoE layer, exchanges with the expert ranks",
            [](const LayerExchange& e) { return e.exchanges; });
  out +=
      "# HELP colibri_layer_last_reply_total per MoE layer and owner rank, exchanges whose last "
      "partial was that rank's (the layer's critical path)\n"
      "# TYPE colibri_layer_last_reply_total counter\n";
  for (size_t l = 0; l < layers.size(); ++l)
    for (const auto& [rank, n] : layers[l].last)
      out += fmt::format("colibri_layer_last_reply_total{{layer=\"{}\",rank=\"{}\"}} {}\n", l, rank,
                         n);
  per_layer("colibri_layer_tied_exchanges_total",
            "per MoE layer, exchanges whose last partials arrived together (no owner was the "
            "slowest)",
            [](const LayerExchange& e) { return e.ties; });
  per_layer("colibri_layer_last_margin_seconds_total",
            "per MoE layer, how much later the last partial arrived than the one before it, "
            "summed over exchanges",
            [](const LayerExchange& e) { return e.last_margin_us * 1e-6; });
  const PlacementMetrics& p = d.placement_;
  metric("colibri_placement_epoch", "gauge", "changes of placement committed while running",
         p.epoch);
  out +=
      "# HELP colibri_routed_pairs_total (row, expert) pairs dispatched to each owner rank\n"
      "# TYPE colibri_routed_pairs_total counter\n";
  for (const auto& [rank, n] : p.pairs_to_rank)
    out += fmt::format("colibri_routed_pairs_total{{rank=\"{}\"}} {}\n", rank, n);
  metric("colibri_replica_pairs_total", "counter",
         "pairs sent to a replica rather than the expert's first owner", p.replica_pairs);
  if (p.repin) {
    metric("colibri_repin_rounds_total", "counter", "re-placement rounds (--repin-every)",
           p.repin_rounds);
    metric("colibri_repin_changes_total", "counter", "rounds that moved experts", p.repin_changes);
    metric("colibri_repin_moves_total", "counter", "(layer, expert) holder changes committed",
           p.repin_moves);
    metric("colibri_repin_seconds_total", "counter", "coordinator time spent on rounds",
           p.repin_seconds);
  }
  if (p.prefetch) {
    metric("colibri_prefetch_pairs_total", "counter",
           "routed pairs of layers the layer before predicted (every step with --prefetch-ahead, "
           "else one step in 16)",
           p.prefetch_pairs);
    metric("colibri_prefetch_pair_hits_total", "counter", "of those, predicted for their row",
           p.prefetch_pair_hits);
    metric("colibri_prefetch_hinted_experts_total", "counter", "distinct experts hinted per step",
           p.prefetch_hinted);
    metric("colibri_prefetch_hinted_hits_total", "counter", "of those, routed",
           p.prefetch_hinted_hits);
  }
  return out;
}

}  // namespace colibri
