// Dense fp32 linear layers: the scalar reference that every faster kernel is tested against.
#pragma once

#include <cstdint>

namespace colibri::kernels {

// y[n, rows] = x[n, cols] · w[rows, cols]^T, accumulated in fp32. OpenMP over output rows.
void linear_f32(const float* x, int64_t n, const float* w, int64_t rows, int64_t cols, float* y);

// Dot product of two fp32 vectors with 8 partial sums (vectorisable without -ffast-math).
float dot_f32(const float* a, const float* b, int64_t n);

}  // namespace colibri::kernels
