// Dense fp32 linear layers: the production path for fp32 weights (attention, dense MLPs, shared
// experts, lm_head), portable C++ that the compiler vectorises. Quantized weights use quant.h.
#pragma once

#include <cstdint>

namespace colibri::kernels {

// y[n, rows] = x[n, cols] · w[rows, cols]^T, accumulated in fp32. OpenMP over output rows; each
// output is one dot_f32, so a row's result does not depend on n.
void linear_f32(const float* x, int64_t n, const float* w, int64_t rows, int64_t cols, float* y);

// Dot product of two fp32 vectors with 8 partial sums (vectorisable without -ffast-math).
float dot_f32(const float* a, const float* b, int64_t n);

}  // namespace colibri::kernels
