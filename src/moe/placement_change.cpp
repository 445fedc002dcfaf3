#include "moe/placement_change.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"

namespace colibri {

namespace {

std::vector<int> holders_of(const PlacementTable& table, int layer, int expert) {
  std::vector<int> holders{table.owner_of(layer, expert)};
  const std::vector<int>& more = table.replicas_of(layer, expert);
  holders.insert(holders.end(), more.begin(), more.end());
  return holders;
}

bool holds(const std::vector<int>& holders, int rank) {
  return std::find(holders.begin(), holders.end(), rank) != holders.end();
}

std::vector<std::pair<int, int>> difference(const PlacementTable& table,
                                            std::span<const HolderChange> changes, int rank,
                                            bool gained) {
  std::vector<std::pair<int, int>> out;
  for (const HolderChange& c : changes) {
    const bool before = holds(holders_of(table, c.layer, c.expert), rank);
    const bool after = holds(c.holders, rank);
    if (gained ? after && !before : before && !after) out.emplace_back(c.layer, c.expert);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::vector<HolderChange> placement_diff(const PlacementTable& from, const PlacementTable& to) {
  if (from.num_layers != to.num_layers || from.num_experts != to.num_experts)
    fail("placements of {} x {} and {} x {} experts cannot be compared", from.num_layers,
         from.num_experts, to.num_layers, to.num_experts);
  if (!from.slice_ranks.empty() || !to.slice_ranks.empty())
    fail("sliced placements do not move experts");
  std::vector<HolderChange> changes;
  for (int l = 0; l < from.num_layers; ++l)
    for (int e = 0; e < from.num_experts; ++e) {
      if (from.owner_of(l, e) < 0) continue;
      std::vector<int> after = holders_of(to, l, e);
      if (after != holders_of(from, l, e)) changes.push_back({l, e, std::move(after)});
    }
  return changes;
}

void apply_placement_change(PlacementTable& table, std::span<const HolderChange> changes) {
  for (const HolderChange& c : changes) {
    const size_t cell = size_t(c.layer) * size_t(table.num_experts) + size_t(c.expert);
    table.owner[cell] = c.holders.front();
    if (table.replicas.empty() && c.holders.size() > 1)
      table.replicas.assign(table.owner.size(), {});
    if (!table.replicas.empty())
      table.replicas[cell].assign(c.holders.begin() + 1, c.holders.end());
  }
}

std::vector<std::pair<int, int>> experts_gained(const PlacementTable& table,
                                                std::span<const HolderChange> changes, int rank) {
  return difference(table, changes, rank, true);
}

std::vector<std::pair<int, int>> experts_lost(const PlacementTable& table,
                                              std::span<const HolderChange> changes, int rank) {
  return difference(table, changes, rank, false);
}

std::vector<uint32_t> encode_holder_changes(std::span<const HolderChange> changes) {
  std::vector<uint32_t> words;
  for (const HolderChange& c : changes) {
    words.push_back(uint32_t(c.layer));
    words.push_back(uint32_t(c.expert));
    words.push_back(uint32_t(c.holders.size()));
    for (int rank : c.holders) words.push_back(uint32_t(rank));
  }
  return words;
}

std::string decode_holder_changes(std::span<const uint32_t> words, int num_layers, int num_experts,
                                  int world_size, std::vector<HolderChange>& changes) {
  changes.clear();
  for (size_t at = 0; at < words.size();) {
    if (words.size() - at < 3) return fmt::format("a change cut short at word {}", at);
    HolderChange c;
    const uint32_t layer = words[at], expert = words[at + 1], count = words[at + 2];
    at += 3;
    if (layer >= uint32_t(num_layers) || expert >= uint32_t(num_experts))
      return fmt::format("expert {} of layer {} out of range", expert, layer);
    if (count == 0 || count > uint32_t(world_size) || words.size() - at < count)
      return fmt::format("{} holders for expert {} of layer {}", count, expert, layer);
    c.layer = int(layer);
    c.expert = int(expert);
    for (uint32_t i = 0; i < count; ++i) {
      const uint32_t rank = words[at++];
      if (rank >= uint32_t(world_size) || holds(c.holders, int(rank)))
        return fmt::format("holder {} of expert {} of layer {} out of range or repeated", rank,
                           expert, layer);
      c.holders.push_back(int(rank));
    }
    changes.push_back(std::move(c));
  }
  return {};
}

LivePlacement::LivePlacement() : table_(std::make_shared<const PlacementTable>()) {}

LivePlacement::LivePlacement(PlacementTable table)
    : table_(std::make_shared<const PlacementTable>(std::move(table))) {}

void LivePlacement::replace(PlacementTable next) {
  const PlacementTable& now = current();
  if (next.num_layers != now.num_layers || next.num_experts != now.num_experts)
    fail("a placement of {} layers x {} experts cannot replace one of {} x {}", next.num_layers,
         next.num_experts, now.num_layers, now.num_experts);
  if (next.epoch <= now.epoch)
    fail("a placement at epoch {} cannot replace one at epoch {}", next.epoch, now.epoch);
  table_ = std::make_shared<const PlacementTable>(std::move(next));
}

PlacementTable LivePlacement::next(const PlacementChange& change, std::vector<double> heat) const {
  PlacementTable table = current();
  apply_placement_change(table, change.changes);
  table.epoch = change.epoch;
  if (!heat.empty()) table.heat = std::move(heat);
  return table;
}

}  // namespace colibri
