// NVFP4 with int8 activations on AVX-512 VNNI (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512vnni -mfma; called only after CPUID). The operations and the activation layout:
// nvfp4_detail.h.
//
// A super-step is 256 columns of one weight row: 128 code bytes and 16 scale bytes. The codes'
// 32-bit words are split into even and odd words (two vpermt2d), so that lane L of both holds
// block L's 16 codes; low and high nibbles become 2 * e2m1 + 12 by a vpshufb table, and four
// vpdpbusd against the activations' four vectors give each block's integer sum in its lane. The
// 16 scale bytes become e4m3 * 2^-8 through FP16 (the E4M3 bits shifted into an FP16's, then
// vcvtph2ps: exact, subnormals included). Two weight rows at a time (four for one row of
// activations and short rows), decoded once per super-step for up to 4 rows of activations, each
// activation load serving every weight row: at 8 rows of activations their loads from L2, not the
// weights, bound the kernel (one weight row at a time ran at about half the speed).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/batch_tiles.h"
#include "cpu/nvfp4_detail.h"

// GCC 12 warns inside the intrinsic headers (their _mm512_undefined_* operands, GCC PR 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace colibri::kernels::detail {
namespace {

constexpr int kRows = 2;  // weight rows per pass
// One row of activations with rows of at most kShortRow columns: four weight rows a pass. One
// thread, from DRAM: GLM-5.2's down (6144 x 2048) 23 against 20 GB/s with two; its gate
// (2048 x 6144) 17 against 21 with four, whose four streams 3 KiB apart prefetch worse.
constexpr int kRowsAlone = 4;
constexpr int64_t kShortRow = 2048;
constexpr int kMaxTile = 4;  // rows of activations per pass: 8 accumulators, 8 weight vectors
// Software prefetch of the codes and scales this far ahead, into L2: one thread streamed 13 GB/s
// with 4 KiB into L1 (the int4 kernels' choice), 20 GB/s with 8 KiB into L2, against ~28 GB/s of
// read bandwidth (AMD EPYC VM, GLM-5.2's 2048 x 6144, one row of activations; 4 and 12 KiB into
// L2, or 0.5-8 KiB into L1, measured less).
constexpr int64_t kPrefetchBytes = 8192;

// 16 E4M3 bytes as e4m3 * 2^-8: the byte's sign to bit 15 and its seven other bits to bits
// 7-13 of an FP16 (whose exponent bias is 8 more than E4M3's): sign-extended to 16 bits and
// shifted left by 7, bit 15 is the sign (a copy of it), bits 7-13 the rest; bit 14, the sign
// again, is cleared.
inline __m512 block_scales(const uint8_t* s) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  return _mm512_cvtph_ps(
      _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(short(0xBF80))));
}

