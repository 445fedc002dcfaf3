// int8-activation kernel for AVX2 (compiled with -mavx2 -mfma; called only after CPUID), also
// used on AVX-512 CPUs without VNNI. The operations: quant_int8_detail.h.
//
// A tile is 8 output rows, lane r of every vector is row r. Per 64-input block, 32 bytes of each
// row (int4: the whole block; int8: half of it) are transposed as an 8x8 table of 32-bit words;
// a kTiles matrix (quant.h) stores them so, and 8 loads take the place of the transpose.
// pmaddubsw multiplies unsigned by signed bytes into saturating 16-bit pairs and pmaddwd with ones
// widens them to the lanes. int4: nibbles 0-15 against |q| <= 127, so the low- and high-nibble
// pairs (each at most 2 * 15 * 127) are added in 16 bits, from the bias correction. int8: |w|
// times q with w's sign (psignb; no pair above 2 * 128 * 127), so no bias.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/quant_int8_detail.h"

namespace colibri::kernels::detail {
namespace {

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

inline __m256i broadcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Tiled: w is kTiles (quant.h), whose 8 rows of a 32-byte chunk are already the transposed z.
template <bool Int8, bool Tiled, int T>
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

  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);

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
    __m256i dot[T];
    for (int t = 0; t < T; ++t)
      dot[t] =
          Int8 ? _mm256_setzero_si256() : _mm256_set1_epi32(-8 * x.sum[(t0 + t) * x.blocks + k]);
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
      if constexpr (Int8) {
        __m256i a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_abs_epi8(z[j]);
        for (int t = 0; t < T; ++t) {
          const int8_t* q = x.q + ((t0 + t) * x.blocks + k) * kInt8Block + 32 * half;
          for (int j = 0; j < 8; ++j) {
            const __m256i signed_q = _mm256_sign_epi8(broadcast_word(q + 4 * j), z[j]);
            dot[t] = _mm256_add_epi32(
                dot[t], _mm256_madd_epi16(_mm256_maddubs_epi16(a[j], signed_q), ones16));
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
          dot[t] =
              _mm256_add_epi32(dot[t], _mm256_add_epi32(_mm256_madd_epi16(sums[t][0], ones16),
                                                        _mm256_madd_epi16(sums[t][1], ones16)));
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m256 s = _mm256_mul_ps(s_w, _mm256_set1_ps(x.scale[(t0 + t) * x.blocks + k]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), s, acc[t]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane);
  const __m256 row_scale = grouped ? _mm256_set1_ps(1.0f) : _mm256_maskload_ps(w.scales + o0, mask);
  for (int t = 0; t < T; ++t)
    _mm256_maskstore_ps(y + (t0 + t) * y_stride + o0, mask, _mm256_mul_ps(acc[t], row_scale));
}

template <int T>
void tile_for(const QuantMatrixView& w, int64_t o0, const Int8Rows& x, int64_t t0, float* y,
              int64_t y_stride) {
  const bool tiled = w.layout == QuantLayout::kTiles;
  if (w.format == QuantFormat::kInt8Row) {
    if (tiled)
      tile<true, true, T>(w, o0, x, t0, y, y_stride);
    else
      tile<true, false, T>(w, o0, x, t0, y, y_stride);
  } else if (tiled) {
    tile<false, true, T>(w, o0, x, t0, y, y_stride);
  } else {
    tile<false, false, T>(w, o0, x, t0, y, y_stride);
  }
}

}  // namespace

float quantize_block_avx2(const float* x, int64_t cols, int64_t k, int q[kInt8Block]) {
  const int64_t i0 = k * kInt8Block, count = std::max<int64_t>(0, std::min(cols - i0, kInt8Block));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[8];
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int c = 0; c < 8; ++c) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(count - 8 * c)), lane);
    v[c] = _mm256_maskload_ps(x + i0 + 8 * c, m);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[c], v[c], _CMP_UNORD_Q));
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float a = _mm_cvtss_f32(m4);
  for (int j = 0; j < kInt8Block; ++j) q[j] = 0;
  if (_mm256_movemask_ps(nan) != 0 || !(a <= 3.4028235e38f)) return __builtin_nanf("");
  const float inv_a = 127.0f / a;
  if (!(inv_a <= 3.4028235e38f)) return 0.0f;  // zero, or below ~3.7e-37
  const __m256 inv = _mm256_set1_ps(inv_a);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int c = 0; c < 8; ++c) {
    const __m256 r =
        _mm256_round_ps(_mm256_mul_ps(v[c], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * c),
                        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)));
  }
  return a / 127.0f;
}

void int8_rows_avx2(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                    int64_t row_begin, int64_t row_end) {
  for (int64_t o0 = row_begin; o0 < row_end; o0 += 8)
    for (int64_t t0 = 0; t0 < x.n; t0 += kMaxTile) {
      switch (std::min<int64_t>(kMaxTile, x.n - t0)) {
        case 1:
          tile_for<1>(w, o0, x, t0, y, y_stride);
          break;
        case 2:
          tile_for<2>(w, o0, x, t0, y, y_stride);
          break;
        case 3:
          tile_for<3>(w, o0, x, t0, y, y_stride);
          break;
        case 4:
          tile_for<4>(w, o0, x, t0, y, y_stride);
          break;
        case 5:
          tile_for<5>(w, o0, x, t0, y, y_stride);
          break;
        case 6:
          tile_for<6>(w, o0, x, t0, y, y_stride);
          break;
        case 7:
          tile_for<7>(w, o0, x, t0, y, y_stride);
          break;
        default:
          tile_for<8>(w, o0, x, t0, y, y_stride);
          break;
      }
    }
}

}  // namespace colibri::kernels::detail
