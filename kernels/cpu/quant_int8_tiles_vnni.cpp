// int8-activation kernel for kTiles matrices with AVX-512 VNNI (compiled with -mavx512f
// -mavx512bw -mavx512vl -mavx512vnni -mfma; called only after CPUID). The operations:
// quant_int8_detail.h; the layout: quant.h.
//
// Two consecutive tiles at once, 16 output rows: word j of a chunk is 32 bytes in each tile (its 8
// rows' 4 bytes), and the two go into one zmm, tile A in lanes 0-7 and tile B in lanes 8-15, so
// that one broadcast word of activations and one vpdpbusd serve 16 rows (twice the 8-row
// kernel's, whose ymm take the last tile when the rows are an odd number of tiles). int4: low and
// high nibbles against the two words of activations they meet, from the bias correction; int8:
// w + 128 (the sign bit flipped) from the bias -128 * sum_k.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/batch_tiles.h"
#include "cpu/quant_int8_detail.h"
#include "cpu/quant_int8_tile8.h"
#include "cpu/quant_int8_zmm.h"

// GCC 12 warns inside the intrinsic headers (their _mm512_undefined_* operands, GCC PR 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace colibri::kernels::detail {
namespace {

inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 load_pair(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(
      _mm512_castpd256_pd512(_mm256_loadu_pd(reinterpret_cast<const double*>(a))),
      _mm256_loadu_pd(reinterpret_cast<const double*>(b)), 1));
}

// Rows o0..o0+15 of a kTiles w (o0 a multiple of 8, o0 + 16 <= w.rows) against activation rows
// t0..t0+T-1.
template <bool Int8, int T>
[[gnu::flatten]] void tile_pair(const QuantMatrixView& w, int64_t o0, const Int8Rows& x, int64_t t0,
                                float* y, int64_t y_stride) {
  const int64_t rb = row_bytes(w.format, w.cols);
  const bool grouped = w.format == QuantFormat::kInt4Grouped;
  const int64_t gs = grouped ? w.group_size : kInt8Block;
  const int64_t ng = grouped ? (w.cols + gs - 1) / gs : 1;
  const uint8_t* tile_a = w.data + o0 * rb;
  const uint8_t* tile_b = tile_a + 8 * rb;
  const float* scales_a = grouped ? w.scales + o0 * ng : nullptr;
  const float* scales_b = grouped ? scales_a + 8 * ng : nullptr;
  // The next pair of tiles is fetched at the rate this one is read (as in the 8-row kernel).
  constexpr int64_t kStep = 8 * (Int8 ? 64 : 32);
  const int64_t next = (o0 + 16) * rb, end = w.rows * rb;
  const int64_t scales_next = (o0 + 16) * ng, scales_end = w.rows * ng;  // floats
  // A second accumulator (int4: the high nibbles; int8: the block's second half) while few
  // activation rows give independent chains.
  constexpr int kChains = T <= 4 ? 2 : 1;

  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i sign8 = _mm512_set1_epi8(char(0x80));
  __m512 s_w = _mm512_set1_ps(1.0f);

  for (int64_t k = 0; k < x.blocks; ++k) {
    if (grouped) {
      const int64_t g = k * kInt8Block / gs;
      s_w = load_pair(scales_a + 8 * g, scales_b + 8 * g);
    }
    for (int64_t at = next + kStep * k; at < std::min(next + kStep * (k + 1), end); at += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w.data + at), _MM_HINT_T0);
      if (at + 8 * rb < end)
        _mm_prefetch(reinterpret_cast<const char*>(w.data + at + 8 * rb), _MM_HINT_T0);
    }
    if (grouped && k % 2 == 0 && scales_next + 8 * k < scales_end) {  // 8 floats a step
      _mm_prefetch(reinterpret_cast<const char*>(w.scales + scales_next + 8 * k), _MM_HINT_T0);
      if (scales_next + 8 * ng + 8 * k < scales_end)
        _mm_prefetch(reinterpret_cast<const char*>(w.scales + scales_next + 8 * ng + 8 * k),
                     _MM_HINT_T0);
    }
    __m512i dot[T][kChains];
    for (int t = 0; t < T; ++t) {
      const int32_t sum = x.sum[(t0 + t) * x.blocks + k];
      dot[t][0] = _mm512_set1_epi32(Int8 ? -128 * sum : -8 * sum);
      if constexpr (kChains == 2) dot[t][1] = _mm512_setzero_si512();
    }
    for (int half = 0; half < (Int8 ? 2 : 1); ++half) {
      const int64_t chunk = (Int8 ? 64 * k + 32 * half : 32 * k) / 32 * 256;
      for (int j = 0; j < 8; ++j) {
        const __m512i z = load_pair(tile_a + chunk + 32 * j, tile_b + chunk + 32 * j);
        if constexpr (Int8) {
          const __m512i biased = _mm512_xor_si512(z, sign8);
          for (int t = 0; t < T; ++t) {
            const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block + 32 * half;
            dot[t][half % kChains] =
                _mm512_dpbusd_epi32(dot[t][half % kChains], biased, broadcast_word(q + 4 * j));
          }
        } else {
          const __m512i lo = _mm512_and_si512(z, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
          for (int t = 0; t < T; ++t) {
            const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block + 8 * j;
            dot[t][0] = _mm512_dpbusd_epi32(dot[t][0], lo, broadcast_word(q));
            dot[t][kChains - 1] =
                _mm512_dpbusd_epi32(dot[t][kChains - 1], hi, broadcast_word(q + 4));
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512i d = kChains == 2 ? _mm512_add_epi32(dot[t][0], dot[t][kChains - 1]) : dot[t][0];
      const __m512 s = _mm512_mul_ps(s_w, _mm512_set1_ps(x.scale[(t0 + t) * x.blocks + k]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[t]);
    }
  }
  const __m512 row_scale = grouped ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(w.scales + o0);
  for (int t = 0; t < T; ++t)
    _mm512_storeu_ps(y + (t0 + t) * y_stride + o0, _mm512_mul_ps(acc[t], row_scale));
}

}  // namespace

void int8_tiles_vnni(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                     int64_t row_begin, int64_t row_end) {
  if (w.layout != QuantLayout::kTiles)
    return tile8::rows<true>(w, x, y, y_stride, row_begin, row_end);
  row_end = std::min(row_end, w.rows);  // a multiple of 8 for kTiles
  // Two tiles at once (16 rows), the last one alone when the rows are an odd number of tiles.
  for (int64_t o0 = row_begin; o0 < row_end; o0 += 16)
    for_tiles<tile8::kMaxTile>(x.n, [&]<int T>(int64_t t0) {
      if (o0 + 16 > row_end)
        tile8::tile_for<true, T>(w, o0, x, t0, y, y_stride);
      else if (w.format == QuantFormat::kInt8Row)
        tile_pair<true, T>(w, o0, x, t0, y, y_stride);
      else
        tile_pair<false, T>(w, o0, x, t0, y, y_stride);
    });
}

}  // namespace colibri::kernels::detail
