// The dispatcher of a single process: the coordinator owns every routed expert and runs them
// through its own expert backend, with the same plan and the same summation order as a remote
// owner would.
#pragma once

#include <vector>

#include "common/profile.h"
#include "rank/expert_backend.h"
#include "transport/transport.h"

namespace colibri {

class LocalDispatcher final : public PartialDispatcher {
 public:
  // The experts' compute is profiled as Phase::kLocalExperts when a profiler is given.
  LocalDispatcher(ExpertBackend& backend, int hidden, Profiler* profiler = nullptr)
      : backend_(backend), hidden_(hidden), profiler_(profiler) {}

  void dispatch(const DispatchPlan& plan, ConstView x) override { dispatch_slot(0, plan, x); }
  void combine(View out) override { combine_slot(0, out); }
  // Two slots: each holds its plan and rows until its combine computes the experts.
  int exchange_slots() const override { return kSlots; }
  void dispatch_slot(int slot, const DispatchPlan& plan, ConstView x) override;
  void combine_slot(int slot, View out) override;
  void shutdown() override {}
  // In-process experts: the node updates their store itself.
  void change_placement(const PlacementChange&) override {}
  void hint(int layer, std::span<const OwnerHint> hints) override {
    for (const OwnerHint& h : hints) backend_.hint(layer, h.experts);  // the store keeps its own
  }

  // The owners' partials are computed here, one owner after the other.
  void select_slot(int slot) override;
  void wait_partials() override;
  std::span<const int> partial_ranks() const override { return ranks_; }
  void add_partial(size_t i, float* out, std::span<uint8_t> started) override;
  void finish_combine() override;
  int exchange_rows() const override { return plan_[current_] ? plan_[current_]->n_rows : 0; }
  int exchange_hidden() const override { return hidden_; }

 private:
  static constexpr int kSlots = 2;
  ExpertBackend& backend_;
  int hidden_;
  Profiler* profiler_;
  int current_ = 0;                        // the slot of the PartialDispatcher calls
  const DispatchPlan* plan_[kSlots] = {};  // null: no exchange in the slot
  const float* x_[kSlots] = {};
  std::vector<float> rows_;                   // [rows of one owner, hidden]
  std::vector<std::vector<float>> partials_;  // per owner [its rows, hidden]
  std::vector<int> ranks_;                    // owners whose partials are computed
};

}  // namespace colibri
