// The int8-activation kernel over tiles of 8 weight rows in 256-bit vectors, for three instruction
// sets: pmaddubsw + pmaddwd (AVX2, quant_int8_avx2.cpp), vpdpbusd on ymm with AVX-VNNI
// (quant_int8_avxvnni.cpp) and with AVX-512 VL + VNNI (quant_int8_tiles_vnni.cpp, for its last 8
// rows). The operations: quant_int8_detail.h.
//
// Included only by those files, each compiled with its own flags: everything here has
// internal linkage (anonymous namespace), so no copy built for one ISA is linked into the other
// (quant_detail.h).
//
// A tile is 8 output rows, lane r of every vector is row r. Per 64-input block, 32 bytes of each
// row (int4: the whole block; int8: half of it) are transposed as an 8x8 table of 32-bit words;
// a kTiles matrix (quant.h) stores them so, and 8 loads take the place of the transpose.
// AVX2: pmaddubsw multiplies unsigned by signed bytes into saturating 16-bit pairs and pmaddwd
// with ones widens them to the lanes. int4: nibbles 0-15 against |q| <= 127, so the low- and
// high-nibble pairs (each at most 2 * 15 * 127) are added in 16 bits, from the bias correction.
// int8: |w| times q with w's sign (psignb; no pair above 2 * 128 * 127), so no bias.
// VNNI: vpdpbusd adds the 4 products of a lane into 32 bits in one instruction; int4 as above,
// int8 read as w + 128 (the sign bit flipped) with the bias -128 * sum_k.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/batch_tiles.h"
#include "cpu/quant_int8_detail.h"

