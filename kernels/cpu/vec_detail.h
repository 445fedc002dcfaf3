// Per-ISA fp32 vector primitives behind dot_f32 and axpy_f32 (linear.h). Declarations only, for
// the reason given in quant_detail.h: the ISA files are compiled with their own -m flags.
#pragma once

#include <cstdint>

#include "cpu/linear.h"

namespace colibri::kernels::detail {

// One row of FP8 E4M3 weights from column `col` on, with its block row's scales: column j has
// scale scales[j / block_cols], that is scales[j >> block_shift] when block_cols is a power of two
// (block_shift >= 0; -1 otherwise). Plain data: each ISA file keeps its own helpers for it.
struct Fp8Row {
  const uint8_t* bits;
  const float* scales;
  int64_t col;
  int64_t block_cols;
  int block_shift;
};

// One row of NVFP4 weights (ModelOpt) from column `col` on: two E2M1 codes a byte, column c in
// the low nibble of codes[c / 2] when c is even, the high one when odd; one FP8 E4M3 scale a block
// of 16 columns, scales[c / 16]; the tensor's fp32 second-level scale. Column c's weight is
// (e2m1 * e4m3, exact in fp32) * global, rounded once. Plain data, like Fp8Row.
struct Nvfp4Row {
  const uint8_t* codes;
  const uint8_t* scales;
  float global;
  int64_t col;
};

// The 16 E2M1 values by code: bit 3 the sign, the low three bits 0, 0.5, 1, 1.5, 2, 3, 4, 6.
inline constexpr float kE2m1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// An FP8 E4M3 byte (not a NaN) exactly: its magnitude bits in an fp32's exponent and mantissa
// fields times 2^120, subnormals included.
inline float e4m3_value(uint8_t byte) {
  const uint32_t bits = (uint32_t(byte & 0x7F) << 20) | (uint32_t(byte & 0x80) << 24);
  float v;
  __builtin_memcpy(&v, &bits, 4);
  return v * 0x1p120f;
}

// Column p.col's weight.
inline float nvfp4_value(const Nvfp4Row& p) {
  const uint8_t byte = p.codes[p.col >> 1];
  const float e2m1 = kE2m1Values[(p.col & 1) ? byte >> 4 : byte & 0x0F];
  return e2m1 * e4m3_value(p.scales[p.col >> 4]) * p.global;
}
inline void prefetch_row_ahead(const Nvfp4Row&) {}

// kv_b_proj's BF16 and int8 rows (dot_bf16/dot_i8, axpy_bf16/axpy_i8) are read one contiguous
// row after another from memory: their kernels prefetch this many bytes ahead, as the quantized
// linears do (the hardware prefetcher alone kept one thread near half its read bandwidth on them).
constexpr int64_t kRowPrefetchBytes = 4096;

// Prefetches the cache line `kRowPrefetchBytes` past p for the kv_b operand types; nothing for
// fp32 and FP8 (attention keys gathered by slot, and dense rows read elsewhere).
template <typename T>
inline void prefetch_row_ahead(const T* p) {
  if constexpr (sizeof(T) <= 2)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + kRowPrefetchBytes, 0, 3);
}
inline void prefetch_row_ahead(const Fp8Row&) {}

float dot_avx2(const float* a, const float* b, int64_t n);
void dot_rows_avx2(const float* const* a, int64_t count, const float* b, int64_t n, float* out);
float dot_avx512(const float* a, const float* b, int64_t n);
float dot_bf16_avx2(const float* a, const uint16_t* b, int64_t n);
float dot_bf16_avx512(const float* a, const uint16_t* b, int64_t n);
float dot_fp8_avx2(const float* a, Fp8Row b, int64_t n);
float dot_fp8_avx512(const float* a, Fp8Row b, int64_t n);
float dot_nvfp4_avx2(const float* a, Nvfp4Row b, int64_t n);
float dot_nvfp4_avx512(const float* a, Nvfp4Row b, int64_t n);
float dot_i8_avx2(const int8_t* a, const float* b, int64_t n);
float dot_i8_avx512(const int8_t* a, const float* b, int64_t n);
void axpy_bf16_avx2(float alpha, const uint16_t* x, float* y, int64_t n);
void axpy_bf16_avx512(float alpha, const uint16_t* x, float* y, int64_t n);
void axpy_i8_avx2(float alpha, const int8_t* x, float* y, int64_t n);
void axpy_i8_avx512(float alpha, const int8_t* x, float* y, int64_t n);
void axpy_rows_f32_avx2(const AxpyRows& a, const float* x);
void axpy_rows_f32_avx512(const AxpyRows& a, const float* x);
void axpy_rows_bf16_avx2(const AxpyRows& a, const uint16_t* x);
void axpy_rows_bf16_avx512(const AxpyRows& a, const uint16_t* x);
void axpy_rows_i8_avx2(const AxpyRows& a, const int8_t* x);
void axpy_rows_i8_avx512(const AxpyRows& a, const int8_t* x);
void axpy_avx2(float alpha, const float* x, float* y, int64_t n);
void index_scores_avx2(const IndexQuery& q, const float* keys, const int32_t* rows, int64_t count,
                       float* out);
void axpy_avx512(float alpha, const float* x, float* y, int64_t n);

}  // namespace colibri::kernels::detail
