// AVX2 + FMA fp32 vector primitives (compiled with -mavx2 -mfma; called only after CPUID).
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "cpu/nvfp4_detail.h"
#include "cpu/vec_detail.h"

namespace colibri::kernels::detail {

namespace {

inline __m256 load(const float* p) {
  return _mm256_loadu_ps(p);
}
inline __m256 load(const uint16_t* p) {  // 8 BF16, widened exactly
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load(const int8_t* p) {  // 8 int8, converted exactly
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// The 8 lanes' sum: halves, then pairs, then the last two.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float value(const int8_t* p) {
  return float(*p);
}
inline float value(const float* p) {
  return *p;
}
inline float value(const uint16_t* p) {
  uint32_t bits = uint32_t(*p) << 16;
  float v;
  __builtin_memcpy(&v, &bits, 4);
  return v;
}

inline Fp8Row operator+(Fp8Row p, int64_t i) {
  return {p.bits + i, p.scales, p.col + i, p.block_cols, p.block_shift};
}
inline float block_scale(const Fp8Row& p) {
  return p.scales[p.block_shift >= 0 ? p.col >> p.block_shift : p.col / p.block_cols];
}
// FP8 E4M3 values (none a NaN), exactly: the magnitude bits in an fp32's exponent and mantissa
// fields times 2^120 (exact, subnormals included), then times the block's scale.
inline __m256 load(Fp8Row p) {  // 8 columns of one scale block
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.bits)));
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(magnitude, sign)),
                                 _mm256_set1_ps(0x1p120f));
  return _mm256_mul_ps(v, _mm256_set1_ps(block_scale(p)));
}
inline float value(Fp8Row p) {
  const uint32_t bits = (uint32_t(*p.bits & 0x7F) << 20) | (uint32_t(*p.bits & 0x80) << 24);
  float v;
  __builtin_memcpy(&v, &bits, 4);
  return v * 0x1p120f * block_scale(p);
}

inline Nvfp4Row operator+(Nvfp4Row p, int64_t i) {
  return {p.codes, p.scales, p.global, p.col + i};
}
// 8 columns of one scale block (p.col a multiple of 8) from 4 bytes of codes: each nibble's
// magnitude from the low three bits (a permute of the 8 magnitudes), its sign from bit 3, times
// the block's scale (exact), times the second-level scale (rounded once).
inline __m256 load(Nvfp4Row p) {
  int32_t word;
  __builtin_memcpy(&word, p.codes + (p.col >> 1), 4);
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(word));
  // Column 2j: byte j's low nibble; column 2j + 1: its high nibble.
  const __m256i spread =
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  const __m256i code =
      _mm256_and_si256(_mm256_srlv_epi32(spread, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
                       _mm256_set1_epi32(0x0F));
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2m1Values),
                                                    _mm256_and_si256(code, _mm256_set1_epi32(7)));
  const __m256 e2m1 = _mm256_xor_ps(
      magnitude,
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28)));
  const __m256 scaled = _mm256_mul_ps(e2m1, _mm256_set1_ps(e4m3_value(p.scales[p.col >> 4])));
  return _mm256_mul_ps(scaled, _mm256_set1_ps(p.global));
}
inline float value(Nvfp4Row p) {
  return nvfp4_value(p);
}

template <typename B>  // B: a pointer to the operand type, an Fp8Row or an Nvfp4Row
float dot(const float* a, B b, int64_t n) {
  // Four independent accumulators hide the FMA latency.
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if constexpr (std::is_same_v<B, const uint16_t*>) prefetch_row_ahead(b + i);  // a line
    if constexpr (std::is_same_v<B, const int8_t*>)                               // half a line
      if (i % 64 == 0) prefetch_row_ahead(b + i);
    for (int k = 0; k < 4; ++k)
      acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * k), load(b + i + 8 * k), acc[k]);
  }
  for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load(b + i), acc[0]);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  float total = hsum(sum);
  // An explicit fused multiply-add: the same rounding whether or not the compiler would contract.
  for (; i < n; ++i)
    total =
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a[i]), _mm_set_ss(value(b + i)), _mm_set_ss(total)));
  return total;
}

}  // namespace

float dot_avx2(const float* a, const float* b, int64_t n) {
  return dot(a, b, n);
}

