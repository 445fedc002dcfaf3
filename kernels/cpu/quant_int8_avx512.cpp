// int8-activation kernel with AVX-512 VNNI (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512vnni -mfma; called only after CPUID). The operations: quant_int8_detail.h.
//
// A tile is 16 output rows, lane r of every vector is row r. Per 64-input block: 32 bytes of each
// row (int4: the whole block; int8: half of it) are loaded as eight zmm holding rows r and r + 8,
// transposed as two 8x8 tables of 32-bit words (24 shuffles), so that vector j holds word j of
// every row; int4 words are split into low and high nibbles, int8 words get their sign bit
// flipped (w + 128). Each row of activations then takes one vpdpbusd per weight vector against a
// broadcast word of activations, from the bias correction; up to 8 rows of activations share one
// transpose.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/batch_tiles.h"
#include "cpu/quant_int8_detail.h"
#include "cpu/quant_int8_zmm.h"

// GCC 12 warns inside the intrinsic headers (their _mm512_undefined_* operands, GCC PR 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace colibri::kernels::detail {
namespace {

constexpr int kMaxTile = 8;              // rows of activations per pass over the weights
constexpr int64_t kPrefetchBytes = 384;  // per weight row (16 rows stream at once)
// Of each row of the next tile, fetched into L2 when a tile starts: whole rows of short experts
// (the 2.2 B peer model's 704- and 1024-byte rows: 18.6 -> 20.8 GB/s at batch 1 in one A/B on
// a loaded machine).
constexpr int64_t kNextTileBytes = 2048;

// Word j of rows 0-7 in lanes 0-7 and of rows 8-15 in lanes 8-15, from z[i] = [row i | row i+8].
inline void transpose(__m512i z[8]) {
  __m512i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  // u[c] (c < 4) holds words c and c + 4 of rows 0-3; u[4 + c] the same of rows 4-7.
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int c = 0; c < 4; ++c) {
    z[c] = _mm512_permutex2var_epi64(u[c], lo, u[4 + c]);
    z[c + 4] = _mm512_permutex2var_epi64(u[c], hi, u[4 + c]);
  }
}

// Loads 32 bytes at byte offset `at` of each of the 16 rows (`avail` bytes exist from `at`;
// missing bytes read as zero) and transposes them.
inline void load_tile(const uint8_t* const rows[16], int64_t at, int64_t avail, __m512i z[8]) {
  alignas(32) uint8_t pad[16][32];
  const uint8_t* src[16];
  for (int r = 0; r < 16; ++r) {
    src[r] = rows[r] + at;
    if (avail < 32) {
      std::memset(pad[r], 0, 32);
      std::memcpy(pad[r], src[r], size_t(std::max<int64_t>(avail, 0)));
      src[r] = pad[r];
    }
  }
  for (int i = 0; i < 8; ++i) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[i]));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[i + 8]));
    z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
  transpose(z);
}

// out[c][r] = src[r * stride + c] for 16 rows r and c < cols (<= 16; others 0): 16 group scales
// of the tile's 16 rows, group-major, by one 16x16 transpose.
inline void transpose_scales(const float* src, int64_t stride, int rows, int cols,
                             float out[16][16]) {
  const __mmask16 mask = __mmask16((1u << cols) - 1);
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) {
    const float* row = src + std::min(i, rows - 1) * stride;
    r[i] = _mm512_maskz_loadu_ps(mask, row);
    // The scales are 16 streams the hardware prefetcher does not follow: fetch the next chunk.
    _mm_prefetch(reinterpret_cast<const char*>(row + 16), _MM_HINT_T0);
  }
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] =
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    _mm512_store_ps(out[i], _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
    _mm512_store_ps(out[8 + i], _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd));
  }
}

