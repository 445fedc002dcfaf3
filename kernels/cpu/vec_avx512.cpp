// AVX-512 fp32 vector primitives (compiled with -mavx512f -mavx512bw -mavx512vl -mfma; called
// only after CPUID), with BF16 and int8 operands widened exactly in registers.
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "cpu/nvfp4_detail.h"
#include "cpu/vec_detail.h"

// GCC 12 warns inside the intrinsic headers (their _mm512_undefined_* operands, GCC PR 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace colibri::kernels::detail {

namespace {

inline __m512 load(const float* p) {
  return _mm512_loadu_ps(p);
}
inline __m512 load(const uint16_t* p) {  // 16 BF16, widened exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load(const int8_t* p) {  // 16 int8, converted exactly
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load_masked(__mmask16 m, const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
inline __m512 load_masked(__mmask16 m, const float* p) {
  return _mm512_maskz_loadu_ps(m, p);
}
inline __m512 load_masked(__mmask16 m, const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline Fp8Row operator+(Fp8Row p, int64_t i) {
  return {p.bits + i, p.scales, p.col + i, p.block_cols, p.block_shift};
}
// 16 FP8 E4M3 values (none a NaN), exactly: the magnitude bits in an fp32's exponent and
// mantissa fields times 2^120 (exact, subnormals included), then times the block's scale,
// rounded once as the loader's dequantization rounds it.
inline __m512 widen_fp8(__m512i x, const Fp8Row& p) {
  const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(magnitude, sign)),
                                 _mm512_set1_ps(0x1p120f));
  return _mm512_mul_ps(
      v,
      _mm512_set1_ps(p.scales[p.block_shift >= 0 ? p.col >> p.block_shift : p.col / p.block_cols]));
}
inline __m512 load(Fp8Row p) {  // 16 columns of one scale block
  return widen_fp8(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.bits))),
                   p);
}
inline __m512 load_masked(__mmask16 m, Fp8Row p) {
  return widen_fp8(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p.bits)), p);
}

inline Nvfp4Row operator+(Nvfp4Row p, int64_t i) {
  return {p.codes, p.scales, p.global, p.col + i};
}
// 16 columns of one scale block (p.col a multiple of 16) from 8 bytes of codes: the nibbles in
// column order as indices into the E2M1 values, times the block's scale (exact), times the
// second-level scale (rounded once). `bytes` masks the codes read (a tail).
inline __m512 load_nvfp4(const Nvfp4Row& p, __mmask16 bytes) {
  const __m128i packed = _mm_maskz_loadu_epi8(bytes, p.codes + (p.col >> 1));
  const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
  const __m512i index = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));
  const __m512 e2m1 = _mm512_permutexvar_ps(index, _mm512_loadu_ps(kE2m1Values));
  const __m512 scaled = _mm512_mul_ps(e2m1, _mm512_set1_ps(e4m3_value(p.scales[p.col >> 4])));
  return _mm512_mul_ps(scaled, _mm512_set1_ps(p.global));
}
inline __m512 load(Nvfp4Row p) {
  return load_nvfp4(p, 0xFF);
}
inline __m512 load_masked(__mmask16 m, Nvfp4Row p) {  // m: the first k columns
  const int columns = __builtin_popcount(m);
  return _mm512_maskz_mov_ps(m, load_nvfp4(p, __mmask16((1u << ((columns + 1) / 2)) - 1)));
}

template <typename B>  // B: a pointer to the operand type, an Fp8Row or an Nvfp4Row
float dot(const float* a, B b, int64_t n) {
  // Four independent accumulators hide the FMA latency; the tail uses a masked load.
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    prefetch_row_ahead(b + i);  // a cache line of int8, or half one of BF16
    if constexpr (std::is_same_v<B, const uint16_t*>) prefetch_row_ahead(b + i + 32);
    for (int k = 0; k < 4; ++k)
      acc[k] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * k), load(b + i + 16 * k), acc[k]);
  }
  for (; i + 16 <= n; i += 16)
    acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load(b + i), acc[0]);
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    acc[1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), load_masked(m, b + i), acc[1]);
  }
  // Through memory: GCC 12's _mm512_reduce_add_ps warns about an uninitialised temporary.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes,
                  _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  float total = 0.0f;
  for (int k = 0; k < 8; ++k) total += lanes[k] + lanes[k + 8];
  return total;
}

}  // namespace

float dot_avx512(const float* a, const float* b, int64_t n) {
  return dot(a, b, n);
}

float dot_bf16_avx512(const float* a, const uint16_t* b, int64_t n) {
  return dot(a, b, n);
}

float dot_nvfp4_avx512(const float* a, Nvfp4Row b, int64_t n) {
  return dot(a, b, n);
}

float dot_fp8_avx512(const float* a, Fp8Row b, int64_t n) {
  return dot(a, b, n);
}

void nvfp4_widen_row_avx512(const Nvfp4Weights& w, int64_t row, float* out) {
  const Nvfp4Row p{w.codes + row * (w.cols / 2), w.scales + row * (w.cols / 16), w.global, 0};
  for (int64_t c = 0; c < w.cols; c += 16) _mm512_storeu_ps(out + c, load(p + c));
}

