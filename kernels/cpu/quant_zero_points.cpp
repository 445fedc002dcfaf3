// Zero points of int4 matrices (quant.h): the offsets' terms added to the symmetric product.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "cpu/quant.h"
#include "cpu/quant_detail.h"

namespace colibri::kernels {

namespace {

thread_local std::vector<float> sums_scratch;

// Sum over k < groups of off[k] * s[k]: 8 partial sums (group k in sum k % 8), then added in
// order, so that the compiler can keep them in a vector register without reassociating anything.
float offsets_dot(const float* off, const float* s, int64_t groups) {
  constexpr int kLanes = 8;
  float acc[kLanes] = {};
  const int64_t full = groups / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += off[k + j] * s[k + j];
  for (int64_t k = full; k < groups; ++k) acc[k - full] += off[k] * s[k];
  float total = 0.0f;
  for (int j = 0; j < kLanes; ++j) total += acc[j];
  return total;
}

}  // namespace

int64_t offset_groups(const QuantMatrixView& w) {
  return w.format == QuantFormat::kInt4Grouped ? (w.cols + w.group_size - 1) / w.group_size : 1;
}

void detail::group_sums(const float* x, int64_t n, int64_t cols, int group_size, float* sums) {
  const int64_t g = group_size > 0 ? group_size : std::max<int64_t>(cols, 1);
  const int64_t groups = (cols + g - 1) / g;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < groups; ++k) {
      float s = 0.0f;
      for (int64_t i = k * g; i < std::min(cols, (k + 1) * g); ++i) s += x[t * cols + i];
      sums[t * groups + k] = s;
    }
}

void detail::add_offsets(const QuantMatrixView& w, const float* sums, int64_t n, float* y,
                         int64_t y_stride, int64_t row_begin, int64_t row_end) {
  const int64_t groups = offset_groups(w);
  for (int64_t o = row_begin; o < row_end; ++o) {
    const float* off = w.offsets + o * groups;
    for (int64_t t = 0; t < n; ++t)
      y[t * y_stride + o] += offsets_dot(off, sums + t * groups, groups);
  }
}

void add_zero_point_terms(const QuantMatrixView& w, const float* x, int64_t n, float* y) {
  check_view(w);
  if (w.offsets == nullptr || n <= 0 || w.rows == 0 || w.cols == 0) return;
  const int64_t groups = offset_groups(w);
  if (int64_t(sums_scratch.size()) < n * groups) sums_scratch.resize(size_t(n * groups));
  float* sums = sums_scratch.data();
  detail::group_sums(x, n, w.cols, w.group_size, sums);
#pragma omp parallel if (w.rows * groups * n >= detail::kParallelMinMacs)
  {
    int64_t begin, end;
    detail::static_range(w.rows, omp_get_num_threads(), omp_get_thread_num(), begin, end);
    detail::add_offsets(w, sums, n, y, w.rows, begin, end);
  }
}

void add_zero_point_terms_scalar(const QuantMatrixView& w, const float* x, int64_t n, float* y) {
  check_view(w);
  if (w.offsets == nullptr) return;
  const int64_t groups = offset_groups(w);
  const int64_t g = w.format == QuantFormat::kInt4Grouped ? w.group_size : w.cols;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t o = 0; o < w.rows; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < w.cols; ++i)
        acc += double(w.offsets[o * groups + i / g]) * double(x[t * w.cols + i]);
      y[t * w.rows + o] = float(double(y[t * w.rows + o]) + acc);
    }
}

}  // namespace colibri::kernels