template <bool Int8, int T>
[[gnu::flatten]] void tile(const QuantMatrixView& w, int64_t o0, const Int8Rows& x, int64_t t0,
                           float* y, int64_t y_stride) {
  const int64_t rb = row_bytes(w.format, w.cols);
  const int valid = int(std::min<int64_t>(16, w.rows - o0));
  const uint8_t* rows[16];
  for (int r = 0; r < 16; ++r) rows[r] = w.data + std::min<int64_t>(o0 + r, w.rows - 1) * rb;
  const bool grouped = w.format == QuantFormat::kInt4Grouped;
  const int64_t gs = grouped ? w.group_size : kInt8Block;
  const int64_t ng = grouped ? (w.cols + gs - 1) / gs : 1;

  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  // The tile's group scales, 16 groups at a time, group-major.
  const float* tile_scales = grouped ? w.scales + o0 * ng : nullptr;
  alignas(64) float gscale[16][16];
  int64_t g_first = -16;
  // The next tile's first weights and scales, while this one runs (16 new streams each tile).
  for (int r = 0; r < 16; ++r) {
    const char* next = reinterpret_cast<const char*>(w.data + (o0 + 16 + r) * rb);
    for (int64_t b = 0; b < std::min<int64_t>(rb, kNextTileBytes); b += 64)
      _mm_prefetch(next + b, _MM_HINT_T1);
    if (grouped)
      _mm_prefetch(reinterpret_cast<const char*>(tile_scales + (16 + r) * ng), _MM_HINT_T1);
  }
  __m512 s_w = _mm512_set1_ps(1.0f);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i sign = _mm512_set1_epi8(char(0x80));

  for (int64_t k = 0; k < x.blocks; ++k) {
    if (grouped) {
      const int64_t g = k * kInt8Block / gs;
      if (g >= g_first + 16) {
        g_first = g;
        transpose_scales(tile_scales + g, ng, valid, int(std::min<int64_t>(16, ng - g)), gscale);
      }
      s_w = _mm512_load_ps(gscale[g - g_first]);
    }
    if (Int8 || k % 2 == 0)  // one line per row: 64 bytes of int8, two blocks of int4
      for (int r = 0; r < 16; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(rows[r] + (Int8 ? 64 : 32) * k + kPrefetchBytes),
                     _MM_HINT_T0);
    __m512i dot[T];
    for (int t = 0; t < T; ++t) {
      const int32_t bias = Int8 ? 128 : 8;
      dot[t] = _mm512_set1_epi32(-bias * x.sum[(t0 + t) * x.blocks + k]);
    }
    for (int half = 0; half < (Int8 ? 2 : 1); ++half) {
      const int64_t at = Int8 ? 64 * k + 32 * half : 32 * k;
      __m512i z[8];
      load_tile(rows, at, rb - at, z);
      if constexpr (Int8) {
        for (int j = 0; j < 8; ++j) z[j] = _mm512_xor_si512(z[j], sign);
        for (int t = 0; t < T; ++t) {
          const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block + 32 * half;
          for (int j = 0; j < 8; ++j)
            dot[t] = _mm512_dpbusd_epi32(dot[t], z[j], broadcast_word(q + 4 * j));
        }
      } else {
        if constexpr (T <= 2) {
          // Few rows of activations: keep the high nibbles in place (16 times their value, at
          // most 240) in a second sum and shift it back, exactly, once per block.
          const __m512i high4 = _mm512_set1_epi8(char(0xF0));
          for (int t = 0; t < T; ++t) {
            const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block;
            __m512i high = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j) {
              dot[t] = _mm512_dpbusd_epi32(dot[t], _mm512_and_si512(z[j], low4),
                                           broadcast_word(q + 8 * j));
              high = _mm512_dpbusd_epi32(high, _mm512_and_si512(z[j], high4),
                                         broadcast_word(q + 8 * j + 4));
            }
            dot[t] = _mm512_add_epi32(dot[t], _mm512_srai_epi32(high, 4));
          }
        } else {
          __m512i lo[8], hi[8];
          for (int j = 0; j < 8; ++j) {
            lo[j] = _mm512_and_si512(z[j], low4);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(z[j], 4), low4);
          }
          for (int t = 0; t < T; ++t) {
            const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block;
            for (int j = 0; j < 8; ++j) {
              dot[t] = _mm512_dpbusd_epi32(dot[t], lo[j], broadcast_word(q + 8 * j));
              dot[t] = _mm512_dpbusd_epi32(dot[t], hi[j], broadcast_word(q + 8 * j + 4));
            }
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 s = _mm512_mul_ps(s_w, _mm512_set1_ps(x.scale[(t0 + t) * x.blocks + k]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), s, acc[t]);
    }
  }
  const __mmask16 mask = __mmask16((1u << valid) - 1);
  const __m512 row_scale =
      grouped ? _mm512_set1_ps(1.0f) : _mm512_maskz_loadu_ps(mask, w.scales + o0);
  for (int t = 0; t < T; ++t)
    _mm512_mask_storeu_ps(y + (t0 + t) * y_stride + o0, mask, _mm512_mul_ps(acc[t], row_scale));
}

template <int T>
void tile_for(const QuantMatrixView& w, int64_t o0, const Int8Rows& x, int64_t t0, float* y,
              int64_t y_stride) {
  if (w.format == QuantFormat::kInt8Row)
    tile<true, T>(w, o0, x, t0, y, y_stride);
  else
    tile<false, T>(w, o0, x, t0, y, y_stride);
}

}  // namespace

float quantize_block_avx512(const float* x, int64_t cols, int64_t k, int q[kInt8Block]) {
  const int64_t i0 = k * kInt8Block, count = std::max<int64_t>(0, std::min(cols - i0, kInt8Block));
  __m512 v[4];
  __m512 amax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int c = 0; c < 4; ++c) {
    const int64_t left = std::clamp<int64_t>(count - 16 * c, 0, 16);
    const __mmask16 m = __mmask16((1u << left) - 1);
    v[c] = _mm512_maskz_loadu_ps(m, x + i0 + 16 * c);
    nan |= _mm512_cmp_ps_mask(v[c], v[c], _CMP_UNORD_Q);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[c]));
  }
  const float a = _mm512_reduce_max_ps(amax);
  for (int j = 0; j < kInt8Block; ++j) q[j] = 0;
  if (nan != 0 || !(a <= 3.4028235e38f)) return __builtin_nanf("");
  const float inv_a = 127.0f / a;
  if (!(inv_a <= 3.4028235e38f)) return 0.0f;  // zero, or below ~3.7e-37
  const __m512 inv = _mm512_set1_ps(inv_a);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int c = 0; c < 4; ++c) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[c], inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_storeu_si512(q + 16 * c, _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi)));
  }
  return a / 127.0f;
}

void int8_rows_avx512vnni(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                          int64_t row_begin, int64_t row_end) {
  for (int64_t o0 = row_begin; o0 < row_end; o0 += kInt8TileRows)
    for_tiles<kMaxTile>(x.n, [&]<int T>(int64_t t0) { tile_for<T>(w, o0, x, t0, y, y_stride); });
}

}  // namespace colibri::kernels::detail