// R weight rows' super-steps (decoded once) against T rows of activations (each loaded once for
// the R rows: the activations of a batch live in L2, and their loads, not the weights', bound it).
template <int R, int T>
[[gnu::flatten]] void rows_tile(const Nvfp4Weights& w, int64_t o, const Nvfp4Activations& x,
                                int64_t t0, float* y, int64_t y_stride) {
  const int64_t blocks = w.cols / kNvfp4Block;
  const int64_t padded = x.steps * kNvfp4SuperStep, sums = x.steps * kNvfp4Sums;
  const __m512i lut = _mm512_broadcast_i32x4(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* codes[R];
  const uint8_t* scales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = w.codes + (o + r) * (w.cols / 2);
    scales[r] = w.scales + (o + r) * blocks;
  }
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();

  // Super-step k of the R rows, whose codes and scales are at c[r] and s[r].
  const auto step = [&](const uint8_t* const* c, const uint8_t* const* s, int64_t k) {
    __m512i wv[R][4];
    __m512 e[R];
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_loadu_si512(c[r]), b = _mm512_loadu_si512(c[r] + 64);
      const __m512i p = _mm512_permutex2var_epi32(a, even, b);  // block L's bytes 0-3 in lane L
      const __m512i q = _mm512_permutex2var_epi32(a, odd, b);   // its bytes 4-7
      wv[r][0] = _mm512_shuffle_epi8(lut, _mm512_and_si512(p, low4));
      wv[r][1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(p, 4), low4));
      wv[r][2] = _mm512_shuffle_epi8(lut, _mm512_and_si512(q, low4));
      wv[r][3] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
      e[r] = block_scales(s[r]);
    }
    for (int t = 0; t < T; ++t) {
      const int8_t* xq = x.q + (t0 + t) * padded + k * kNvfp4SuperStep;
      const int64_t at = (t0 + t) * sums + k * kNvfp4Sums;
      const __m512i bias = _mm512_loadu_si512(x.bias + at);
      __m512i xv[4];
      for (int j = 0; j < 4; ++j) xv[j] = _mm512_loadu_si512(xq + 64 * j);
      const __m512 sv = _mm512_loadu_ps(x.scale + at);
      for (int r = 0; r < R; ++r) {
        // Two chains: a lone row of activations would wait on vpdpbusd's latency.
        __m512i d0 = _mm512_dpbusd_epi32(bias, wv[r][0], xv[0]);
        __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r][2], xv[2]);
        d0 = _mm512_dpbusd_epi32(d0, wv[r][1], xv[1]);
        d1 = _mm512_dpbusd_epi32(d1, wv[r][3], xv[3]);
        const __m512 m = _mm512_mul_ps(e[r], sv);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), m, acc[r][t]);
      }
    }
  };
  const int64_t full = blocks / kNvfp4Sums;
  for (int64_t k = 0; k < full; ++k) {
    const uint8_t* c[R];
    const uint8_t* s[R];
    for (int r = 0; r < R; ++r) {
      c[r] = codes[r] + k * 128;
      s[r] = scales[r] + k * kNvfp4Sums;
      const char* ahead = reinterpret_cast<const char*>(c[r] + kPrefetchBytes);
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      if (k % 4 == 0)  // 16 scale bytes a step: a line every 4
        _mm_prefetch(reinterpret_cast<const char*>(s[r] + kPrefetchBytes / 8), _MM_HINT_T1);
    }
    step(c, s, k);
  }
  if (full < x.steps) {  // the last blocks, zero-padded (zero scales: they add nothing)
    alignas(64) uint8_t pad_c[R][128] = {}, pad_s[R][16] = {};
    const uint8_t* c[R];
    const uint8_t* s[R];
    const int64_t left = blocks - full * kNvfp4Sums;
    for (int r = 0; r < R; ++r) {
      std::memcpy(pad_c[r], codes[r] + full * 128, size_t(left * 8));
      std::memcpy(pad_s[r], scales[r] + full * kNvfp4Sums, size_t(left));
      c[r] = pad_c[r];
      s[r] = pad_s[r];
    }
    step(c, s, full);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      // The tree of halves (nvfp4_detail.h).
      const __m256 h8 =
          _mm256_add_ps(_mm512_castps512_ps256(acc[r][t]),
                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][t]), 1)));
      const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
      const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
      y[(t0 + t) * y_stride + o + r] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
    }
}

}  // namespace

void nvfp4_int8_rows_avx512vnni(const Nvfp4Weights& w, const Nvfp4Activations& x, float* y,
                                int64_t y_stride, int64_t row_begin, int64_t row_end) {
  int64_t o = row_begin;
  if (x.n == 1 && w.cols <= kShortRow)
    for (; o + kRowsAlone <= row_end; o += kRowsAlone)
      rows_tile<kRowsAlone, 1>(w, o, x, 0, y, y_stride);
  for (; o + kRows <= row_end; o += kRows)
    for_tiles<kMaxTile>(x.n,
                        [&]<int T>(int64_t t0) { rows_tile<kRows, T>(w, o, x, t0, y, y_stride); });
  for (; o < row_end; ++o)
    for_tiles<kMaxTile>(x.n, [&]<int T>(int64_t t0) { rows_tile<1, T>(w, o, x, t0, y, y_stride); });
}

}  // namespace colibri::kernels::detail
