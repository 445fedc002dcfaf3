// One dispatcher over several: each part serves its own expert ranks (NCCL for the GPU expert
// ranks, MPI for the CPU expert ranks of the same layer), one plan is split by owner, and the
// partials of every part are added in one ascending rank order, so that the sum has the bits of
// one transport over every rank with the same wire type. Pure C++ over PartialDispatcher.
#pragma once

#include <memory>
#include <vector>

#include "transport/transport.h"

namespace colibri {

class CompositeDispatcher final : public Dispatcher {
 public:
  struct Part {
    std::unique_ptr<PartialDispatcher> dispatcher;
    std::vector<int> ranks;  // the owners it serves
  };
  // Every owner a plan names must be in exactly one part.
  CompositeDispatcher(std::vector<Part> parts, int hidden);

  void dispatch(const DispatchPlan& plan, ConstView x) override { dispatch_slot(0, plan, x); }
  // out: fp32 host memory.
  void combine(View out) override { combine_slot(0, out); }
  // The fewest of its parts'.
  int exchange_slots() const override;
  void dispatch_slot(int slot, const DispatchPlan& plan, ConstView x) override;
  void combine_slot(int slot, View out) override;
  void shutdown() override;
  void change_placement(const PlacementChange& change) override;
  std::vector<LiveCounters> live_counters() override;
  void hint(int layer, std::span<const OwnerHint> hints) override;
  std::vector<uint64_t> slowest_counts() const override;

 private:
  std::vector<Part> parts_;
  std::vector<int> part_of_;  // rank -> index in parts_ (-1: none)
  // One exchange slot's: per part its share of the plan, the parts with owners in it, its rows.
  struct Exchange {
    std::vector<DispatchPlan> plans;
    std::vector<size_t> active;
    int n_rows = 0;
  };
  Exchange exchanges_[2];
  std::vector<uint8_t> row_started_;  // [rows]
  int hidden_ = 0;
};

}  // namespace colibri
