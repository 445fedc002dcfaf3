#include "transport/local_dispatcher.h"

#include <algorithm>

#include "common/error.h"

namespace colibri {

void LocalDispatcher::dispatch_slot(int slot, const DispatchPlan& plan, ConstView x) {
  if (x.type != ElemType::kF32 || x.device != Device::kHost)
    fail("the local dispatcher takes fp32 host rows");
  if (slot < 0 || slot >= kSlots) fail("exchange slot {} of {}", slot, kSlots);
  current_ = slot;
  plan_[slot] = &plan;
  x_[slot] = static_cast<const float*>(x.data);
  ranks_.clear();
}

void LocalDispatcher::select_slot(int slot) {
  if (slot < 0 || slot >= kSlots || !plan_[slot]) fail("no exchange in slot {}", slot);
  current_ = slot;
}

void LocalDispatcher::combine_slot(int slot, View out) {
  select_slot(slot);
  combine_partials(*this, out);
}

void LocalDispatcher::finish_combine() {
  plan_[current_] = nullptr;
}

void LocalDispatcher::wait_partials() {
  const DispatchPlan& plan = *plan_[current_];
  const float* x = x_[current_];
  const size_t h = size_t(hidden_);
  if (partials_.size() < plan.owners.size()) partials_.resize(plan.owners.size());
  ranks_.clear();
  for (size_t o = 0; o < plan.owners.size(); ++o) {
    const OwnerShare& share = plan.owners[o];
    const size_t n = share.rows.size();
    // Rows 0..n-1 in order (every row routed here, the single-process case) need no gather.
    const bool identity = int(n) == plan.n_rows && (n == 0 || share.rows.back() == int(n) - 1);
    const float* rows = x;
    if (!identity) {
      if (rows_.size() < n * h) rows_.resize(n * h);
      for (size_t r = 0; r < n; ++r) std::copy_n(x + size_t(share.rows[r]) * h, h, &rows_[r * h]);
      rows = rows_.data();
    }
    std::vector<float>& partial = partials_[o];
    if (partial.size() < n * h) partial.resize(n * h);
    ExpertRequest request;
    request.layer = plan.layer;
    request.n_rows = int(n);
    request.rows = host_f32(rows, n * h);
    request.pairs = share.pairs;
    OptionalScope scope(profiler_, Phase::kLocalExperts, plan.layer);
    backend_.compute(request, partial.data());
    ranks_.push_back(share.rank);
  }
}

void LocalDispatcher::add_partial(size_t i, float* sum, std::span<uint8_t> started) {
  const OwnerShare& share = plan_[current_]->owners.at(i);
  const size_t h = size_t(hidden_);
  const float* partial = partials_[i].data();
  for (size_t r = 0; r < share.rows.size(); ++r) {
    const auto row = size_t(share.rows[r]);
    wire::add_row(sum + row * h, partial + r * h, h, !started[row]);
    started[row] = 1;
  }
}

}  // namespace colibri
