// Live re-placement (--repin-every N): every N routed tokens the coordinator compares each MoE
// layer's recent routing with the heat its placement was made for, re-places the layers that
// drifted (heat placement, moe/placement.h), and moves their experts in two steps at engine step
// boundaries: prepare (the new holders start reading them, the job goes on with the old table)
// and, lead_steps steps later, commit (every rank switches before its next request). No request
// sees a mixed table: the transport delivers a change in order with the requests.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "common/layout.h"
#include "model/config.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "moe/routing_stats.h"
#include "rank/expert_store.h"
#include "transport/transport.h"

namespace colibri {

struct RepinOptions {
  int every_tokens = 0;  // routed tokens between rounds; 0: never
  int max_moves = 64;    // (layer, expert) holder changes per round at most
  int lead_steps = 2;    // engine steps between prepare and commit
  int replicas = 0;      // as --replicas
  // A layer is re-placed when the total variation distance between its recent routing and the
  // heat its placement was made for exceeds this (a tenth of its routes went elsewhere), and
  // exceeds the distance chance gives so few routes (sqrt(experts / routes) / 2).
  double drift = 0.1;
};

struct RepinStats {
  uint64_t rounds = 0;          // rounds that looked at the routing
  uint64_t changes = 0;         // rounds that moved experts (each a committed change)
  uint64_t moves = 0;           // (layer, expert) holder changes committed
  uint64_t coordinator_us = 0;  // time the coordinator spent on rounds (tables, messages, stores)
};

class Repinner {
 public:
  // `table` is the placement every side reads (changed in place at commit); `own_store`, when
  // the coordinator owns experts, is its store; `own_rank` the coordinator's rank.
  Repinner(const ModelConfig& config, const Layout& layout, uint64_t bytes_per_expert,
           const RepinOptions& options, LivePlacement& placement, Dispatcher& dispatcher,
           ExpertStore* own_store, int own_rank);

  // After each engine step: `routes`, the engine's routes so far; `rows`, the step's rows.
  void after_step(const RoutingStats& routes, int rows);
  const RepinStats& stats() const { return stats_; }
  const RoutingStats& recent() const { return recent_; }

 private:
  void round(const RoutingStats& routes);
  void commit();

  const ModelConfig& config_;
  const Layout& layout_;
  uint64_t bytes_per_expert_;
  RepinOptions options_;
  LivePlacement& placement_;
  Dispatcher& dispatcher_;
  ExpertStore* own_store_;
  int own_rank_;
  RoutingStats seen_;    // the engine's routes at the last round
  RoutingStats recent_;  // each round's routes plus half the previous recent heat
  int64_t tokens_ = 0;
  std::optional<PlacementChange> pending_;
  std::vector<double> pending_heat_;  // the new heat of the layers pending_ moves
  int steps_since_prepare_ = 0;
  RepinStats stats_;
};

}  // namespace colibri
