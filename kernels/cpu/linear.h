// Dense fp32 linear layers and vector primitives: the production path for fp32 weights
// (attention, kv_b_proj's absorbed products, fp32 checkpoints' projections, lm_head). Each
// primitive has a scalar reference and AVX2+FMA / AVX-512 variants, chosen once at run time with
// the quantized kernels' ISA (quant.h: the best the CPU has, capped by COLIBRI_ISA). Quantized
// weights use quant.h.
#pragma once

#include <cstdint>

#include "cpu/quant.h"

namespace colibri::kernels {

// y[n, rows] = x[n, cols] · w[rows, cols]^T, accumulated in fp32. OpenMP over output rows; each
// output is one dot_f32, so a row's result does not depend on n.
void linear_f32(const float* x, int64_t n, const float* w, int64_t rows, int64_t cols, float* y);

// BF16 weights as stored (the upper 16 bits of an fp32): y[n, rows] = x[n, cols] · w^T with each
// weight widened exactly to fp32 in registers, the same products and the same summation order as
// linear_f32 on the widened matrix, so the results are bit for bit those of the fp32 copy at half
// its bytes.
void linear_bf16(const float* x, int64_t n, const uint16_t* w, int64_t rows, int64_t cols,
                 float* y);
// dot_f32(a, widened b, n), bit for bit.
float dot_bf16(const float* a, const uint16_t* b, int64_t n);
float dot_bf16_scalar(const float* a, const uint16_t* b, int64_t n);
float dot_bf16(QuantIsa isa, const float* a, const uint16_t* b, int64_t n);

// FP8 E4M3 weights as stored, with their block scales (DeepSeek-V3 / GLM-5 FP8 checkpoints):
// w[i, j] = e4m3(bits[i, j]) * scales[(i / block_rows) * ceil(cols / block_cols) + j / block_cols],
// each weight widened exactly and scaled in registers (the product rounded once, as the
// loader's dequantization rounds it), then linear_f32's products and summation order: bit for
// bit the dequantized fp32 copy, at a quarter of its bytes. block_cols is a multiple of 16 (else
// std::invalid_argument); no byte may be a NaN (S.1111.111): the loader refuses those.
struct Fp8Weights {
  const uint8_t* bits;
  const float* scales;
  int64_t rows, cols;
  int64_t block_rows, block_cols;
};
void linear_fp8(const float* x, int64_t n, const Fp8Weights& w, float* y);
// dot_f32(a, one dequantized row, n): `scales` are the row's block scales.
float dot_fp8(const float* a, const uint8_t* b, const float* scales, int64_t block_cols, int64_t n);
float dot_fp8_scalar(const float* a, const uint8_t* b, const float* scales, int64_t block_cols,
                     int64_t n);
float dot_fp8(QuantIsa isa, const float* a, const uint8_t* b, const float* scales,
              int64_t block_cols, int64_t n);

// NVFP4 weights as stored (NVIDIA ModelOpt checkpoints): `codes` [rows, cols / 2], two E2M1 codes
// a byte (column 2j in the low nibble of byte j, 2j + 1 in the high one; bit 3 the sign, the low
// three bits 0, 0.5, 1, 1.5, 2, 3, 4, 6), `scales` [rows, cols / 16] FP8 E4M3 bytes (none a NaN),
// one a block of 16 columns, and `global` the tensor's fp32 second-level scale (weight_scale_2):
// w[i, j] = (e2m1 * e4m3, exact in fp32) * global, rounded once, widened in registers; then
// linear_f32's products and summation order, so bit for bit the fp32 kernels on the dequantized
// matrix, at 4.5 bits a weight. cols must be a positive multiple of 16 (else
// std::invalid_argument).
struct Nvfp4Weights {
  const uint8_t* codes;
  const uint8_t* scales;
  float global;
  int64_t rows, cols;
};
// For a batch (n > 1) each weight row is widened once for every input row.
void linear_nvfp4(const float* x, int64_t n, const Nvfp4Weights& w, float* y);
void linear_nvfp4(QuantIsa isa, const float* x, int64_t n, const Nvfp4Weights& w, float* y);
// The same product with int8 activations: each row of x quantized by the container's rule
// (quant.h, "int8 activations": blocks of 64 inputs, s = amax / 127), each 16-column block's
// sum of (2 * e2m1) * q exact in int32 (vpdpbusd with AVX-512 VNNI, else pmaddubsw), then scaled
// by e4m3 * global * s in fp32 (cpu/nvfp4_detail.h has the operations and their order). Every
// ISA gives the scalar reference's bits (isa kScalar), and a row's result does not depend on n or
// the thread count. Against the exact product y = sum of w_i * x_i (w: dequantize_nvfp4's
// weights), each input is rounded to a multiple of its block's s, so
//   |y_int8 - y| <= sum over i of |w_i| * amax_k(i) / 254
// plus the fp32 roundings (the scale product, a partial sum's cols / 256 fused multiply-adds, the
// 4 levels of the final sum): to first order (cols / 256 + 6) * 2^-24 * sum of |w_i * q_i * s_k|.
void linear_nvfp4_int8(const float* x, int64_t n, const Nvfp4Weights& w, float* y);
void linear_nvfp4_int8(QuantIsa isa, const float* x, int64_t n, const Nvfp4Weights& w, float* y);
// Whether linear_nvfp4_int8 on `isa` uses VNNI now (AVX-512 VNNI, set_vnni in quant.h).
bool nvfp4_int8_vnni(QuantIsa isa);
// Whether linear_nvfp4_selected takes int8 activations: COLIBRI_ACTIVATIONS as the container's
// kernels read it (quant_activations_selected: int8 or mixed, NVFP4 being 4-bit weights; f32 not).
bool nvfp4_int8_activations();
// linear_nvfp4_int8 or linear_nvfp4, by nvfp4_int8_activations().
void linear_nvfp4_selected(const float* x, int64_t n, const Nvfp4Weights& w, float* y);
// dot_f32(a, row `row` of w dequantized, w.cols); on an explicit ISA, and the scalar reference.
float dot_nvfp4(const float* a, const Nvfp4Weights& w, int64_t row);
float dot_nvfp4(QuantIsa isa, const float* a, const Nvfp4Weights& w, int64_t row);
float dot_nvfp4_scalar(const float* a, const Nvfp4Weights& w, int64_t row);
// out [rows, cols] = w, each element as the kernels widen it.
void dequantize_nvfp4(const Nvfp4Weights& w, float* out);
// The ModelOpt recipe (NVFP4QTensor), from w [rows, cols] (fp32): global = amax(|w|) / (6 * 448);
// each block's scale = its amax / (6 * global), a zero one 1.0, rounded to the nearest E4M3 (ties
// to even; at most 448); each code the nearest E2M1 (ties to even) of w / (scale * global), the
// sign bit set for every negative w (-0 where it rounds to 0); codes 0 for an all-zero matrix
// (global 0). `codes` [rows * cols / 2], `scales` [rows * cols / 16]; returns global.
float quantize_nvfp4(const float* w, int64_t rows, int64_t cols, uint8_t* codes, uint8_t* scales);
// The nearest E4M3 byte (ties to even, saturating at 448; x >= 0) and E2M1 code (ties to even,
// saturating at 6; the sign bit for x < 0) of a float: the rounding the recipe uses.
uint8_t f32_to_e4m3(float x);
uint8_t f32_to_e2m1(float x);

// Rows of MLA's kv_b_proj kept as stored (the absorbed attention reads them one row at a time):
// y[i] += alpha * widen(x[i]) for BF16 and alpha * float(x[i]) for int8, with the fp32 axpy's
// rounding (one fused multiply-add per element); dot_i8 = sum of float(a[i]) * b[i] in dot_f32's
// order, so it equals dot_f32 on the int8 values converted to fp32.
void axpy_bf16(float alpha, const uint16_t* x, float* y, int64_t n);
void axpy_i8(float alpha, const int8_t* x, float* y, int64_t n);
float dot_i8(const int8_t* a, const float* b, int64_t n);
void axpy_bf16(QuantIsa isa, float alpha, const uint16_t* x, float* y, int64_t n);
void axpy_i8(QuantIsa isa, float alpha, const int8_t* x, float* y, int64_t n);
float dot_i8(QuantIsa isa, const int8_t* a, const float* b, int64_t n);

// Many rows at once: for t < n, for k = 0 .. K-1 in order,
//   y[t * y_stride + 0 .. m) += alpha[t * a_stride + k] * x_scale[k] * x[row(k) * m + 0 .. m)
// with x fp32, BF16 or int8 (x_scale: the int8 rows' scales, nullptr for 1) and row(k) = k, or
// x_rows[k] when given (keys gathered from a cache). Each row's result is
// bit for bit that of K axpy calls (the product alpha * x_scale rounded first, then one fused
// multiply-add per element), but X's rows are read once for every t: on AVX-512, 4 rows of y by
// 64 columns stay in registers across k.
struct AxpyRows {
  const float* alpha;
  int64_t a_stride;
  int64_t n, k, m;
  const float* x_scale;
  float* y;
  int64_t y_stride;
  const int32_t* x_rows = nullptr;
  // Fetch X's rows a few ahead (rows scattered in memory); false for rows already in cache.
  bool fetch_ahead = true;
  int64_t row(int64_t term) const { return x_rows ? x_rows[term] : term; }
};
void axpy_rows_f32(const AxpyRows& a, const float* x);
void axpy_rows_bf16(const AxpyRows& a, const uint16_t* x);
void axpy_rows_i8(const AxpyRows& a, const int8_t* x);

// Dot product of two fp32 vectors on the selected ISA.
float dot_f32(const float* a, const float* b, int64_t n);
// out[j] = dot_f32(a[j], b, n) for j < count, bit for bit: on AVX2, b is loaded once for three
// rows of a at a time (attention scores: several heads against one key).
void dot_f32_rows(const float* const* a, int64_t count, const float* b, int64_t n, float* out);
void dot_f32_rows(QuantIsa isa, const float* const* a, int64_t count, const float* b, int64_t n,
                  float* out);
// y[i] += alpha * x[i] on the selected ISA.
void axpy_f32(float alpha, const float* x, float* y, int64_t n);

// DSA index scores of `count` cached keys (row rows[i] of `keys`, each `dim` wide):
//   out[i] = sum over h < heads of weights[h] * max(scale * dot(q_h, key), 0)
// with the queries transposed, q_t[d * heads + h], and heads a multiple of 8 (pad with zero
// queries and weights). The sums run in another order than dot_f32's: on AVX2 a key is
// broadcast against 8 heads at once, 4 keys at a time, with no horizontal sum per head.
struct IndexQuery {
  const float* q_t;
  const float* weights;
  int64_t heads, dim;
  float scale;
};
void index_scores(const IndexQuery& q, const float* keys, const int32_t* rows, int64_t count,
                  float* out);
void index_scores(QuantIsa isa, const IndexQuery& q, const float* keys, const int32_t* rows,
                  int64_t count, float* out);

// The scalar references: 8 partial sums (vectorisable without -ffast-math), and a plain loop.
float dot_f32_scalar(const float* a, const float* b, int64_t n);
void axpy_f32_scalar(float alpha, const float* x, float* y, int64_t n);
void index_scores_scalar(const IndexQuery& q, const float* keys, const int32_t* rows, int64_t count,
                         float* out);

// On an explicit ISA, for tests and benchmarks (std::invalid_argument when not available).
float dot_f32(QuantIsa isa, const float* a, const float* b, int64_t n);
void axpy_f32(QuantIsa isa, float alpha, const float* x, float* y, int64_t n);

}  // namespace colibri::kernels