namespace {

// out[j] = dot(a[j], b, n) for j < H, each with dot's accumulators and order; b's vectors are
// loaded once for the H rows (1 + 1/H loads per multiply-add instead of 2).
template <int H>
void dot_h(const float* const* a, const float* b, int64_t n, float* out) {
  __m256 acc[H][4];
  for (int h = 0; h < H; ++h)
    for (int k = 0; k < 4; ++k) acc[h][k] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      const __m256 bv = _mm256_loadu_ps(b + i + 8 * k);
      for (int h = 0; h < H; ++h)
        acc[h][k] = _mm256_fmadd_ps(_mm256_loadu_ps(a[h] + i + 8 * k), bv, acc[h][k]);
    }
  for (; i + 8 <= n; i += 8) {
    const __m256 bv = _mm256_loadu_ps(b + i);
    for (int h = 0; h < H; ++h)
      acc[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(a[h] + i), bv, acc[h][0]);
  }
  for (int h = 0; h < H; ++h) {
    const __m256 sum =
        _mm256_add_ps(_mm256_add_ps(acc[h][0], acc[h][1]), _mm256_add_ps(acc[h][2], acc[h][3]));
    float total = hsum(sum);
    for (int64_t j = i; j < n; ++j)
      total = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a[h][j]), _mm_set_ss(b[j]), _mm_set_ss(total)));
    out[h] = total;
  }
}

}  // namespace

void dot_rows_avx2(const float* const* a, int64_t count, const float* b, int64_t n, float* out) {
  int64_t h = 0;
  for (; h + 3 <= count; h += 3) dot_h<3>(a + h, b, n, out + h);
  if (count - h == 2) dot_h<2>(a + h, b, n, out + h);
  if (count - h == 1) dot_h<1>(a + h, b, n, out + h);
}

float dot_bf16_avx2(const float* a, const uint16_t* b, int64_t n) {
  return dot(a, b, n);
}

float dot_fp8_avx2(const float* a, Fp8Row b, int64_t n) {
  return dot(a, b, n);
}

float dot_nvfp4_avx2(const float* a, Nvfp4Row b, int64_t n) {
  return dot(a, b, n);
}

void nvfp4_widen_row_avx2(const Nvfp4Weights& w, int64_t row, float* out) {
  const Nvfp4Row p{w.codes + row * (w.cols / 2), w.scales + row * (w.cols / 16), w.global, 0};
  for (int64_t c = 0; c < w.cols; c += 8) _mm256_storeu_ps(out + c, load(p + c));
}

namespace {

template <typename X>
void axpy(float alpha, const X* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if ((i * int64_t(sizeof(X))) % 64 == 0) prefetch_row_ahead(x + i);
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, load(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i)
    y[i] =
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(alpha), _mm_set_ss(value(x + i)), _mm_set_ss(y[i])));
}

}  // namespace

void axpy_avx2(float alpha, const float* x, float* y, int64_t n) {
  axpy(alpha, x, y, n);
}
void axpy_bf16_avx2(float alpha, const uint16_t* x, float* y, int64_t n) {
  axpy(alpha, x, y, n);
}
void axpy_i8_avx2(float alpha, const int8_t* x, float* y, int64_t n) {
  axpy(alpha, x, y, n);
}
float dot_i8_avx2(const int8_t* a, const float* b, int64_t n) {
  return dot(b, a, n);
}

