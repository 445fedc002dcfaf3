#include <algorithm>

#include "common/error.h"
#include "moe/dispatch_plan.h"

namespace colibri {

void DispatchPlan::build(const PlacementTable& placement, int layer_index, const Routing& routing,
                         int n) {
  layer = layer_index;
  n_rows = n;
  const int k = routing.top_k;
  // A replicated expert's row goes to the owner with the fewest pairs so far in this layer; on a
  // tie to one that already has the row (no extra row on the wire), then to the next in a turn
  // that moves on with every plan and row, so that small batches spread over the copies too.
  ++builds_;
  const auto least_loaded = [&](int first, const std::vector<int>& more, int row) {
    const auto cost = [&](int rank) {
      const int index = size_t(rank) < share_of_.size() ? share_of_[size_t(rank)] : -1;
      if (index < 0) return std::pair<size_t, int>{0, 1};
      const OwnerShare& s = owners[size_t(index)];
      return std::pair<size_t, int>{s.pairs.size(), s.rows.empty() || s.rows.back() != row};
    };
    const size_t copies = more.size() + 1;
    const size_t start = size_t((builds_ + uint64_t(row)) % copies);
    int best = -1;
    std::pair<size_t, int> best_cost;
    for (size_t i = 0; i < copies; ++i) {
      const size_t j = (start + i) % copies;
      const int rank = j == 0 ? first : more[j - 1];
      if (const auto c = cost(rank); best < 0 || c < best_cost) {
        best = rank;
        best_cost = c;
      }
    }
    return best;
  };
  // owners[] keeps one share per rank seen so far (capacity reused); `active` counts those used.
  size_t active = 0;
  share_of_.assign(share_of_.size(), -1);
  for (OwnerShare& s : owners) {
    s.rows.clear();
    s.pairs.clear();
  }
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < k; ++i) {
      const int expert = routing.expert[size_t(t) * k + i];
      const auto add = [&](int owner) {
        if (size_t(owner) >= share_of_.size()) share_of_.resize(size_t(owner) + 1, -1);
        int& index = share_of_[size_t(owner)];
        if (index < 0) {
          index = int(active++);
          if (owners.size() < active) owners.emplace_back();
          owners[size_t(index)].rank = owner;
        }
        OwnerShare& share = owners[size_t(index)];
        if (share.rows.empty() || share.rows.back() != t) share.rows.push_back(t);
        share.pairs.push_back(
            {uint32_t(share.rows.size() - 1), uint32_t(expert), routing.weight[size_t(t) * k + i]});
      };
      const int owner = placement.owner_of(layer, expert);
      if (owner == PlacementTable::kSliced) {  // a slice of it on every slice rank
        for (int rank : placement.slice_ranks) add(rank);
        continue;
      }
      if (owner < 0) fail("expert {} of layer {} has no owner", expert, layer);
      const std::vector<int>& replicas = placement.replicas_of(layer, expert);
      add(replicas.empty() ? owner : least_loaded(owner, replicas, t));
    }
  }
  owners.resize(active);
  std::sort(owners.begin(), owners.end(),
            [](const OwnerShare& a, const OwnerShare& b) { return a.rank < b.rank; });
}

uint64_t DispatchPlan::pairs() const {
  uint64_t total = 0;
  for (const OwnerShare& s : owners) total += s.pairs.size();
  return total;
}

}  // namespace colibri
