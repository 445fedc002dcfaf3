// Internals of the NVFP4 int8-activation kernels (linear.h, linear_nvfp4_int8), shared by
// nvfp4.cpp (activations, scalar reference, dispatch) and the per-ISA files. Declarations only,
// for the reason given in quant_detail.h.
//
// The operations, the same on every ISA (so all agree bit for bit with the scalar reference):
//   - Activations: each row quantized by the container's rule (quant_int8_detail.h: blocks of 64
//     inputs, s_k = amax_k / 127, q = rint(x / s_k)); per 16-column block b of the weights,
//     s_b = s_{b/4} * (global * 128).
//   - Weights: an E2M1 code times 2 is an integer in [-12, 12]; d_b = sum over the block of
//     (2 * e2m1) * q, exact in int32. The block's E4M3 scale as e_b = e4m3 * 2^-8 (exact).
//   - Per output: 16 fp32 partial sums, block b into sum b % 16, blocks in ascending order,
//     acc = fma(float(d_b), e_b * s_b, acc) (the product rounded once); then
//     y = ((a0 + a8) + (a4 + a12)) + ((a2 + a10) + (a6 + a14)) + (the same from a1, a3, ...), the
//     tree of halves: a[i] + a[i + 8], then + [i + 4], + [i + 2], + [i + 1].
//   So y = sum of e2m1 * e4m3 * global * (q * s_k) over the row: the fp32 path's product
//   (linear_nvfp4) with each input rounded to a multiple of its block's s_k (an error of at most
//   s_k / 2 = amax_k / 254), and fp32 rounding in another order.
//
// Activation layout (what the SIMD kernels read): the row in super-steps of 256 columns (16
// blocks; the last one padded with zero blocks). A super-step is 4 vectors of 64 bytes A, B, C,
// D and 16 int32 biases and 16 float scales; lane L (bytes 4L .. 4L + 3) of each vector belongs
// to block L of the super-step, byte k of it to column 2k (A), 2k + 1 (B), 8 + 2k (C), 9 + 2k (D)
// of that block: the order in which the kernels meet the low and high nibbles of the block's
// first and last 4 code bytes. The bias of a block is -12 * (sum of its q): the kernels multiply
// the unsigned 2 * e2m1 + 12 by q. A 128-column step of the AVX2 kernel reads half of each.
#pragma once

#include <cstdint>

#include "cpu/linear.h"

namespace colibri::kernels::detail {

inline constexpr int64_t kNvfp4Block = 16;       // columns per E4M3 scale
inline constexpr int64_t kNvfp4SuperStep = 256;  // columns per super-step: 16 blocks
inline constexpr int kNvfp4Sums = 16;            // partial sums per output

// Quantized activations of n rows of cols inputs, laid out as above.
struct Nvfp4Activations {
  int64_t n, cols, steps;  // steps = ceil(cols / 256)
  const int8_t* q;         // [n, steps * 256], the layout above
  const int32_t* bias;     // [n, steps * 16]
  const float* scale;      // [n, steps * 16]: s_b (0 for padded blocks)
};

// Rows [row_begin, row_end) of y: y[t * y_stride + o] for every t < x.n, as above.
using Nvfp4Int8Kernel = void (*)(const Nvfp4Weights& w, const Nvfp4Activations& x, float* y,
                                 int64_t y_stride, int64_t row_begin, int64_t row_end);

// pmaddubsw + pmaddwd on ymm (every AVX2 CPU, and AVX-512 ones without VNNI or with it off).
void nvfp4_int8_rows_avx2(const Nvfp4Weights& w, const Nvfp4Activations& x, float* y,
                          int64_t y_stride, int64_t row_begin, int64_t row_end);
// vpdpbusd on zmm (AVX-512 VNNI).
void nvfp4_int8_rows_avx512vnni(const Nvfp4Weights& w, const Nvfp4Activations& x, float* y,
                                int64_t y_stride, int64_t row_begin, int64_t row_end);

// Row `row` of w widened to fp32 (dequantize_nvfp4's values) into out [w.cols]: the fp32 path's
// weights, decoded once for every row of a batch.
void nvfp4_widen_row_avx2(const Nvfp4Weights& w, int64_t row, float* out);
void nvfp4_widen_row_avx512(const Nvfp4Weights& w, int64_t row, float* out);

}  // namespace colibri::kernels::detail
