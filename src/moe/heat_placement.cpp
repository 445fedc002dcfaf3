// --placement heat: the hottest experts on the fastest tiers, every layer's expected routes even
// across the owner ranks, replicas for the hottest (moe/placement.h).
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "moe/placement.h"

namespace colibri {

namespace {

constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();

// The experts a budget of `gb` holds in each of `layers` MoE layers (layer `index`'s share of
// the whole budget); unbounded when the budget is unset.
int64_t slots_in_layer(double gb, uint64_t bytes_per_expert, int layers, int index) {
  if (gb <= 0 || bytes_per_expert == 0) return kUnbounded;
  const auto total = int64_t(gb * double(1ull << 30) / double(bytes_per_expert));
  return total / layers + (index < total % layers ? 1 : 0);
}

}  // namespace

PlacementTable place_by_heat(const ModelConfig& config, const Layout& layout,
                             uint64_t bytes_per_expert, const RoutingStats* stats, int replicas) {
  PlacementTable table;
  table.num_layers = config.num_layers;
  table.num_experts = config.n_routed_experts;
  table.policy = placement_policy_name(PlacementPolicy::kHeat);
  const int experts = table.num_experts;
  const size_t cells = size_t(table.num_layers) * size_t(experts);
  table.owner.assign(cells, -1);
  table.replicas.assign(cells, {});
  table.heat.assign(cells, 0.0);
  if (stats && !stats->count.empty() &&
      (stats->num_layers != table.num_layers || stats->num_experts != experts))
    fail("routing statistics of {} layers x {} experts for a model of {} x {}", stats->num_layers,
         stats->num_experts, table.num_layers, experts);
  std::vector<int> ranks = layout.owner_ranks();
  if (ranks.empty()) ranks.push_back(layout.coordinator());
  const int r = int(ranks.size());
  if (replicas < 0 || replicas > experts * (r - 1))
    fail(
        "--replicas {}: between 0 and {} (each of the {} experts of a layer on at most all {} "
        "owner ranks)",
        replicas, experts * (r - 1), experts, r);

  // Per owner: its weight in the count per layer (its budgets, equal when unset), as balanced.
  std::vector<double> weight(size_t(r), 1.0);
  double total_weight = 0;
  for (int i = 0; i < r; ++i) {
    const RankSpec& spec = layout.ranks[size_t(ranks[size_t(i)])];
    if (spec.ram_gb + spec.vram_gb > 0) weight[size_t(i)] = spec.ram_gb + spec.vram_gb;
    total_weight += weight[size_t(i)];
  }
  int moe_layers = 0;
  for (int l = 0; l < table.num_layers; ++l) moe_layers += config.layer_is_moe[size_t(l)];

  int moe_index = 0;
  for (int l = 0; l < table.num_layers; ++l) {
    if (!config.layer_is_moe[size_t(l)]) continue;
    const std::vector<double> share = stats && !stats->empty()
                                          ? stats->layer_share(l)
                                          : std::vector<double>(size_t(experts), 1.0 / experts);
    std::copy(share.begin(), share.end(), table.heat.begin() + int64_t(l) * experts);

    // Copies per expert: one each, then each replica to the most expected routes per copy.
    std::vector<int> copies(size_t(experts), 1);
    for (int k = 0; k < replicas; ++k) {
      int best = -1;
      for (int e = 0; e < experts; ++e)
        if (copies[size_t(e)] < r && (best < 0 || share[size_t(e)] / copies[size_t(e)] >
                                                      share[size_t(best)] / copies[size_t(best)]))
          best = e;
      ++copies[size_t(best)];
    }
    struct Copy {
      int expert;
      double load;
    };
    std::vector<Copy> items;
    for (int e = 0; e < experts; ++e)
      for (int c = 0; c < copies[size_t(e)]; ++c)
        items.push_back({e, share[size_t(e)] / copies[size_t(e)]});
    std::stable_sort(items.begin(), items.end(),
                     [](const Copy& a, const Copy& b) { return a.load > b.load; });

    // Each owner's room in this layer: its count (by weight) and its VRAM and RAM slots.
    const auto owners = size_t(r);
    std::vector<int64_t> room(owners), vram(owners), ram(owners);
    for (int i = 0; i < r; ++i) {
      const RankSpec& spec = layout.ranks[size_t(ranks[size_t(i)])];
      room[size_t(i)] =
          int64_t(std::ceil(double(items.size()) * weight[size_t(i)] / total_weight - 1e-9));
      vram[size_t(i)] = spec.role == Role::kGpuExpert
                            ? slots_in_layer(spec.vram_gb, bytes_per_expert, moe_layers, moe_index)
                            : 0;
      ram[size_t(i)] = slots_in_layer(spec.ram_gb, bytes_per_expert, moe_layers, moe_index);
    }
    std::vector<double> load(owners, 0.0);
    std::vector<int> count(owners, 0);
    for (const Copy& item : items) {
      // The best tier any owner with room offers, then the least expected load within it.
      int pick = -1, pick_tier = 0;
      for (int j = 0; j < r; ++j) {
        const int i = (j + moe_index) % r;
        const int rank = ranks[size_t(i)];
        if (count[size_t(i)] >= room[size_t(i)]) continue;
        const size_t cell = size_t(l) * experts + size_t(item.expert);
        const std::vector<int>& more = table.replicas[cell];
        if (table.owner[cell] == rank || std::count(more.begin(), more.end(), rank)) continue;
        const int tier = vram[size_t(i)] > 0 ? 0 : ram[size_t(i)] > 0 ? 1 : 2;
        if (pick < 0 || tier < pick_tier ||
            (tier == pick_tier &&
             (load[size_t(i)] < load[size_t(pick)] ||
              (load[size_t(i)] == load[size_t(pick)] && count[size_t(i)] < count[size_t(pick)])))) {
          pick = i;
          pick_tier = tier;
        }
      }
      if (pick < 0)
        fail("--placement heat: no owner rank has room for a copy of expert {} of layer {}",
             item.expert, l);
      load[size_t(pick)] += item.load;
      ++count[size_t(pick)];
      if (pick_tier == 0) --vram[size_t(pick)];
      if (pick_tier == 1) --ram[size_t(pick)];
      const size_t cell = size_t(l) * experts + size_t(item.expert);
      if (table.owner[cell] < 0) {
        table.owner[cell] = ranks[size_t(pick)];
      } else {
        std::vector<int>& more = table.replicas[cell];
        more.insert(std::upper_bound(more.begin(), more.end(), ranks[size_t(pick)]),
                    ranks[size_t(pick)]);
      }
    }
    ++moe_index;
  }
  if (replicas == 0) table.replicas.clear();
  return table;
}

ExpectedLoad expected_load(const PlacementTable& table, const Layout& layout) {
  ExpectedLoad out;
  out.share.assign(layout.ranks.size(), 0.0);
  std::vector<bool> owns(layout.ranks.size(), false);
  for (const RankSpec& spec : layout.ranks)
    owns[size_t(spec.rank)] =
        table.slice_ranks.empty()
            ? table.count_owned(spec.rank) > 0
            : std::count(table.slice_ranks.begin(), table.slice_ranks.end(), spec.rank) > 0;
  int moe_layers = 0;
  for (int l = 0; l < table.num_layers; ++l) {
    if (table.num_experts == 0 || table.owner_of(l, 0) == -1) continue;
    ++moe_layers;
    std::vector<double> layer(layout.ranks.size(), 0.0);
    for (int e = 0; e < table.num_experts; ++e) {
      const double h = table.heat.empty() ? 1.0 / table.num_experts : table.heat_of(l, e);
      const int owner = table.owner_of(l, e);
      if (owner == PlacementTable::kSliced) {
        for (int rank : table.slice_ranks) layer[size_t(rank)] += h * table.held_fraction(rank);
        continue;
      }
      const std::vector<int>& more = table.replicas_of(l, e);
      const double each = h / double(1 + more.size());
      layer[size_t(owner)] += each;
      for (int rank : more) layer[size_t(rank)] += each;
    }
    double busiest = 0, sum = 0;
    int owners = 0;
    for (const RankSpec& spec : layout.ranks) {
      if (!owns[size_t(spec.rank)]) continue;
      ++owners;
      sum += layer[size_t(spec.rank)];
      busiest = std::max(busiest, layer[size_t(spec.rank)]);
      out.share[size_t(spec.rank)] += layer[size_t(spec.rank)];
    }
    if (owners > 0 && sum > 0)
      out.max_over_mean = std::max(out.max_over_mean, busiest * owners / sum);
  }
  if (moe_layers > 0)
    for (double& s : out.share) s /= moe_layers;
  return out;
}

}  // namespace colibri
