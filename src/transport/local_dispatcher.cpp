#include "transport/local_dispatcher.h"

#include <algorithm>

#include "common/error.h"

namespace colibri {

void LocalDispatcher::dispatch(const DispatchPlan& plan, ConstView x) {
  if (x.type != ElemType::kF32 || x.device != Device::kHost)
    fail("the local dispatcher takes fp32 host rows");
  plan_ = &plan;
  x_ = static_cast<const float*>(x.data);
}

void LocalDispatcher::combine(View out) {
  auto* sum = static_cast<float*>(out.data);
  const size_t h = size_t(hidden_);
  std::fill(sum, sum + size_t(plan_->n_rows) * h, 0.0f);
  for (const OwnerShare& share : plan_->owners) {
    const size_t n = share.rows.size();
    // Rows 0..n-1 in order (every row routed here, the single-process case) need no gather.
    const bool identity = int(n) == plan_->n_rows && (n == 0 || share.rows.back() == int(n) - 1);
    const float* rows = x_;
    if (!identity) {
      if (rows_.size() < n * h) rows_.resize(n * h);
      for (size_t r = 0; r < n; ++r) std::copy_n(x_ + size_t(share.rows[r]) * h, h, &rows_[r * h]);
      rows = rows_.data();
    }
    if (partial_.size() < n * h) partial_.resize(n * h);
    ExpertRequest request;
    request.layer = plan_->layer;
    request.n_rows = int(n);
    request.rows = host_f32(rows, n * h);
    request.pairs = share.pairs;
    backend_.compute(request, partial_.data());
    for (size_t r = 0; r < n; ++r) {
      float* dst = sum + size_t(share.rows[r]) * h;
      const float* src = &partial_[r * h];
      for (size_t j = 0; j < h; ++j) dst[j] += src[j];
    }
  }
}

}  // namespace colibri
