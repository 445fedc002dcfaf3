#include "cpu/linear.h"

namespace colibri::kernels {

float dot_f32(const float* a, const float* b, int64_t n) {
  float partial[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) partial[k] += a[i + k] * b[i + k];
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum + ((partial[0] + partial[4]) + (partial[1] + partial[5])) +
         ((partial[2] + partial[6]) + (partial[3] + partial[7]));
}

void linear_f32(const float* x, int64_t n, const float* w, int64_t rows, int64_t cols, float* y) {
  // Weight row outer, token inner: each weight row is read from memory once per call and reused
  // from cache for every token, so a batch of n rows costs about one pass over the weights.
#pragma omp parallel for schedule(static) collapse(2) if (rows * cols * n > (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < n; ++t) y[t * rows + r] = dot_f32(x + t * cols, w + r * cols, cols);
}

}  // namespace colibri::kernels
