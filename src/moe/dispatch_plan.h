// What the coordinator sends the owners of a MoE layer's experts, in the words every side uses:
// the exchange's shape, each owner's share of the rows and routed pairs (the count phase,
// DispatchPlan::build, before any payload moves), hints of experts to come, and the request an
// owner receives. The transports (transport/) carry them; the expert backends (rank/) compute
// them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/buffer.h"
#include "moe/placement.h"
#include "moe/router.h"

namespace colibri {

struct ExchangeShape {
  int max_rows = 0;  // rows per forward call (prompt chunk): the exchange buffers' size
  int hidden = 0;
  int top_k = 0;
  int num_experts = 0;
};

// One owner's share of a layer: the rows routed to it (each once) and its (row, expert, weight)
// pairs, `row` indexing `rows`.
struct OwnerShare {
  int rank = 0;
  std::vector<int> rows;          // coordinator row indices, ascending
  std::vector<RoutedPair> pairs;  // in routing order
};

struct DispatchPlan {
  int layer = -1;
  int n_rows = 0;
  std::vector<OwnerShare> owners;  // ascending rank, only owners with work

  // The count phase: which rows and pairs go to which owner. Reuses its vectors across calls.
  void build(const PlacementTable& placement, int layer, const Routing& routing, int n);
  uint64_t pairs() const;

 private:
  std::vector<int> share_of_;  // rank -> index in owners during build
  uint64_t builds_ = 0;        // plans built: the turn among an expert's replicas
};

// The experts of a layer an owner will likely be asked for (--prefetch-ahead): a hint that
// starts their reads early and never changes a result.
struct OwnerHint {
  int rank = 0;
  std::vector<int> experts;  // ascending, held by `rank`
};

// What an expert owner receives for one layer.
struct ExpertRequest {
  int layer = 0;
  int n_rows = 0;
  ConstView rows;                     // [n_rows, hidden] in the wire element type
  std::span<const RoutedPair> pairs;  // `row` indexes rows
};

}  // namespace colibri
