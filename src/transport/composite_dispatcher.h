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

  void dispatch(const DispatchPlan& plan, ConstView x) override;
  // out: fp32 host memory.
  void combine(View out) override;
  void shutdown() override;
  void change_placement(const PlacementChange& change) override;
  std::vector<LiveCounters> live_counters() override;
  void hint(int layer, std::span<const OwnerHint> hints) override;
  std::vector<uint64_t> slowest_counts() const override;

 private:
  std::vector<Part> parts_;
  std::vector<int> part_of_;          // rank -> index in parts_ (-1: none)
  std::vector<DispatchPlan> plans_;   // [parts] this exchange's share of the plan
  std::vector<size_t> active_;        // parts with owners in this exchange
  std::vector<uint8_t> row_started_;  // [rows]
  int hidden_ = 0;
  int n_rows_ = 0;
};

}  // namespace colibri
