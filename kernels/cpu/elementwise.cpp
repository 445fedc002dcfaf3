#include "cpu/elementwise.h"

#include <algorithm>
#include <cmath>

namespace colibri::kernels {

void rms_norm(const float* x, int64_t n, int64_t d, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * d;
    double sum_sq = 0.0;
    for (int64_t i = 0; i < d; ++i) sum_sq += double(row[i]) * row[i];
    const float inv = 1.0f / std::sqrt(float(sum_sq / double(d)) + eps);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = weight[i] * (row[i] * inv);
  }
}

void layer_norm(const float* x, int64_t n, int64_t d, const float* weight, const float* bias,
                float eps, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * d;
    double mean = 0.0;
    for (int64_t i = 0; i < d; ++i) mean += row[i];
    mean /= double(d);
    double var = 0.0;
    for (int64_t i = 0; i < d; ++i) var += (row[i] - mean) * (row[i] - mean);
    const double inv = 1.0 / std::sqrt(var / double(d) + eps);
    for (int64_t i = 0; i < d; ++i)
      out[r * d + i] = float((row[i] - mean) * inv) * weight[i] + bias[i];
  }
}

void silu_mul(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void softmax(float* x, int64_t n) {
  const float max = *std::max_element(x, x + n);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace colibri::kernels