namespace {

template <typename X>
void axpy(float alpha, const X* x, float* y, int64_t n) {
  const __m512 a = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if ((i * int64_t(sizeof(X))) % 64 == 0) prefetch_row_ahead(x + i);
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a, load(x + i), _mm512_loadu_ps(y + i)));
  }
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(
        y + i, m, _mm512_fmadd_ps(a, load_masked(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

}  // namespace

namespace {

constexpr int64_t kAxpyAhead = 4;  // rows

// Rows [t0, t0 + T) of y, columns [c0, c0 + 16 C) (the last vector masked by `last`).
template <int T, int C, typename X>
void axpy_rows_tile(const AxpyRows& a, const X* x, int64_t t0, int64_t c0, __mmask16 last) {
  __m512 acc[T][C];
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) {
      const __mmask16 m = c == C - 1 ? last : __mmask16(0xFFFF);
      acc[t][c] = _mm512_maskz_loadu_ps(m, a.y + (t0 + t) * a.y_stride + c0 + 16 * c);
    }
  for (int64_t k = 0; k < a.k; ++k) {
    // The first strip walks the rows down a column: it fetches each row whole a few rows ahead,
    // so that the later strips find them in cache (the strided misses alone were latency-bound).
    if (a.fetch_ahead && c0 == 0 && k + kAxpyAhead < a.k) {
      const char* ahead = reinterpret_cast<const char*>(x + a.row(k + kAxpyAhead) * a.m);
      for (int64_t b = 0; b < a.m * int64_t(sizeof(X)); b += 64)
        _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    __m512 w[C];
    for (int c = 0; c < C; ++c) {
      const X* src = x + a.row(k) * a.m + c0 + 16 * c;
      w[c] = c == C - 1 && last != 0xFFFF ? load_masked(last, src) : load(src);
    }
    const float s = a.x_scale ? a.x_scale[k] : 1.0f;
    for (int t = 0; t < T; ++t) {
      const float alpha =
          a.x_scale ? a.alpha[(t0 + t) * a.a_stride + k] * s : a.alpha[(t0 + t) * a.a_stride + k];
      const __m512 av = _mm512_set1_ps(alpha);
      for (int c = 0; c < C; ++c) acc[t][c] = _mm512_fmadd_ps(av, w[c], acc[t][c]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) {
      const __mmask16 m = c == C - 1 ? last : __mmask16(0xFFFF);
      _mm512_mask_storeu_ps(a.y + (t0 + t) * a.y_stride + c0 + 16 * c, m, acc[t][c]);
    }
}

template <typename X>
void axpy_rows(const AxpyRows& a, const X* x) {
  for (int64_t t0 = 0; t0 < a.n; t0 += 4) {
    const int64_t rows = std::min<int64_t>(4, a.n - t0);
    int64_t c0 = 0;
    for (; c0 + 64 <= a.m; c0 += 64) {
      switch (rows) {
        case 4:
          axpy_rows_tile<4, 4>(a, x, t0, c0, 0xFFFF);
          break;
        case 3:
          axpy_rows_tile<3, 4>(a, x, t0, c0, 0xFFFF);
          break;
        case 2:
          axpy_rows_tile<2, 4>(a, x, t0, c0, 0xFFFF);
          break;
        default:
          axpy_rows_tile<1, 4>(a, x, t0, c0, 0xFFFF);
          break;
      }
    }
    for (; c0 < a.m; c0 += 16) {
      const int64_t left = std::min<int64_t>(16, a.m - c0);
      const __mmask16 last = __mmask16((1u << left) - 1);
      switch (rows) {
        case 4:
          axpy_rows_tile<4, 1>(a, x, t0, c0, last);
          break;
        case 3:
          axpy_rows_tile<3, 1>(a, x, t0, c0, last);
          break;
        case 2:
          axpy_rows_tile<2, 1>(a, x, t0, c0, last);
          break;
        default:
          axpy_rows_tile<1, 1>(a, x, t0, c0, last);
          break;
      }
    }
  }
}

}  // namespace

void axpy_rows_f32_avx512(const AxpyRows& a, const float* x) {
  axpy_rows(a, x);
}
void axpy_rows_bf16_avx512(const AxpyRows& a, const uint16_t* x) {
  axpy_rows(a, x);
}
void axpy_rows_i8_avx512(const AxpyRows& a, const int8_t* x) {
  axpy_rows(a, x);
}

void axpy_avx512(float alpha, const float* x, float* y, int64_t n) {
  axpy(alpha, x, y, n);
}
void axpy_bf16_avx512(float alpha, const uint16_t* x, float* y, int64_t n) {
  axpy(alpha, x, y, n);
}
void axpy_i8_avx512(float alpha, const int8_t* x, float* y, int64_t n) {
  axpy(alpha, x, y, n);
}
float dot_i8_avx512(const int8_t* a, const float* b, int64_t n) {
  return dot(b, a, n);
}

}  // namespace colibri::kernels::detail
