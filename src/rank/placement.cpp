#include "rank/placement.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"

namespace colibri {

PlacementPolicy parse_placement_policy(const std::string& name) {
  if (name == "balanced") return PlacementPolicy::kBalanced;
  if (name == "round-robin") return PlacementPolicy::kRoundRobin;
  if (name == "contiguous") return PlacementPolicy::kContiguous;
  fail("--placement '{}' is unknown (balanced, round-robin, contiguous)", name);
}

const char* placement_policy_name(PlacementPolicy policy) {
  switch (policy) {
    case PlacementPolicy::kBalanced:
      return "balanced";
    case PlacementPolicy::kRoundRobin:
      return "round-robin";
    case PlacementPolicy::kContiguous:
      return "contiguous";
  }
  return "?";
}

std::vector<int> PlacementTable::experts_of(int rank, int layer) const {
  std::vector<int> out;
  for (int e = 0; e < num_experts; ++e)
    if (owner_of(layer, e) == rank) out.push_back(e);
  return out;
}

int PlacementTable::count_owned(int rank) const {
  return int(std::count(owner.begin(), owner.end(), rank));
}

PlacementTable make_placement(const ModelConfig& config, const Layout& layout,
                              PlacementPolicy policy, uint64_t bytes_per_expert) {
  PlacementTable table;
  table.num_layers = config.num_layers;
  table.num_experts = config.n_routed_experts;
  table.policy = placement_policy_name(policy);
  table.owner.assign(size_t(table.num_layers) * table.num_experts, -1);
  std::vector<int> ranks = layout.expert_ranks();
  if (ranks.empty()) ranks.push_back(layout.coordinator());
  const int r = int(ranks.size()), experts = table.num_experts;

  std::vector<double> capacity(size_t(r), 1.0);
  for (int i = 0; i < r; ++i) {
    const RankSpec& spec = layout.ranks[size_t(ranks[size_t(i)])];
    if (spec.ram_gb + spec.vram_gb > 0) capacity[size_t(i)] = spec.ram_gb + spec.vram_gb;
  }
  std::vector<double> assigned(size_t(r), 0.0);
  int moe_index = 0;
  for (int l = 0; l < table.num_layers; ++l) {
    if (!config.layer_is_moe[size_t(l)]) continue;
    for (int e = 0; e < experts; ++e) {
      int pick = 0;
      switch (policy) {
        case PlacementPolicy::kRoundRobin:
          pick = int((int64_t(moe_index) * experts + e) % r);
          break;
        case PlacementPolicy::kContiguous:
          pick = int(int64_t(e) * r / experts);
          break;
        case PlacementPolicy::kBalanced: {
          double best = 0;
          for (int j = 0; j < r; ++j) {
            const int candidate = (j + moe_index) % r;
            const double fill = (assigned[size_t(candidate)] + double(bytes_per_expert)) /
                                capacity[size_t(candidate)];
            if (j == 0 || fill < best) {
              best = fill;
              pick = candidate;
            }
          }
          break;
        }
      }
      assigned[size_t(pick)] += double(bytes_per_expert);
      table.owner[size_t(l) * experts + e] = ranks[size_t(pick)];
    }
    ++moe_index;
  }
  return table;
}

std::string format_placement(const PlacementTable& table, const Layout& layout,
                             uint64_t bytes_per_expert) {
  std::string out = fmt::format("placement ({}): {} layers x {} routed experts\n", table.policy,
                                table.num_layers, table.num_experts);
  for (const RankSpec& spec : layout.ranks) {
    const int owned = table.count_owned(spec.rank);
    out += fmt::format("  rank {:>3} {:<12} {:>6} experts {:>10.1f} MiB\n", spec.rank,
                       role_name(spec.role), owned,
                       double(owned) * double(bytes_per_expert) / (1 << 20));
  }
  for (int l = 0; l < table.num_layers; ++l) {
    if (table.num_experts == 0 || table.owner_of(l, 0) < 0) continue;
    out += fmt::format("  layer {:>3}:", l);
    for (int e = 0; e < table.num_experts; ++e) out += fmt::format(" {}", table.owner_of(l, e));
    out += '\n';
  }
  return out;
}

}  // namespace colibri
