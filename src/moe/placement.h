// The placement table: every routed expert (layer, id) has exactly one owner rank, or (sliced)
// every owner rank holds a slice of it. Computed once at start-up on the coordinator, broadcast to
// every rank, printable with --print-placement.
#pragma once

#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "common/layout.h"
#include "model/config.h"
#include "model/weights.h"
#include "moe/routing_stats.h"

namespace colibri {

enum class PlacementPolicy { kBalanced, kRoundRobin, kContiguous, kHosts, kSliced, kHeat };

PlacementPolicy parse_placement_policy(const std::string& name);
const char* placement_policy_name(PlacementPolicy policy);

struct PlacementTable {
  int num_layers = 0;
  int num_experts = 0;
  std::string policy;
  uint32_t epoch = 0;  // moved on by each change applied while the job runs (placement_change.h)
  std::vector<int> owner;  // [num_layers * num_experts]; -1 on dense layers, kSliced (sliced)
  // sliced: every routed expert is held by every rank of slice_ranks, rank slice_ranks[i] its
  // intermediate rows [slice_bounds[i], slice_bounds[i + 1]) (ExpertSlice).
  std::vector<int> slice_ranks;
  std::vector<int64_t> slice_bounds;
  // Replicas: further owners of (layer, expert) beside `owner`, ascending; empty lists (or an
  // empty vector) where an expert has one owner. The coordinator picks one owner per routed row.
  std::vector<std::vector<int>> replicas;  // [num_layers * num_experts] or empty
  // heat: each expert's expected share of its layer's routes, from the routing statistics
  // (uniform without them); empty for the other policies.
  std::vector<double> heat;  // [num_layers * num_experts] or empty

  static constexpr int kSliced = -2;
  int owner_of(int layer, int expert) const { return owner[size_t(layer) * num_experts + expert]; }
  const std::vector<int>& replicas_of(int layer, int expert) const {
    static const std::vector<int> none;
    return replicas.empty() ? none : replicas[size_t(layer) * num_experts + expert];
  }
  double heat_of(int layer, int expert) const {
    return heat.empty() ? 0.0 : heat[size_t(layer) * num_experts + expert];
  }
  // Whether `rank` holds expert `expert` of `layer` (whole, or a slice of it).
  bool holds(int layer, int expert, int rank) const;
  // The slice of every expert that `rank` holds (whole unless sliced).
  ExpertSlice slice_of(int rank) const;
  // Its share of an expert's rows (1 when whole): about its share of the bytes.
  double held_fraction(int rank) const;
  // Replica copies in the table (0 without replicas).
  int replica_count() const;
  // Experts of `layer` held by `rank`, ascending.
  std::vector<int> experts_of(int rank, int layer) const;
  int count_owned(int rank) const;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(num_layers, num_experts, policy, epoch, owner, slice_ranks, slice_bounds, replicas, heat);
  }
};

// Places the routed experts of every MoE layer on the layout's owner ranks (its expert ranks, and
// the coordinator when its row has a ram_gb budget).
//  balanced:    each expert goes to the rank with the lowest assigned bytes relative to its
//               budget (ram_gb + vram_gb, equal when unset); the start rotates per layer so the
//               per-layer expected load (uniform without routing statistics) spreads too.
//  round-robin: expert e of MoE layer i goes to expert rank (i * E + e) mod R.
//  contiguous:  expert e goes to expert rank floor(e * R / E) (blocks of ids).
//  sliced:      every owner rank holds every routed expert's intermediate rows in a slice
//               (gate and up rows, down columns) in proportion to its budget; each routed row
//               goes to every owner, whose partial sums add up to the experts' output. The work of
//               a token is split the same way whatever experts it routes to.
//  hosts:       contiguous blocks of expert ids per host (the layout's host column), each host's
//               block in proportion to its ranks' budgets, whole expert groups (n_group) when
//               there are at least as many groups as hosts; within a host, balanced over its
//               ranks. With group-limited routing a token's experts then lie on at most
//               topk_group hosts (fewer messages and bytes across hosts, with --combine host).
//  heat:        the hottest experts of each layer (routing statistics `stats`, uniform without)
//               on the fastest tiers: gpu-expert ranks' VRAM budgets first, then the RAM budgets,
//               then the ranks' disk tiers; within a tier each expert goes to the rank with the
//               lowest expected routed rows so far in that layer, so that every layer's expected
//               rows per rank are even. `replicas` extra copies per MoE layer go to the experts
//               with the most expected rows per copy (D'Hondt), each copy on another rank.
// With no expert ranks (one process) the coordinator owns everything.
PlacementTable make_placement(const ModelConfig& config, const Layout& layout,
                              PlacementPolicy policy, uint64_t bytes_per_expert,
                              const RoutingStats* stats = nullptr, int replicas = 0);

// The heat policy (moe/heat_placement.cpp), for make_placement.
PlacementTable place_by_heat(const ModelConfig& config, const Layout& layout,
                             uint64_t bytes_per_expert, const RoutingStats* stats, int replicas);

// Each owner rank's expected share of the routed rows (the table's heat, or uniform), averaged
// over the MoE layers, and the largest per-layer ratio of the busiest owner's expected rows to the
// mean: [world size] shares, and the ratio. A replicated expert's rows are split evenly.
struct ExpectedLoad {
  std::vector<double> share;  // [ranks]
  double max_over_mean = 1;   // worst layer
};
ExpectedLoad expected_load(const PlacementTable& table, const Layout& layout);

// Human-readable: per rank the owned count and bytes, then per layer the owner of each expert.
std::string format_placement(const PlacementTable& table, const Layout& layout,
                             uint64_t bytes_per_expert);

}  // namespace colibri
