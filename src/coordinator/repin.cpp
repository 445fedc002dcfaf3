#include "coordinator/repin.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "common/error.h"

namespace colibri {

Repinner::Repinner(const ModelConfig& config, const Layout& layout, uint64_t bytes_per_expert,
                   const RepinOptions& options, LivePlacement& placement, Dispatcher& dispatcher,
                   ExpertStore* own_store, int own_rank)
    : config_(config),
      layout_(layout),
      bytes_per_expert_(bytes_per_expert),
      options_(options),
      placement_(placement),
      dispatcher_(dispatcher),
      own_store_(own_store),
      own_rank_(own_rank) {
  if (placement_.current().heat.empty())
    fail("--repin-every re-places experts by their heat: it needs --placement heat");
  seen_.reset(config.num_layers, config.n_routed_experts);
  recent_.reset(config.num_layers, config.n_routed_experts);
}

void Repinner::after_step(const RoutingStats& routes, int rows) {
  if (options_.every_tokens <= 0) return;
  const auto start = std::chrono::steady_clock::now();
  if (pending_) {
    if (++steps_since_prepare_ < options_.lead_steps) return;
    commit();
  } else {
    tokens_ += rows;
    if (tokens_ < options_.every_tokens) return;
    tokens_ = 0;
    round(routes);
  }
  stats_.coordinator_us += uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(
                                        std::chrono::steady_clock::now() - start)
                                        .count());
}

void Repinner::round(const RoutingStats& routes) {
  ++stats_.rounds;
  for (size_t i = 0; i < recent_.count.size(); ++i)
    recent_.count[i] = recent_.count[i] / 2 + (routes.count[i] - seen_.count[i]);
  recent_.tokens = recent_.tokens / 2 + (routes.tokens - seen_.tokens);
  seen_ = routes;
  const PlacementTable target =
      place_by_heat(config_, layout_, bytes_per_expert_, &recent_, options_.replicas);
  const std::vector<HolderChange> all = placement_diff(placement_.current(), target);

  // The layers whose routing drifted from the heat they were placed for, most drifted first.
  struct Drift {
    int layer;
    double distance;
    size_t changes;
  };
  std::vector<Drift> drifted;
  for (int l = 0; l < config_.num_layers; ++l) {
    if (!config_.layer_is_moe[size_t(l)]) continue;
    const std::vector<double> share = recent_.layer_share(l);
    double distance = 0, routes_seen = 0;
    for (int e = 0; e < config_.n_routed_experts; ++e) {
      distance += std::abs(share[size_t(e)] - placement_.current().heat_of(l, e)) / 2;
      routes_seen += recent_.at(l, e);
    }
    // Few routes drift by chance: about sqrt(experts / routes) / 2 between two samples of one
    // routing. Only a drift beyond that and beyond options_.drift moves experts.
    const double noise =
        routes_seen > 0 ? std::sqrt(double(config_.n_routed_experts) / routes_seen) / 2 : 1;
    if (distance <= std::max(options_.drift, noise)) continue;
    const auto changes = size_t(
        std::count_if(all.begin(), all.end(), [l](const HolderChange& c) { return c.layer == l; }));
    if (changes > 0) drifted.push_back({l, distance, changes});
  }
  std::stable_sort(drifted.begin(), drifted.end(),
                   [](const Drift& a, const Drift& b) { return a.distance > b.distance; });
  std::vector<int> layers;
  size_t moves = 0;
  for (const Drift& d : drifted)
    if (moves + d.changes <= size_t(options_.max_moves)) {
      layers.push_back(d.layer);
      moves += d.changes;
    }
  if (layers.empty()) return;

  PlacementChange change;
  change.epoch = placement_.current().epoch + 1;
  for (const HolderChange& c : all)
    if (std::count(layers.begin(), layers.end(), c.layer)) change.changes.push_back(c);
  pending_heat_ = placement_.current().heat;
  for (int l : layers)
    std::copy_n(target.heat.begin() + int64_t(l) * config_.n_routed_experts,
                config_.n_routed_experts,
                pending_heat_.begin() + int64_t(l) * config_.n_routed_experts);
  dispatcher_.change_placement(change);
  if (own_store_)
    own_store_->add_owned(experts_gained(placement_.current(), change.changes, own_rank_));
  pending_ = std::move(change);
  steps_since_prepare_ = 0;
}

void Repinner::commit() {
  pending_->commit = true;
  dispatcher_.change_placement(*pending_);
  const std::vector<std::pair<int, int>> lost =
      experts_lost(placement_.current(), pending_->changes, own_rank_);
  placement_.replace(placement_.next(*pending_, pending_heat_));
  if (own_store_) own_store_->remove_owned(lost);
  ++stats_.changes;
  stats_.moves += pending_->changes.size();
  pending_.reset();
}

}  // namespace colibri
