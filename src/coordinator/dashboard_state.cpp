// ServeMetrics::dashboard_state: the JSON behind /dashboard (docs/DASHBOARD.md), from the same
// members that render() writes as /metrics.
#include <nlohmann/json.hpp>

#include "coordinator/serve_metrics.h"

namespace colibri {
namespace {

using Json = nlohmann::ordered_json;

Json histogram_json(const Histogram& h) {
  return {{"count", h.count()},
          {"sum_s", h.sum()},
          {"p50_s", h.quantile(h.counts(), 0.5)},
          {"p95_s", h.quantile(h.counts(), 0.95)},
          {"p99_s", h.quantile(h.counts(), 0.99)}};
}

template <class Map>
Json by_rank(const Map& map) {
  Json out = Json::object();
  for (const auto& [rank, value] : map) out[std::to_string(rank)] = value;
  return out;
}

Json seconds_by_rank(const std::map<int, double>& us) {
  Json out = Json::object();
  for (const auto& [rank, value] : us) out[std::to_string(rank)] = value * 1e-6;
  return out;
}

// A rank's own counters as it last answered (/metrics' colibri_rank_* lines); null when it did
// not (no poll yet, or a transport that cannot ask).
Json own_counters(const std::vector<LiveCounters>& live, int rank) {
  for (const LiveCounters& c : live) {
    if (c.rank != rank) continue;
    const StoreCounters& s = c.store;
    const DeviceCounters& g = c.device;
    return {{"wall_s", c.wall_us * 1e-6},
            {"busy_s", c.busy_us * 1e-6},
            {"wait_s", c.wait_us * 1e-6},
            {"rows", c.rows},
            {"pairs", c.experts},
            {"bytes_in", c.bytes_in},
            {"bytes_out", c.bytes_out},
            {"tier_hits",
             {{"pinned", s.pinned_hits},
              {"ram", s.ram_hits},
              {"disk", s.disk_hits},
              {"vram", g.vram_hits}}},
            {"disk_read_bytes", s.disk_bytes_read},
            {"load_wait_s", double(s.loader_wait_us) * 1e-6},
            {"hint_reads", s.hint_reads},
            {"hint_hits", s.hint_hits},
            {"vram_uploads", g.vram_uploads},
            {"vram_upload_bytes", g.vram_upload_bytes},
            {"vram_cpu_experts", g.vram_cpu_experts},
            {"gpu_s", double(g.gpu_us) * 1e-6}};
  }
  return nullptr;
}

}  // namespace

std::string ServeMetrics::dashboard_state() const {
  const Data d = snapshot();
  const EngineView& view = *d.view_;
  Json doc;
  doc["schema"] = "colibri-dashboard";
  doc["version"] = kDashboardVersion;
  doc["uptime_s"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - d.started_).count();
  doc["model"] = d.model_;
  doc["ready"] = d.gauges_.ready;

  Json responses = Json::object(), finished = Json::object();
  for (const auto& [status, n] : d.responses_) responses[std::to_string(status)] = n;
  for (const char* reason : {"stop", "length", "error", "cancelled"}) {
    const auto it = d.finished_.find(reason);
    finished[reason] = it == d.finished_.end() ? 0 : it->second;
  }
  doc["requests"] = {{"running", d.gauges_.running},
                     {"waiting", d.gauges_.waiting},
                     {"finished", std::move(finished)},
                     {"responses", std::move(responses)}};
  doc["tokens"] = {{"prompt", d.prompt_tokens_},
                   {"prompt_cached", d.cached_prompt_tokens_},
                   {"generated", d.generated_tokens_}};
  doc["kv"] = {{"blocks_total", d.gauges_.kv_blocks_total},
               {"blocks_free", d.gauges_.kv_blocks_free},
               {"blocks_running", d.gauges_.kv_blocks_running},
               {"blocks_cached", d.gauges_.kv_blocks_cached},
               {"cached_sequences", d.gauges_.cached_sequences},
               {"usage", d.gauges_.kv_blocks_total
                             ? double(d.gauges_.kv_blocks_total - d.gauges_.kv_blocks_free) /
                                   d.gauges_.kv_blocks_total
                             : 0.0}};
  doc["prefix_cache"] = {{"queries", d.prefix_queries_}, {"hits", d.prefix_hits_}};
  doc["engine"] = {{"steps", d.steps_},
                   {"step_seconds", histogram_json(d.step_seconds_)},
                   {"step_rows_sum", d.step_rows_.sum()},
                   {"step_cost",
                    {{"fixed_s", d.step_cost_.fixed_s},
                     {"row_s", d.step_cost_.row_s},
                     {"kilo_key_s", d.step_cost_.kilo_key_s},
                     {"observations", d.step_cost_.observations},
                     {"mean_abs_error_s", d.step_cost_.mean_abs_error_s},
                     {"decode_s", d.step_cost_.decode_s}}},
                   {"prefill",
                    {{"itl_bound_s", d.step_cost_.itl_bound_s},
                     {"chunks", d.chunk_rows_.count()},
                     {"chunk_tokens_sum", d.chunk_rows_.sum()},
                     {"chunks_cut", d.chunks_cut_},
                     {"chunks_over_bound", d.chunks_over_bound_}}}};
  doc["latency"] = {{"ttft", histogram_json(d.ttft_)},
                    {"itl", histogram_json(d.itl_)},
                    {"e2e", histogram_json(d.e2e_)},
                    {"queue", histogram_json(d.queue_)}};
  Json series = Json::array();
  for (const SeriesPoint& p : d.series_)
    series.push_back({{"t_s", p.t_s},
                      {"generated_tok_per_s", p.generated_tok_per_s},
                      {"prompt_tok_per_s", p.prompt_tok_per_s},
                      {"running", p.running},
                      {"waiting", p.waiting},
                      {"kv_usage", p.kv_usage},
                      {"ttft_p50_s", p.ttft_p50_s},
                      {"ttft_p95_s", p.ttft_p95_s},
                      {"itl_p50_s", p.itl_p50_s},
                      {"itl_p95_s", p.itl_p95_s},
                      {"itl_p99_s", p.itl_p99_s},
                      {"itl_count", p.itl_count}});
  doc["series"] = std::move(series);

  // The coordinator: its phases (per step, live) and the engine view's busy and wait.
  Json phases = Json::object();
  for (int p = 0; p < kPhaseCount; ++p)
    if (d.phase_us_[size_t(p)] != 0) phases[phase_name(Phase(p))] = d.phase_us_[size_t(p)] * 1e-6;
  const LiveCounters& c = view.coordinator;
  doc["coordinator"] = {{"wall_s", c.wall_us * 1e-6},    {"busy_s", c.busy_us * 1e-6},
                        {"wait_s", c.wait_us * 1e-6},    {"rows_dispatched", c.rows},
                        {"pairs_dispatched", c.experts}, {"bytes_out", c.bytes_out},
                        {"bytes_in", c.bytes_in},        {"phases_s", std::move(phases)}};

  // Every rank of the layout, with what the coordinator saw of it.
  std::map<int, uint64_t> last_total, rows_total;
  for (const LayerExchange& e : view.layer_exchanges) {
    for (const auto& [rank, n] : e.last) last_total[rank] += n;
    for (const auto& [rank, n] : e.rows) rows_total[rank] += n;
  }
  Json ranks = Json::array();
  for (const RankInfo& info : d.ranks_) {
    const auto get = [&](const auto& map) -> Json {
      const auto it = map.find(info.rank);
      return it == map.end() ? Json(0) : Json(it->second);
    };
    const auto reply = d.reply_us_.find(info.rank);
    ranks.push_back({{"rank", info.rank},
                     {"host", info.host},
                     {"role", info.role},
                     {"tier", info.tier},
                     {"reply_s", reply == d.reply_us_.end() ? 0.0 : reply->second * 1e-6},
                     {"rows", get(rows_total)},
                     {"pairs", get(d.placement_.pairs_to_rank)},
                     {"bytes_to", get(view.bytes_to_rank)},
                     {"last_replies", get(last_total)},
                     {"experts_owned", view.placement ? view.placement->count_owned(info.rank) : 0},
                     {"own", own_counters(d.live_, info.rank)}});
  }
  doc["ranks"] = std::move(ranks);
  doc["own_counters_at_s"] = d.live_at_s_ < 0 ? Json(nullptr) : Json(d.live_at_s_);

  // Per layer: the coordinator's time in it and, for MoE layers, the exchange's critical path.
  Json layers = Json::array();
  for (size_t l = 0; l < view.layer_phase_us.size(); ++l) {
    const auto& phase = view.layer_phase_us[l];
    Json layer = {{"layer", l},
                  {"attention_s", phase[size_t(Phase::kAttention)] * 1e-6},
                  {"dispatch_s", phase[size_t(Phase::kDispatch)] * 1e-6},
                  {"wait_s", phase[size_t(Phase::kWaitSlowest)] * 1e-6},
                  {"combine_s", phase[size_t(Phase::kCombine)] * 1e-6}};
    if (l < view.layer_exchanges.size() && view.layer_exchanges[l].exchanges > 0) {
      const LayerExchange& e = view.layer_exchanges[l];
      int slowest = -1;
      uint64_t most = 0;
      for (const auto& [rank, n] : e.last)
        if (n > most) most = n, slowest = rank;
      layer["exchanges"] = e.exchanges;
      layer["slowest_rank"] = slowest;
      layer["tied"] = e.ties;
      layer["last_margin_s"] = e.last_margin_us * 1e-6;
      layer["last_replies"] = by_rank(e.last);
      layer["reply_s"] = seconds_by_rank(e.reply_us);
      layer["rows"] = by_rank(e.rows);
    }
    layers.push_back(std::move(layer));
  }
  doc["layers"] = std::move(layers);

  // The heat map: owner and replicas from the placement, routed rows from the engine's routes.
  Json experts = {{"layers", view.routes.num_layers}, {"experts", view.routes.num_experts}};
  if (const PlacementTable* t = view.placement.get()) {
    experts["policy"] = t->policy;
    experts["epoch"] = t->epoch;
    Json owner = Json::array(), replicas = Json::array();
    for (int l = 0; l < t->num_layers; ++l) {
      Json row = Json::array(), copies = Json::array();
      for (int e = 0; e < t->num_experts; ++e) {
        row.push_back(t->owner_of(l, e));
        if (!t->replicas.empty()) copies.push_back(t->replicas_of(l, e));
      }
      owner.push_back(std::move(row));
      if (!t->replicas.empty()) replicas.push_back(std::move(copies));
    }
    experts["owner"] = std::move(owner);
    experts["replicas"] = t->replicas.empty() ? Json(nullptr) : std::move(replicas);
  }
  Json routed = Json::array();
  for (int l = 0; l < view.routes.num_layers; ++l) {
    Json row = Json::array();
    for (int e = 0; e < view.routes.num_experts; ++e) row.push_back(view.routes.at(l, e));
    routed.push_back(std::move(row));
  }
  experts["routed_rows"] = std::move(routed);
  experts["tokens"] = view.routes.tokens;
  doc["experts"] = std::move(experts);

  const PlacementMetrics& p = d.placement_;
  doc["placement"] = {{"epoch", p.epoch},
                      {"pairs_to_rank", by_rank(p.pairs_to_rank)},
                      {"replica_pairs", p.replica_pairs},
                      {"repin", p.repin ? Json{{"rounds", p.repin_rounds},
                                               {"changes", p.repin_changes},
                                               {"moves", p.repin_moves},
                                               {"seconds", p.repin_seconds}}
                                        : Json(nullptr)},
                      {"prefetch", p.prefetch ? Json{{"pairs", p.prefetch_pairs},
                                                     {"pair_hits", p.prefetch_pair_hits},
                                                     {"hinted", p.prefetch_hinted},
                                                     {"hinted_hits", p.prefetch_hinted_hits}}
                                              : Json(nullptr)}};
  return doc.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace colibri
