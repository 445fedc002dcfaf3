// A change of placement while the job runs: the experts whose holders change between two tables,
// applied in two steps at step boundaries every rank sees in the same order. Prepare: each rank
// starts loading the experts it will newly hold, and the job goes on with the old table. Commit:
// every rank switches to the new table (epoch + 1) before its next request, and drops what it no
// longer holds.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moe/placement.h"

namespace colibri {

// The new holders of one (layer, expert): its owner first, then its replicas ascending.
struct HolderChange {
  int layer = 0;
  int expert = 0;
  std::vector<int> holders;
};

struct PlacementChange {
  bool commit = false;  // false: prepare
  uint32_t epoch = 0;   // the table's epoch once committed
  std::vector<HolderChange> changes;
};

// The placement a running job reads: an immutable table, shared by everything on this rank that
// reads it, replaced whole at a step boundary every rank agrees on (the commit of a
// PlacementChange). Readers take current() once per step and keep it for the step; a table taken
// with share() stays valid while it is held, whatever replaces it.
class LivePlacement {
 public:
  LivePlacement();
  explicit LivePlacement(PlacementTable table);

  const PlacementTable& current() const { return *table_; }
  std::shared_ptr<const PlacementTable> share() const { return table_; }
  // The next version: an Error unless `next` has the current table's shape and a later epoch.
  void replace(PlacementTable next);
  // The current table with `change` applied, at the change's epoch (and `heat` when given):
  // what replace() takes at a commit.
  PlacementTable next(const PlacementChange& change, std::vector<double> heat = {}) const;

 private:
  std::shared_ptr<const PlacementTable> table_;
};

// Every (layer, expert) whose holders differ between two tables of one shape.
std::vector<HolderChange> placement_diff(const PlacementTable& from, const PlacementTable& to);

// Applies changes to a table (its epoch is the caller's to set).
void apply_placement_change(PlacementTable& table, std::span<const HolderChange> changes);

// The (layer, expert) pairs `rank` holds after the changes and not before (gained), or before
// and not after (lost), ascending.
std::vector<std::pair<int, int>> experts_gained(const PlacementTable& table,
                                                std::span<const HolderChange> changes, int rank);
std::vector<std::pair<int, int>> experts_lost(const PlacementTable& table,
                                              std::span<const HolderChange> changes, int rank);

// The wire form: per change u32 layer, expert, holder count, then the holders (a message of
// the transport puts the epoch in front).
std::vector<uint32_t> encode_holder_changes(std::span<const HolderChange> changes);
// Decodes and checks `words` (layers, experts and ranks in range, holders distinct and not
// empty); returns the problem, "" when valid.
std::string decode_holder_changes(std::span<const uint32_t> words, int num_layers, int num_experts,
                                  int world_size, std::vector<HolderChange>& changes);

}  // namespace colibri