namespace colibri::kernels::detail {
namespace {
namespace tile8 {

constexpr int kMaxTile = 8;

inline void transpose(__m256i z[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    z[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
    z[c + 4] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
  }
}

inline void load_tile(const uint8_t* const rows[8], int64_t at, int64_t avail, __m256i z[8]) {
  alignas(32) uint8_t pad[8][32];
  for (int r = 0; r < 8; ++r) {
    const uint8_t* src = rows[r] + at;
    if (avail < 32) {
      std::memset(pad[r], 0, 32);
      std::memcpy(pad[r], src, size_t(std::max<int64_t>(avail, 0)));
      src = pad[r];
    }
    z[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  }
  transpose(z);
}

// group_scales[i][r] = scales[min(r, valid - 1) * ng + g8 + i] (0 past the last group).
inline void load_group_scales(const float* scales, int valid, int64_t ng, int64_t g8,
                              float group_scales[8][8]) {
  __m256i z[8];
  for (int r = 0; r < 8; ++r) {
    const float* row = scales + std::min(r, valid - 1) * ng + g8;
    if (g8 + 8 <= ng) {
      z[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    } else {
      alignas(32) float pad[8] = {};
      std::memcpy(pad, row, size_t(ng - g8) * sizeof(float));
      z[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(pad));
    }
  }
  transpose(z);
  for (int i = 0; i < 8; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(group_scales[i]), z[i]);
}

// vpdpbusd on ymm: the EVEX form (AVX-512 VL + VNNI) or the VEX one (AVX-VNNI), the same result.
// Never called where neither is compiled in (the pmaddubsw kernels).
inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u8, s8);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#else
  (void)u8;
  (void)s8;
  __builtin_unreachable();
  return acc;
#endif
}

inline __m256i broadcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Tiled: w is kTiles (quant.h), whose 8 rows of a 32-byte chunk are already the transposed z.
template <bool Vnni, bool Int8, bool Tiled, int T>
[[gnu::flatten]] void tile(const QuantMatrixView& w, int64_t o0, const Int8Rows& x, int64_t t0,
                           float* y, int64_t y_stride) {
  const int64_t rb = row_bytes(w.format, w.cols);
  const int valid = int(std::min<int64_t>(8, w.rows - o0));
  const uint8_t* rows[8];
  for (int r = 0; r < 8; ++r) rows[r] = w.data + std::min<int64_t>(o0 + r, w.rows - 1) * rb;
  const bool grouped = w.format == QuantFormat::kInt4Grouped;
  const int64_t gs = grouped ? w.group_size : kInt8Block;
  const int64_t ng = grouped ? (w.cols + gs - 1) / gs : 1;
  const float* tile_scales = grouped ? w.scales + o0 * ng : nullptr;
  // The tile's group scales, 8 groups at a time: group_scales[i] holds the 8 rows' scales of group
  // g8 + i (a gather, or 8 scalar loads a block, is slow on AMD).
  alignas(32) float group_scales[8][8];
  int64_t g8 = -1;
  __m256 s_w = _mm256_set1_ps(1.0f);
  // The tile's 8 rows are one contiguous span, read as 8 streams: the hardware prefetcher keeps
  // few of them ahead. Fetch a later tile's span instead (and its group scales), swept at the
  // rate this one is read. Two tiles ahead (1 to 8 measure alike): int4 FFN, one row, 1 thread,
  // 6.0 to 8.7-10.6 GB/s (bench/RESULTS.md).
  constexpr int64_t kStep = 8 * (Int8 ? 64 : 32);
  const int64_t next = (o0 + 16) * rb, end = w.rows * rb;
  const int64_t scales_next = (o0 + 16) * ng, scales_end = w.rows * ng;  // floats
  // VNNI: a second accumulator per activation row for the high nibbles while few rows give
  // independent chains (vpdpbusd's latency, not its rate, would bound one row).
  constexpr int kChains = Vnni && !Int8 && T <= 4 ? 2 : 1;

  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i sign8 = _mm256_set1_epi8(char(0x80));

  for (int64_t k = 0; k < x.blocks; ++k) {
    if (grouped) {
      const int64_t g = k * kInt8Block / gs;
      if constexpr (Tiled) {
        s_w = _mm256_loadu_ps(tile_scales + 8 * g);
      } else {
        if (g8 < 0 || g >= g8 + 8) {
          g8 = g;
          load_group_scales(tile_scales, valid, ng, g8, group_scales);
        }
        s_w = _mm256_load_ps(group_scales[g - g8]);
      }
    }
    for (int64_t at = next + kStep * k; at < std::min(next + kStep * (k + 1), end); at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w.data + at), _MM_HINT_T0);
    if (grouped && k % 2 == 0 && scales_next + 8 * k < scales_end)  // 8 floats a step
      _mm_prefetch(reinterpret_cast<const char*>(w.scales + scales_next + 8 * k), _MM_HINT_T0);
    __m256i dot[T][kChains];
    for (int t = 0; t < T; ++t) {
      const int32_t sum = x.sum[(t0 + t) * x.blocks + k];
      dot[t][0] = _mm256_set1_epi32(Int8 ? (Vnni ? -128 * sum : 0) : -8 * sum);
      if constexpr (kChains == 2) dot[t][1] = _mm256_setzero_si256();
    }
    for (int half = 0; half < (Int8 ? 2 : 1); ++half) {
      const int64_t at = Int8 ? 64 * k + 32 * half : 32 * k;
      __m256i z[8];
      if constexpr (Tiled) {
        const uint8_t* chunk = w.data + o0 * rb + at / 32 * 256;
        for (int j = 0; j < 8; ++j)
          z[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * j));
      } else {
        load_tile(rows, at, rb - at, z);
      }
      if constexpr (Int8 && Vnni) {
        for (int j = 0; j < 8; ++j) {
          const __m256i biased = _mm256_xor_si256(z[j], sign8);
          for (int t = 0; t < T; ++t) {
            const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block + 32 * half;
            dot[t][0] = dpbusd(dot[t][0], biased, broadcast_word(q + 4 * j));
          }
        }
      } else if constexpr (Int8) {
        __m256i a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_abs_epi8(z[j]);
        for (int t = 0; t < T; ++t) {
          const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block + 32 * half;
          for (int j = 0; j < 8; ++j) {
            const __m256i signed_q = _mm256_sign_epi8(broadcast_word(q + 4 * j), z[j]);
            dot[t][0] = _mm256_add_epi32(
                dot[t][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a[j], signed_q), ones16));
          }
        }
      } else if constexpr (Vnni) {
        for (int j = 0; j < 8; ++j) {
          const __m256i lo = _mm256_and_si256(z[j], low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(z[j], 4), low4);
          for (int t = 0; t < T; ++t) {
            const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block + 8 * j;
            dot[t][0] = _mm256_dpbusd_epi32(dot[t][0], lo, broadcast_word(q));
            dot[t][kChains - 1] =
                _mm256_dpbusd_epi32(dot[t][kChains - 1], hi, broadcast_word(q + 4));
          }
        }
      } else {
        // Word j's pairs are at most 2 * 2 * 15 * 127 = 7620: words 0-3 and 4-7 add in 16 bits.
        __m256i sums[T][2];
        for (int t = 0; t < T; ++t) sums[t][0] = sums[t][1] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c)
          for (int j : {c, c + 4}) {  // the two sums alternate: ~10 % faster at 8 rows than 0..7
            const __m256i lo = _mm256_and_si256(z[j], low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(z[j], 4), low4);
            for (int t = 0; t < T; ++t) {
              const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block + 8 * j;
              const __m256i pairs =
                  _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast_word(q)),
                                   _mm256_maddubs_epi16(hi, broadcast_word(q + 4)));
              sums[t][j / 4] = _mm256_add_epi16(sums[t][j / 4], pairs);
            }
          }
        for (int t = 0; t < T; ++t)
          dot[t][0] =
              _mm256_add_epi32(dot[t][0], _mm256_add_epi32(_mm256_madd_epi16(sums[t][0], ones16),
                                                           _mm256_madd_epi16(sums[t][1], ones16)));
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m256i d = kChains == 2 ? _mm256_add_epi32(dot[t][0], dot[t][kChains - 1]) : dot[t][0];
      const __m256 s = _mm256_mul_ps(s_w, _mm256_set1_ps(x.scale[(t0 + t) * x.blocks + k]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[t]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane);
  const __m256 row_scale = grouped ? _mm256_set1_ps(1.0f) : _mm256_maskload_ps(w.scales + o0, mask);
  for (int t = 0; t < T; ++t)
    _mm256_maskstore_ps(y + (t0 + t) * y_stride + o0, mask, _mm256_mul_ps(acc[t], row_scale));
}

template <bool Vnni, int T>
void tile_for(const QuantMatrixView& w, int64_t o0, const Int8Rows& x, int64_t t0, float* y,
              int64_t y_stride) {
  const bool tiled = w.layout == QuantLayout::kTiles;
  if (w.format == QuantFormat::kInt8Row) {
    if (tiled)
      tile<Vnni, true, true, T>(w, o0, x, t0, y, y_stride);
    else
      tile<Vnni, true, false, T>(w, o0, x, t0, y, y_stride);
  } else if (tiled) {
    tile<Vnni, false, true, T>(w, o0, x, t0, y, y_stride);
  } else {
    tile<Vnni, false, false, T>(w, o0, x, t0, y, y_stride);
  }
}

// The Int8RowsKernel (quant_int8_detail.h) over tiles of 8 rows, either layout of w.
template <bool Vnni>
void rows(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
          int64_t row_begin, int64_t row_end) {
  for (int64_t o0 = row_begin; o0 < row_end; o0 += 8)
    for_tiles<kMaxTile>(x.n,
                        [&]<int T>(int64_t t0) { tile_for<Vnni, T>(w, o0, x, t0, y, y_stride); });
}

}  // namespace tile8
}  // namespace
}  // namespace colibri::kernels::detail
