// The dispatcher of a single process: the coordinator owns every routed expert and runs them
// through its own expert backend, with the same plan and the same summation order as a remote
// owner would.
#pragma once

#include <vector>

#include "rank/expert_backend.h"
#include "transport/transport.h"

namespace colibri {

class LocalDispatcher final : public Dispatcher {
 public:
  LocalDispatcher(ExpertBackend& backend, int hidden) : backend_(backend), hidden_(hidden) {}

  void dispatch(const DispatchPlan& plan, ConstView x) override;
  void combine(View out) override;
  void shutdown() override {}

 private:
  ExpertBackend& backend_;
  int hidden_;
  const DispatchPlan* plan_ = nullptr;
  const float* x_ = nullptr;
  std::vector<float> rows_, partial_;  // [rows of one owner, hidden]
};

}  // namespace colibri
