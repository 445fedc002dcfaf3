// NVFP4 with int8 activations on AVX2 (compiled with -mavx2 -mfma; called only after CPUID),
// also used on AVX-512 CPUs without VNNI. The operations and the activation layout:
// nvfp4_detail.h.
//
// A step is 128 columns of one weight row (8 blocks, half a super-step): 64 code bytes split into
// even and odd 32-bit words so that lane L of both holds block L's codes, the nibbles turned into
// 2 * e2m1 + 12 by a vpshufb table, then pmaddubsw against the activations (pairs at most
// 2 * 24 * 127, four of them at most 24384: exact in 16 bits) and pmaddwd by ones into the lanes.
// The 8 scale bytes become e4m3 * 2^-8 by the E4M3 bits placed in an fp32's and a multiply by
// 2^112 (exact). Even steps feed partial sums 0-7, odd ones 8-15.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/batch_tiles.h"
#include "cpu/nvfp4_detail.h"

namespace colibri::kernels::detail {
namespace {

constexpr int kMaxTile = 4;  // rows of activations per pass: 8 accumulators
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kStepCols = 128;

inline __m256 block_scales(const uint8_t* s) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(magnitude, sign)),
                       _mm256_set1_ps(0x1p112f));
}

template <int T>
[[gnu::flatten]] void row_tile(const Nvfp4Weights& w, int64_t o, const Nvfp4Activations& x,
                               int64_t t0, float* y, int64_t y_stride) {
  const int64_t blocks = w.cols / kNvfp4Block;
  const uint8_t* codes = w.codes + o * (w.cols / 2);
  const uint8_t* scales = w.scales + o * blocks;
  const int64_t padded = x.steps * kNvfp4SuperStep, sums = x.steps * kNvfp4Sums;
  const __m256i lut = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();

  const auto step = [&](const uint8_t* c, const uint8_t* s, int64_t k) {
    const __m256i a =
        _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), split);
    const __m256i b = _mm256_permutevar8x32_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32)), split);
    const __m256i p = _mm256_permute2x128_si256(a, b, 0x20);  // block L's bytes 0-3 in lane L
    const __m256i q = _mm256_permute2x128_si256(a, b, 0x31);  // its bytes 4-7
    const __m256i wa = _mm256_shuffle_epi8(lut, _mm256_and_si256(p, low4));
    const __m256i wb = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(p, 4), low4));
    const __m256i wc = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, low4));
    const __m256i wd = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
    const __m256 e = block_scales(s);
    const int64_t half = (k % 2) * 32;
    for (int t = 0; t < T; ++t) {
      const int8_t* xq = x.q + (t0 + t) * padded + k / 2 * kNvfp4SuperStep + half;
      const int64_t at = (t0 + t) * sums + k * 8;
      const auto load = [](const int8_t* from) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
      };
      const __m256i pairs =
          _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(wa, load(xq)),
                                            _mm256_maddubs_epi16(wb, load(xq + 64))),
                           _mm256_add_epi16(_mm256_maddubs_epi16(wc, load(xq + 128)),
                                            _mm256_maddubs_epi16(wd, load(xq + 192))));
      const __m256i d =
          _mm256_add_epi32(_mm256_madd_epi16(pairs, ones),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bias + at)));
      const __m256 m = _mm256_mul_ps(e, _mm256_loadu_ps(x.scale + at));
      acc[t][k % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), m, acc[t][k % 2]);
    }
  };
  const int64_t full = blocks / 8, steps = (blocks + 7) / 8;
  for (int64_t k = 0; k < full; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + k * 64 + kPrefetchBytes), _MM_HINT_T0);
    if (k % 8 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(scales + k * 8 + kPrefetchBytes / 8), _MM_HINT_T0);
    step(codes + k * 64, scales + k * 8, k);
  }
  if (full < steps) {  // the last blocks, zero-padded (zero scales: they add nothing)
    alignas(32) uint8_t c[64] = {}, s[8] = {};
    const int64_t left = blocks - full * 8;
    std::memcpy(c, codes + full * 64, size_t(left * 8));
    std::memcpy(s, scales + full * 8, size_t(left));
    step(c, s, full);
  }
  for (int t = 0; t < T; ++t) {
    const __m256 h8 = _mm256_add_ps(acc[t][0], acc[t][1]);  // the tree of nvfp4_detail.h
    const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    y[(t0 + t) * y_stride + o] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
  }
}

}  // namespace

void nvfp4_int8_rows_avx2(const Nvfp4Weights& w, const Nvfp4Activations& x, float* y,
                          int64_t y_stride, int64_t row_begin, int64_t row_end) {
  static_assert(kStepCols * 2 == kNvfp4SuperStep);
  for (int64_t o = row_begin; o < row_end; ++o)
    for_tiles<kMaxTile>(x.n, [&]<int T>(int64_t t0) { row_tile<T>(w, o, x, t0, y, y_stride); });
}

}  // namespace colibri::kernels::detail
