#include "cpu/linear.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/nvfp4_detail.h"
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
inline float value(const int8_t* p) {
  return float(*p);
}
inline float value(const uint16_t* p) {
  const uint32_t bits = uint32_t(*p) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

inline detail::Fp8Row operator+(detail::Fp8Row p, int64_t i) {
  return {p.bits + i, p.scales, p.col + i, p.block_cols, p.block_shift};
}
inline float value(detail::Fp8Row p) {  // exact for every E4M3 value but NaN, then scaled
  const uint32_t bits = (uint32_t(*p.bits & 0x7F) << 20) | (uint32_t(*p.bits & 0x80) << 24);
  float v;
  std::memcpy(&v, &bits, 4);
  return v * 0x1p120f *
         p.scales[p.block_shift >= 0 ? p.col >> p.block_shift : p.col / p.block_cols];
}

inline detail::Nvfp4Row operator+(detail::Nvfp4Row p, int64_t i) {
  return {p.codes, p.scales, p.global, p.col + i};
}
inline float value(detail::Nvfp4Row p) {
  return detail::nvfp4_value(p);
}

template <typename B>  // B: a pointer to the operand type, an Fp8Row or an Nvfp4Row
float dot_scalar(const float* a, B b, int64_t n) {
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

namespace {

using DotFp8Fn = float (*)(const float*, detail::Fp8Row, int64_t);
float dot_fp8_row_scalar(const float* a, detail::Fp8Row b, int64_t n) {
  return dot_scalar(a, b, n);
}
DotFp8Fn dot_fp8_kernel(QuantIsa isa) {
#if COLIBRI_VEC_X86
  if (isa == QuantIsa::kAvx512) return detail::dot_fp8_avx512;
  if (isa == QuantIsa::kAvx2) return detail::dot_fp8_avx2;
#endif
  return dot_fp8_row_scalar;
}
DotFp8Fn selected_dot_fp8() {
  static const DotFp8Fn fn = dot_fp8_kernel(quant_isa_selected());
  return fn;
}
detail::Fp8Row fp8_row(const uint8_t* bits, const float* scales, int64_t block_cols) {
  const bool power_of_two = (block_cols & (block_cols - 1)) == 0;
  return {bits, scales, 0, block_cols, power_of_two ? __builtin_ctzll(uint64_t(block_cols)) : -1};
}
void require_fp8_blocks(int64_t block_cols) {
  if (block_cols <= 0 || block_cols % 16 != 0)
    throw std::invalid_argument("FP8 kernels: block_cols " + std::to_string(block_cols) +
                                " is not a positive multiple of 16");
}

}  // namespace

float dot_fp8(const float* a, const uint8_t* b, const float* scales, int64_t block_cols,
              int64_t n) {
  require_fp8_blocks(block_cols);
  return selected_dot_fp8()(a, fp8_row(b, scales, block_cols), n);
}
float dot_fp8_scalar(const float* a, const uint8_t* b, const float* scales, int64_t block_cols,
                     int64_t n) {
  require_fp8_blocks(block_cols);
  return dot_fp8_row_scalar(a, fp8_row(b, scales, block_cols), n);
}
float dot_fp8(QuantIsa isa, const float* a, const uint8_t* b, const float* scales,
              int64_t block_cols, int64_t n) {
  require_available(isa);
  require_fp8_blocks(block_cols);
  return dot_fp8_kernel(isa)(a, fp8_row(b, scales, block_cols), n);
}

float dot_bf16(QuantIsa isa, const float* a, const uint16_t* b, int64_t n) {
  require_available(isa);
  return dot_bf16_kernel(isa)(a, b, n);
}

void axpy_f32_scalar(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

namespace {

template <typename X>
void axpy_scalar(float alpha, const X* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * value(x + i);
}

// The kernels of one operand type on an ISA: {scalar, AVX2, AVX-512}.
template <typename Fn>
Fn pick(QuantIsa isa, Fn scalar, Fn avx2, Fn avx512) {
#if COLIBRI_VEC_X86
  if (isa == QuantIsa::kAvx512) return avx512;
  if (isa == QuantIsa::kAvx2) return avx2;
#endif
  (void)avx2;
  (void)avx512;
  return scalar;
}

using AxpyBf16Fn = void (*)(float, const uint16_t*, float*, int64_t);
using AxpyI8Fn = void (*)(float, const int8_t*, float*, int64_t);
using DotI8Fn = float (*)(const int8_t*, const float*, int64_t);

AxpyBf16Fn axpy_bf16_kernel(QuantIsa isa) {
  return pick<AxpyBf16Fn>(isa, axpy_scalar<uint16_t>, detail::axpy_bf16_avx2,
                          detail::axpy_bf16_avx512);
}
AxpyI8Fn axpy_i8_kernel(QuantIsa isa) {
  return pick<AxpyI8Fn>(isa, axpy_scalar<int8_t>, detail::axpy_i8_avx2, detail::axpy_i8_avx512);
}
float dot_i8_scalar(const int8_t* a, const float* b, int64_t n) {
  return dot_scalar(b, a, n);
}
DotI8Fn dot_i8_kernel(QuantIsa isa) {
  return pick<DotI8Fn>(isa, dot_i8_scalar, detail::dot_i8_avx2, detail::dot_i8_avx512);
}

}  // namespace

void axpy_bf16(float alpha, const uint16_t* x, float* y, int64_t n) {
  static const AxpyBf16Fn fn = axpy_bf16_kernel(quant_isa_selected());
  fn(alpha, x, y, n);
}
void axpy_i8(float alpha, const int8_t* x, float* y, int64_t n) {
  static const AxpyI8Fn fn = axpy_i8_kernel(quant_isa_selected());
  fn(alpha, x, y, n);
}
float dot_i8(const int8_t* a, const float* b, int64_t n) {
  static const DotI8Fn fn = dot_i8_kernel(quant_isa_selected());
  return fn(a, b, n);
}
namespace {

// The reference order: K axpy calls per row of y.
template <typename X, typename Axpy>
void axpy_rows_by_calls(const AxpyRows& a, const X* x, Axpy axpy) {
  for (int64_t t = 0; t < a.n; ++t)
    for (int64_t k = 0; k < a.k; ++k) {
      const float alpha =
          a.x_scale ? a.alpha[t * a.a_stride + k] * a.x_scale[k] : a.alpha[t * a.a_stride + k];
      axpy(alpha, x + a.row(k) * a.m, a.y + t * a.y_stride, a.m);
    }
}

}  // namespace

void axpy_rows_f32(const AxpyRows& a, const float* x) {
#if COLIBRI_VEC_X86
  if (quant_isa_selected() == QuantIsa::kAvx512) return detail::axpy_rows_f32_avx512(a, x);
  if (quant_isa_selected() == QuantIsa::kAvx2 && a.n > 1) return detail::axpy_rows_f32_avx2(a, x);
#endif
  axpy_rows_by_calls(
      a, x, [](float al, const float* xr, float* y, int64_t m) { axpy_f32(al, xr, y, m); });
}
// BF16 and int8 rows are kv_b_proj's: one row of y (decode) takes them in one axpy per row, which
// walks each row in order with its prefetch ahead; the tiles walk columns in strips.
void axpy_rows_bf16(const AxpyRows& a, const uint16_t* x) {
#if COLIBRI_VEC_X86
  if (quant_isa_selected() == QuantIsa::kAvx512 && a.n > 1)
    return detail::axpy_rows_bf16_avx512(a, x);
  if (quant_isa_selected() == QuantIsa::kAvx2 && a.n > 1) return detail::axpy_rows_bf16_avx2(a, x);
#endif
  axpy_rows_by_calls(
      a, x, [](float al, const uint16_t* xr, float* y, int64_t m) { axpy_bf16(al, xr, y, m); });
}
void axpy_rows_i8(const AxpyRows& a, const int8_t* x) {
#if COLIBRI_VEC_X86
  if (quant_isa_selected() == QuantIsa::kAvx512 && a.n > 1)
    return detail::axpy_rows_i8_avx512(a, x);
  if (quant_isa_selected() == QuantIsa::kAvx2 && a.n > 1) return detail::axpy_rows_i8_avx2(a, x);
#endif
  axpy_rows_by_calls(
      a, x, [](float al, const int8_t* xr, float* y, int64_t m) { axpy_i8(al, xr, y, m); });
}

void axpy_bf16(QuantIsa isa, float alpha, const uint16_t* x, float* y, int64_t n) {
  require_available(isa);
  axpy_bf16_kernel(isa)(alpha, x, y, n);
}
void axpy_i8(QuantIsa isa, float alpha, const int8_t* x, float* y, int64_t n) {
  require_available(isa);
  axpy_i8_kernel(isa)(alpha, x, y, n);
}
float dot_i8(QuantIsa isa, const int8_t* a, const float* b, int64_t n) {
  require_available(isa);
  return dot_i8_kernel(isa)(a, b, n);
}

float dot_f32(const float* a, const float* b, int64_t n) {
  return selected_dot()(a, b, n);
}

void axpy_f32(float alpha, const float* x, float* y, int64_t n) {
  selected_axpy()(alpha, x, y, n);
}

namespace {

void dot_rows(QuantIsa isa, const float* const* a, int64_t count, const float* b, int64_t n,
              float* out) {
#if COLIBRI_VEC_X86
  if (isa == QuantIsa::kAvx2) return detail::dot_rows_avx2(a, count, b, n, out);
#endif
  const DotFn dot = dot_kernel(isa);
  for (int64_t j = 0; j < count; ++j) out[j] = dot(a[j], b, n);
}

}  // namespace

void dot_f32_rows(QuantIsa isa, const float* const* a, int64_t count, const float* b, int64_t n,
                  float* out) {
  require_available(isa);
  dot_rows(isa, a, count, b, n, out);
}

void dot_f32_rows(const float* const* a, int64_t count, const float* b, int64_t n, float* out) {
  static const QuantIsa isa = quant_isa_selected();
  dot_rows(isa, a, count, b, n, out);
}

void index_scores_scalar(const IndexQuery& q, const float* keys, const int32_t* rows, int64_t count,
                         float* out) {
  for (int64_t i = 0; i < count; ++i) {
    const float* key = keys + int64_t(rows[i]) * q.dim;
    float score = 0.0f;
    for (int64_t h = 0; h < q.heads; ++h) {
      float qk = 0.0f;
      for (int64_t d = 0; d < q.dim; ++d) qk += q.q_t[d * q.heads + h] * key[d];
      score += q.weights[h] * std::max(q.scale * qk, 0.0f);
    }
    out[i] = score;
  }
}

void index_scores(QuantIsa isa, const IndexQuery& q, const float* keys, const int32_t* rows,
                  int64_t count, float* out) {
  require_available(isa);
  if (q.heads % 8 != 0) throw std::invalid_argument("index_scores: heads must be a multiple of 8");
#if COLIBRI_VEC_X86
  // AVX-512 machines run the AVX2 kernel: the indexer's few heads fill 8 lanes, not 16.
  if (isa != QuantIsa::kScalar) return detail::index_scores_avx2(q, keys, rows, count, out);
#endif
  index_scores_scalar(q, keys, rows, count, out);
}

void index_scores(const IndexQuery& q, const float* keys, const int32_t* rows, int64_t count,
                  float* out) {
  static const QuantIsa isa = quant_isa_selected();
  index_scores(isa, q, keys, rows, count, out);
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

void linear_fp8(const float* x, int64_t n, const Fp8Weights& w, float* y) {
  require_fp8_blocks(w.block_cols);
  if (w.block_rows <= 0) throw std::invalid_argument("FP8 kernels: block_rows must be positive");
  const DotFp8Fn dot = selected_dot_fp8();
  const int64_t rows = w.rows, cols = w.cols;
  const int64_t scale_cols = (cols + w.block_cols - 1) / w.block_cols;
#pragma omp parallel for schedule(static) collapse(2) if (rows * cols * n > (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < n; ++t)
      y[t * rows + r] =
          dot(x + t * cols,
              fp8_row(w.bits + r * cols, w.scales + (r / w.block_rows) * scale_cols, w.block_cols),
              cols);
}

// ---- NVFP4 ------------------------------------------------------------------------------------

namespace {

using DotNvfp4Fn = float (*)(const float*, detail::Nvfp4Row, int64_t);
float dot_nvfp4_row_scalar(const float* a, detail::Nvfp4Row b, int64_t n) {
  return dot_scalar(a, b, n);
}
DotNvfp4Fn dot_nvfp4_kernel(QuantIsa isa) {
#if COLIBRI_VEC_X86
  if (isa == QuantIsa::kAvx512) return detail::dot_nvfp4_avx512;
  if (isa == QuantIsa::kAvx2) return detail::dot_nvfp4_avx2;
#endif
  return dot_nvfp4_row_scalar;
}
DotNvfp4Fn selected_dot_nvfp4() {
  static const DotNvfp4Fn fn = dot_nvfp4_kernel(quant_isa_selected());
  return fn;
}
void require_nvfp4(const Nvfp4Weights& w) {
  if (w.cols <= 0 || w.cols % 16 != 0 || w.rows < 0)
    throw std::invalid_argument("NVFP4 kernels: cols " + std::to_string(w.cols) +
                                " is not a positive multiple of 16 (or rows " +
                                std::to_string(w.rows) + " < 0)");
  if (w.rows > 0 && (!w.codes || !w.scales))
    throw std::invalid_argument("NVFP4 kernels: null codes or scales");
}
detail::Nvfp4Row nvfp4_row(const Nvfp4Weights& w, int64_t row) {
  return {w.codes + row * (w.cols / 2), w.scales + row * (w.cols / 16), w.global, 0};
}

// The nearest of `values` (ascending, non-negative) to x >= 0, ties to the even index; the last
// when beyond it.
int nearest(const float* values, size_t N, float x) {
  size_t i = 0;
  while (i + 1 < N && values[i + 1] <= x) ++i;
  if (i + 1 == N) return int(i);
  const float below = x - values[i], above = values[i + 1] - x;
  if (below < above) return int(i);
  if (above < below) return int(i + 1);
  return int(i % 2 == 0 ? i : i + 1);
}

}  // namespace

float dot_nvfp4(const float* a, const Nvfp4Weights& w, int64_t row) {
  require_nvfp4(w);
  return selected_dot_nvfp4()(a, nvfp4_row(w, row), w.cols);
}
float dot_nvfp4(QuantIsa isa, const float* a, const Nvfp4Weights& w, int64_t row) {
  require_available(isa);
  require_nvfp4(w);
  return dot_nvfp4_kernel(isa)(a, nvfp4_row(w, row), w.cols);
}
float dot_nvfp4_scalar(const float* a, const Nvfp4Weights& w, int64_t row) {
  require_nvfp4(w);
  return dot_nvfp4_row_scalar(a, nvfp4_row(w, row), w.cols);
}

namespace {

using WidenNvfp4Fn = void (*)(const Nvfp4Weights&, int64_t, float*);
void widen_nvfp4_row_scalar(const Nvfp4Weights& w, int64_t row, float* out) {
  const detail::Nvfp4Row p = nvfp4_row(w, row);
  for (int64_t c = 0; c < w.cols; ++c) out[c] = value(p + c);
}
WidenNvfp4Fn widen_nvfp4_kernel(QuantIsa isa) {
#if COLIBRI_VEC_X86
  if (isa == QuantIsa::kAvx512) return detail::nvfp4_widen_row_avx512;
  if (isa == QuantIsa::kAvx2) return detail::nvfp4_widen_row_avx2;
#endif
  return widen_nvfp4_row_scalar;
}

// One row of y per weight row and input row: at n = 1 the fused dot (each weight widened in
// registers as it is read); for a batch, each weight row widened once into the thread's scratch
// (it stays in L1/L2) and dot_f32 against it for every input row. Both are dot_f32 on the
// dequantized row, so the results do not depend on n or on the thread count.
void linear_nvfp4_with(QuantIsa isa, const float* x, int64_t n, const Nvfp4Weights& w, float* y) {
  require_nvfp4(w);
  const int64_t rows = w.rows, cols = w.cols;
  if (n == 1) {
    const DotNvfp4Fn dot = dot_nvfp4_kernel(isa);
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
    for (int64_t r = 0; r < rows; ++r) y[r] = dot(x, nvfp4_row(w, r), cols);
    return;
  }
  const WidenNvfp4Fn widen = widen_nvfp4_kernel(isa);
  const DotFn dot = dot_kernel(isa);
#pragma omp parallel if (rows * cols * n > (1 << 16))
  {
    thread_local std::vector<float> wide;
    if (int64_t(wide.size()) < cols) wide.resize(size_t(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      widen(w, r, wide.data());
      for (int64_t t = 0; t < n; ++t) y[t * rows + r] = dot(x + t * cols, wide.data(), cols);
    }
  }
}

}  // namespace

void linear_nvfp4(const float* x, int64_t n, const Nvfp4Weights& w, float* y) {
  static const QuantIsa isa = quant_isa_selected();
  linear_nvfp4_with(isa, x, n, w, y);
}
void linear_nvfp4(QuantIsa isa, const float* x, int64_t n, const Nvfp4Weights& w, float* y) {
  require_available(isa);
  linear_nvfp4_with(isa, x, n, w, y);
}

void dequantize_nvfp4(const Nvfp4Weights& w, float* out) {
  require_nvfp4(w);
  for (int64_t r = 0; r < w.rows; ++r) {
    detail::Nvfp4Row p = nvfp4_row(w, r);
    for (int64_t c = 0; c < w.cols; ++c) out[r * w.cols + c] = value(p + c);
  }
}

uint8_t f32_to_e4m3(float x) {
  // Every finite non-negative E4M3 value in code order (0x00 .. 0x7E), ascending.
  static const auto values = [] {
    std::array<float, 127> v{};
    for (int b = 0; b < 127; ++b) v[size_t(b)] = detail::e4m3_value(uint8_t(b));
    return v;
  }();
  return uint8_t(nearest(values.data(), values.size(), std::max(x, 0.0f)));
}

uint8_t f32_to_e2m1(float x) {
  static constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const uint8_t code = uint8_t(nearest(kMagnitudes, 8, std::abs(x)));
  return x < 0 ? uint8_t(code | 8) : code;  // -0 for a small negative, as ModelOpt codes it
}

float quantize_nvfp4(const float* w, int64_t rows, int64_t cols, uint8_t* codes, uint8_t* scales) {
  if (cols <= 0 || cols % 16 != 0)
    throw std::invalid_argument("quantize_nvfp4: cols " + std::to_string(cols) +
                                " is not a positive multiple of 16");
  float amax = 0.0f;
  for (int64_t i = 0; i < rows * cols; ++i) amax = std::max(amax, std::abs(w[i]));
  const float global = amax / (6.0f * 448.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 16; ++b) {
      const float* block = w + r * cols + b * 16;
      float block_amax = 0.0f;
      for (int k = 0; k < 16; ++k) block_amax = std::max(block_amax, std::abs(block[k]));
      // ModelOpt: amax / (6 * global), one division; a zero block's scale is 1.0.
      const float exact = global > 0 ? block_amax / (6.0f * global) : 0.0f;
      const uint8_t scale = f32_to_e4m3(exact == 0.0f ? 1.0f : exact);
      scales[r * (cols / 16) + b] = scale;
      const float step = detail::e4m3_value(scale) * global;
      uint8_t* out = codes + r * (cols / 2) + b * 8;
      for (int k = 0; k < 16; k += 2) {
        const uint8_t low = step > 0 ? f32_to_e2m1(block[k] / step) : 0;
        const uint8_t high = step > 0 ? f32_to_e2m1(block[k + 1] / step) : 0;
        out[k / 2] = uint8_t(low | (high << 4));
      }
    }
  return global;
}

}  // namespace colibri::kernels
