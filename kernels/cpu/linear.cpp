#include "cpu/linear.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/quant.h"
#include "cpu/vec_detail.h"

#if defined(__x86_64__) || defined(_M_X64)
#define COLIBRI_VEC_X86 1
#else
#define COLIBRI_VEC_X86 0
#endif

namespace colibri::kernels {
namespace {

using DotFn = float (*)(const float*, const float*, int64_t);
using DotBf16Fn = float (*)(const float*, const uint16_t*, int64_t);
using AxpyFn = void (*)(float, const float*, float*, int64_t);

DotFn dot_kernel(QuantIsa isa) {
#if COLIBRI_VEC_X86
  if (isa == QuantIsa::kAvx512) return detail::dot_avx512;
  if (isa == QuantIsa::kAvx2) return detail::dot_avx2;
#endif
  return dot_f32_scalar;
}

DotBf16Fn dot_bf16_kernel(QuantIsa isa) {
#if COLIBRI_VEC_X86
  if (isa == QuantIsa::kAvx512) return detail::dot_bf16_avx512;
  if (isa == QuantIsa::kAvx2) return detail::dot_bf16_avx2;
#endif
  return dot_bf16_scalar;
}

AxpyFn axpy_kernel(QuantIsa isa) {
#if COLIBRI_VEC_X86
  if (isa == QuantIsa::kAvx512) return detail::axpy_avx512;
  if (isa == QuantIsa::kAvx2) return detail::axpy_avx2;
#endif
  return axpy_f32_scalar;
}

// Resolved once, like the quantized kernels' ISA (COLIBRI_ISA caps it).
DotFn selected_dot() {
  static const DotFn fn = dot_kernel(quant_isa_selected());
  return fn;
}
DotBf16Fn selected_dot_bf16() {
  static const DotBf16Fn fn = dot_bf16_kernel(quant_isa_selected());
  return fn;
}
AxpyFn selected_axpy() {
  static const AxpyFn fn = axpy_kernel(quant_isa_selected());
  return fn;
}

void require_available(QuantIsa isa) {
  if (!quant_isa_available(isa))
    throw std::invalid_argument(std::string("vector kernels: ISA ") + quant_isa_name(isa) +
                                " is not available on this CPU or in this build");
}

}  // namespace

namespace {

inline float value(const float* p) {
  return *p;
}
inline float value(const uint16_t* p) {
  const uint32_t bits = uint32_t(*p) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

template <typename B>
float dot_scalar(const float* a, const B* b, int64_t n) {
  float partial[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) partial[k] += a[i + k] * value(b + i + k);
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * value(b + i);
  return sum + ((partial[0] + partial[4]) + (partial[1] + partial[5])) +
         ((partial[2] + partial[6]) + (partial[3] + partial[7]));
}

}  // namespace

float dot_f32_scalar(const float* a, const float* b, int64_t n) {
  return dot_scalar(a, b, n);
}

float dot_bf16_scalar(const float* a, const uint16_t* b, int64_t n) {
  return dot_scalar(a, b, n);
}

float dot_bf16(const float* a, const uint16_t* b, int64_t n) {
  return selected_dot_bf16()(a, b, n);
}

float dot_bf16(QuantIsa isa, const float* a, const uint16_t* b, int64_t n) {
  require_available(isa);
  return dot_bf16_kernel(isa)(a, b, n);
}

void axpy_f32_scalar(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

float dot_f32(const float* a, const float* b, int64_t n) {
  return selected_dot()(a, b, n);
}

void axpy_f32(float alpha, const float* x, float* y, int64_t n) {
  selected_axpy()(alpha, x, y, n);
}

float dot_f32(QuantIsa isa, const float* a, const float* b, int64_t n) {
  require_available(isa);
  return dot_kernel(isa)(a, b, n);
}

void axpy_f32(QuantIsa isa, float alpha, const float* x, float* y, int64_t n) {
  require_available(isa);
  axpy_kernel(isa)(alpha, x, y, n);
}

void linear_f32(const float* x, int64_t n, const float* w, int64_t rows, int64_t cols, float* y) {
  const DotFn dot = selected_dot();
  // Weight row outer, token inner: each weight row is read from memory once per call and reused
  // from cache for every token, so a batch of n rows costs about one pass over the weights.
#pragma omp parallel for schedule(static) collapse(2) if (rows * cols * n > (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < n; ++t) y[t * rows + r] = dot(x + t * cols, w + r * cols, cols);
}

void linear_bf16(const float* x, int64_t n, const uint16_t* w, int64_t rows, int64_t cols,
                 float* y) {
  const DotBf16Fn dot = selected_dot_bf16();
#pragma omp parallel for schedule(static) collapse(2) if (rows * cols * n > (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < n; ++t) y[t * rows + r] = dot(x + t * cols, w + r * cols, cols);
}

}  // namespace colibri::kernels