namespace {

constexpr int64_t kAxpyAhead = 4;  // rows

// Rows [t0, t0 + T) of y, columns [c0, c0 + 8 C): each element one fused multiply-add per k in
// order, as axpy does. Against one axpy call per row and term (tests/kernels' shapes, one thread):
// 128 rows of y, 128 of x, 512 wide: int8 1.5x, fp32 2x faster; 8 by 16: 1.3x and 2x. One row of
// y is slower (6.0 against 4.0 us at 128 by 512, int8): linear.cpp calls axpy then.
template <int T, int C, typename X>
void axpy_rows_tile(const AxpyRows& a, const X* x, int64_t t0, int64_t c0) {
  __m256 acc[T][C];
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c)
      acc[t][c] = _mm256_loadu_ps(a.y + (t0 + t) * a.y_stride + c0 + 8 * c);
  for (int64_t k = 0; k < a.k; ++k) {
    // The first strip walks the rows down a column: it fetches each row whole a few rows ahead,
    // so that the later strips find them in cache.
    if (a.fetch_ahead && c0 == 0 && k + kAxpyAhead < a.k) {
      const char* ahead = reinterpret_cast<const char*>(x + a.row(k + kAxpyAhead) * a.m);
      for (int64_t b = 0; b < a.m * int64_t(sizeof(X)); b += 64)
        _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    __m256 w[C];
    for (int c = 0; c < C; ++c) w[c] = load(x + a.row(k) * a.m + c0 + 8 * c);
    const float s = a.x_scale ? a.x_scale[k] : 1.0f;
    for (int t = 0; t < T; ++t) {
      const float alpha =
          a.x_scale ? a.alpha[(t0 + t) * a.a_stride + k] * s : a.alpha[(t0 + t) * a.a_stride + k];
      const __m256 av = _mm256_set1_ps(alpha);
      for (int c = 0; c < C; ++c) acc[t][c] = _mm256_fmadd_ps(av, w[c], acc[t][c]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(a.y + (t0 + t) * a.y_stride + c0 + 8 * c, acc[t][c]);
}

template <int T, typename X>
void axpy_rows_strips(const AxpyRows& a, const X* x, int64_t t0) {
  int64_t c0 = 0;
  for (; c0 + 16 <= a.m; c0 += 16) axpy_rows_tile<T, 2>(a, x, t0, c0);
  for (; c0 + 8 <= a.m; c0 += 8) axpy_rows_tile<T, 1>(a, x, t0, c0);
  for (int t = 0; t < T; ++t)  // the last m % 8 columns, one element at a time
    for (int64_t j = c0; j < a.m; ++j) {
      float* y = a.y + (t0 + t) * a.y_stride + j;
      __m128 v = _mm_set_ss(*y);
      for (int64_t k = 0; k < a.k; ++k) {
        const float alpha = a.x_scale ? a.alpha[(t0 + t) * a.a_stride + k] * a.x_scale[k]
                                      : a.alpha[(t0 + t) * a.a_stride + k];
        v = _mm_fmadd_ss(_mm_set_ss(alpha), _mm_set_ss(value(x + a.row(k) * a.m + j)), v);
      }
      *y = _mm_cvtss_f32(v);
    }
}

template <typename X>
void axpy_rows(const AxpyRows& a, const X* x) {
  for (int64_t t0 = 0; t0 < a.n; t0 += 4) {
    switch (std::min<int64_t>(4, a.n - t0)) {
      case 4:
        axpy_rows_strips<4>(a, x, t0);
        break;
      case 3:
        axpy_rows_strips<3>(a, x, t0);
        break;
      case 2:
        axpy_rows_strips<2>(a, x, t0);
        break;
      default:
        axpy_rows_strips<1>(a, x, t0);
        break;
    }
  }
}

}  // namespace

void axpy_rows_f32_avx2(const AxpyRows& a, const float* x) {
  axpy_rows(a, x);
}
void axpy_rows_bf16_avx2(const AxpyRows& a, const uint16_t* x) {
  axpy_rows(a, x);
}
void axpy_rows_i8_avx2(const AxpyRows& a, const int8_t* x) {
  axpy_rows(a, x);
}

namespace {

// K keys against heads [h0, h0 + 8 HV): acc[j][v] holds the dots of key j with 8 heads.
template <int K, int HV>
void index_tile(const IndexQuery& q, const float* const* key, int64_t h0, __m256* total) {
  __m256 acc[K][HV];
  for (int j = 0; j < K; ++j)
    for (int v = 0; v < HV; ++v) acc[j][v] = _mm256_setzero_ps();
  const float* q_t = q.q_t + h0;
  for (int64_t d = 0; d < q.dim; ++d, q_t += q.heads) {
    __m256 qv[HV];
    for (int v = 0; v < HV; ++v) qv[v] = _mm256_loadu_ps(q_t + 8 * v);
    for (int j = 0; j < K; ++j) {
      const __m256 k = _mm256_broadcast_ss(key[j] + d);
      for (int v = 0; v < HV; ++v) acc[j][v] = _mm256_fmadd_ps(qv[v], k, acc[j][v]);
    }
  }
  const __m256 scale = _mm256_set1_ps(q.scale), zero = _mm256_setzero_ps();
  for (int v = 0; v < HV; ++v) {
    const __m256 w = _mm256_loadu_ps(q.weights + h0 + 8 * v);
    for (int j = 0; j < K; ++j)
      total[j] = _mm256_fmadd_ps(w, _mm256_max_ps(_mm256_mul_ps(acc[j][v], scale), zero), total[j]);
  }
}

template <int K>
void index_keys(const IndexQuery& q, const float* keys, const int32_t* rows, float* out) {
  const float* key[K];
  __m256 total[K];
  for (int j = 0; j < K; ++j) {
    key[j] = keys + int64_t(rows[j]) * q.dim;
    total[j] = _mm256_setzero_ps();
  }
  int64_t h0 = 0;
  for (; h0 + 16 <= q.heads; h0 += 16) index_tile<K, 2>(q, key, h0, total);
  if (h0 < q.heads) index_tile<K, 1>(q, key, h0, total);
  for (int j = 0; j < K; ++j) out[j] = hsum(total[j]);
}

}  // namespace

void index_scores_avx2(const IndexQuery& q, const float* keys, const int32_t* rows, int64_t count,
                       float* out) {
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) index_keys<4>(q, keys, rows + i, out + i);
  for (; i < count; ++i) index_keys<1>(q, keys, rows + i, out + i);
}

}  // namespace colibri::kernels::detail
