// Per-ISA fp32 vector primitives behind dot_f32 and axpy_f32 (linear.h). Declarations only, for
// the reason given in quant_detail.h: the ISA files are compiled with their own -m flags.
#pragma once

#include <cstdint>

#include "cpu/linear.h"

namespace colibri::kernels::detail {

float dot_avx2(const float* a, const float* b, int64_t n);
float dot_avx512(const float* a, const float* b, int64_t n);
float dot_bf16_avx2(const float* a, const uint16_t* b, int64_t n);
float dot_bf16_avx512(const float* a, const uint16_t* b, int64_t n);
float dot_i8_avx2(const int8_t* a, const float* b, int64_t n);
float dot_i8_avx512(const int8_t* a, const float* b, int64_t n);
void axpy_bf16_avx2(float alpha, const uint16_t* x, float* y, int64_t n);
void axpy_bf16_avx512(float alpha, const uint16_t* x, float* y, int64_t n);
void axpy_i8_avx2(float alpha, const int8_t* x, float* y, int64_t n);
void axpy_i8_avx512(float alpha, const int8_t* x, float* y, int64_t n);
void axpy_rows_f32_avx512(const AxpyRows& a, const float* x);
void axpy_rows_bf16_avx512(const AxpyRows& a, const uint16_t* x);
void axpy_rows_i8_avx512(const AxpyRows& a, const int8_t* x);
void axpy_avx2(float alpha, const float* x, float* y, int64_t n);
void axpy_avx512(float alpha, const float* x, float* y, int64_t n);

}  // namespace colibri::kernels::detail
