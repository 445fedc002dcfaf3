// AVX-512 kernels (compiled with -mavx512f -mavx512bw -mavx512vl -mfma; called only after CPUID).
//
// int4: a block of packed bytes is spread over the 16 32-bit lanes so that each lane holds L
// consecutive nibbles (L = 8: 64 bytes loaded as they are; L = 4: 32 bytes zero-extended from
// 16-bit; L = 2: 16 bytes from 8-bit; L = 1: 8 bytes, low nibbles in lanes 0-7 and high nibbles
// in lanes 8-15). vpermps reads only the low 4 bits of each lane as its index, so step m of a
// block is one shift by 4m and one vpermps into a 16-entry table holding (q - 8) * s for the
// block's group: the nibble is decoded and scaled with no mask, subtract or convert. The
// activations are permuted once per call to match (quant_detail.h), the largest L that keeps a
// block inside one scale group is used, and inputs after the last full block are done in scalar
// code. At n = 1 eight independent accumulators hide the FMA latency, and group sizes 16-64
// (GLM's g64 included) take 64-byte blocks spanning several groups, decoded unscaled and then
// scaled lane by lane (int4_row_split_scales); for n > 1 four output rows are done together so
// that each activation load feeds four FMAs.
#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "cpu/batch_tiles.h"
#include "cpu/quant_detail.h"

// GCC 12 warns inside the intrinsic headers (their _mm512_undefined_* operands, GCC PR 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace colibri::kernels::detail {
namespace {

// Software prefetch this far ahead in a weight row (into the next rows at a row's end): the
// hardware prefetcher alone left a single thread at ~0.5 of its streaming read bandwidth, since
// the decode work between loads keeps fewer misses in flight than a plain read loop; 4 KiB
// measured ~0.7 on the GLM-5.2 expert shapes, 1-2 KiB less, 8-32 KiB no better.
constexpr int64_t kPrefetchBytes = 4096;

constexpr int kMaxTile = 4;  // batch rows per tile; with 4 output rows, 16 accumulators

float nibble_value(const uint8_t* row, int64_t i) {
  const uint8_t b = row[i >> 1];
  return float(int((i & 1) ? (b >> 4) : (b & 15)) - 8);
}

// Blocks of L nibbles per lane (see the file comment).
template <int L>
struct Int4Blocks {
  static constexpr int kInputs = L == 1 ? 16 : 16 * L;  // inputs per block
  static constexpr int kSteps = L == 1 ? 1 : L;         // vpermps per block
  static constexpr int kBytes = kInputs / 2;            // packed bytes per block

  static __m512i load(const uint8_t* bytes) {
    if constexpr (L == 8) {
      // Two 256-bit loads: with one 512-bit load per block, streaming from DRAM ran at half
      // the speed (8-14 instead of 20-22 GB/s on one thread), though it is faster from L2.
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32));
      return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    } else if constexpr (L == 4) {
      return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
    } else if constexpr (L == 2) {
      return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    } else {
      const __m256i raw =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
      return _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi32(raw, 4), 1);
    }
  }
  template <int M>
  static __m512i step(__m512i raw) {
    if constexpr (M == 0)
      return raw;
    else
      return _mm512_srli_epi32(raw, 4 * M);
  }
};

// Calls f.template operator()<I>() for I = 0 .. N-1.
template <int N, typename F>
inline void unrolled(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f.template operator()<I>(), ...);
  }
  (std::make_integer_sequence<int, N>{});
}

// RO output rows (1 or 4) for T batch rows: y[r][t * y_stride] = sum_i W[row r, i] xp[t, i].
// gscale[r]: the row's group scales (Grouped) or nullptr; row_scale[r]: the per-row scale.
// flatten: the step and block lambdas must be inlined for the accumulators to stay in registers.
template <int L, bool Grouped, int RO, int T>
[[gnu::flatten]] void int4_tile(const uint8_t* const* row, const float* const* gscale,
                                const float* row_scale, int64_t cols, int64_t group_size,
                                const float* xp, float* const* y, int64_t y_stride) {
  using Blk = Int4Blocks<L>;
  constexpr int S = Blk::kSteps, BL = Blk::kInputs;
  // J independent running sums per (output row, batch row), so that ~8 FMA chains are in
  // flight; U blocks are unrolled so that the sum a step uses is known at compile time.
  constexpr int J = RO * T >= 8 ? 1 : RO * T >= 4 ? 2 : RO * T >= 2 ? 4 : 8;
  constexpr int U = J > S ? J / S : 1;

  const __m512 base = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 table[RO];
  for (int r = 0; r < RO; ++r)
    table[r] = Grouped ? _mm512_mul_ps(base, _mm512_set1_ps(gscale[r][0])) : base;
  __m512 acc[RO][T][J];
  for (int r = 0; r < RO; ++r)
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < J; ++j) acc[r][t][j] = _mm512_setzero_ps();

  const int64_t full = cols / BL * BL;
  int64_t group = 0, next_group = group_size;
  const auto block = [&]<int Unroll>(int64_t i) {
    if constexpr (Grouped) {
      if (i == next_group) {  // blocks never straddle groups: group_size % BL == 0
        ++group;
        next_group += group_size;
        for (int r = 0; r < RO; ++r)
          table[r] = _mm512_mul_ps(base, _mm512_set1_ps(gscale[r][group]));
      }
    }
    __m512i raw[RO];
    for (int r = 0; r < RO; ++r) {
      if (Blk::kBytes >= 32 || (i / 2) % 64 == 0)  // about once per cache line
        _mm_prefetch(reinterpret_cast<const char*>(row[r] + i / 2 + kPrefetchBytes), _MM_HINT_T0);
      raw[r] = Blk::load(row[r] + i / 2);
    }
    unrolled<S>([&]<int M>() {
      __m512 w[RO];
      for (int r = 0; r < RO; ++r)
        w[r] = _mm512_permutexvar_ps(Blk::template step<M>(raw[r]), table[r]);
      constexpr int j = (Unroll * S + M) % J;
      for (int t = 0; t < T; ++t) {
        const __m512 xv = _mm512_loadu_ps(xp + t * cols + i + 16 * M);
        for (int r = 0; r < RO; ++r) acc[r][t][j] = _mm512_fmadd_ps(w[r], xv, acc[r][t][j]);
      }
    });
  };
  int64_t i = 0;
  for (; i + U * BL <= full; i += U * BL)
    unrolled<U>([&]<int u>() { block.template operator()<u>(i + u * BL); });
  for (; i < full; i += BL) block.template operator()<0>(i);

  for (int r = 0; r < RO; ++r) {
    const float tail_scale = Grouped ? gscale[r][(cols - 1) / group_size] : 1.0f;
    for (int t = 0; t < T; ++t) {
      __m512 sum = acc[r][t][0];
      for (int j = 1; j < J; ++j) sum = _mm512_add_ps(sum, acc[r][t][j]);
      float tail = 0.0f;  // inputs after the last full block: natural order, one group
      for (int64_t k = full; k < cols; ++k) tail += nibble_value(row[r], k) * xp[t * cols + k];
      y[r][t * y_stride] = row_scale[r] * (_mm512_reduce_add_ps(sum) + tail_scale * tail);
    }
  }
}

// int8 rows: blocks of 16 weights, sign-extended and converted; the row scale at the end.
template <int RO, int T>
[[gnu::flatten]] void int8_tile(const int8_t* const* row, const float* row_scale, int64_t cols,
                                const float* x, float* const* y, int64_t y_stride) {
  constexpr int J = RO * T >= 8 ? 1 : RO * T >= 4 ? 2 : RO * T >= 2 ? 4 : 8;  // as in int4_tile
  __m512 acc[RO][T][J];
  for (int r = 0; r < RO; ++r)
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < J; ++j) acc[r][t][j] = _mm512_setzero_ps();
  const int64_t full = cols / 16 * 16;
  const auto block = [&]<int j>(int64_t i) {
    __m512 w[RO];
    for (int r = 0; r < RO; ++r)
      if (i % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(row[r] + i + kPrefetchBytes), _MM_HINT_T0);
    for (int r = 0; r < RO; ++r)
      w[r] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + i))));
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * cols + i);
      for (int r = 0; r < RO; ++r) acc[r][t][j] = _mm512_fmadd_ps(w[r], xv, acc[r][t][j]);
    }
  };
  int64_t i = 0;
  for (; i + J * 16 <= full; i += J * 16)
    unrolled<J>([&]<int j>() { block.template operator()<j>(i + j * 16); });
  for (; i < full; i += 16) block.template operator()<0>(i);
  for (int r = 0; r < RO; ++r)
    for (int t = 0; t < T; ++t) {
      __m512 sum = acc[r][t][0];
      for (int j = 1; j < J; ++j) sum = _mm512_add_ps(sum, acc[r][t][j]);
      float tail = 0.0f;
      for (int64_t k = full; k < cols; ++k) tail += float(row[r][k]) * x[t * cols + k];
      y[r][t * y_stride] = row_scale[r] * (_mm512_reduce_add_ps(sum) + tail);
    }
}

// The G scales of a block in the low lanes (the others undefined). Plain narrow loads: a masked
// 512-bit load here halved the DRAM streaming speed of the whole kernel.
template <int G>
__m512 load_scales(const float* s) {
  if constexpr (G == 2)
    return _mm512_castps128_ps512(
        _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
  else if constexpr (G == 4)
    return _mm512_castps128_ps512(_mm_loadu_ps(s));
  else
    return _mm512_castps256_ps512(_mm256_loadu_ps(s));
}

// n = 1 with group sizes 16, 32, 64: 128-input blocks as for L = 8 (64 bytes, no widening),
// holding G = 128 / group_size groups; lane k covers inputs 8k..8k+7, so lane k belongs to
// group k * G / 16 of the block. The block is decoded unscaled into two FMA chains, and their
// sum is scaled by the vector of the block's G scales (one load and one vpermps): fewer
// instructions per byte than a scaled table per group of 64 or fewer inputs, and faster from
// DRAM (26.5 against 24 GB/s on one thread for g64).
template <int G>
[[gnu::flatten]] void int4_row_split_scales(const uint8_t* row, const float* gscale, int64_t cols,
                                            const float* xp, float* y) {
  using Blk = Int4Blocks<8>;
  constexpr int64_t kGroup = 128 / G;
  const __m512 base = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i lane_group = _mm512_srli_epi32(
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(G)),
      4);  // k * G / 16
  __m512 total[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t full = cols / 128 * 128;
  const auto block = [&]<int u>(int64_t i) {
    _mm_prefetch(reinterpret_cast<const char*>(row + i / 2 + kPrefetchBytes), _MM_HINT_T0);
    const __m512i raw = Blk::load(row + i / 2);
    __m512 d[2];
    unrolled<8>([&]<int M>() {
      const __m512 wv = _mm512_permutexvar_ps(Blk::template step<M>(raw), base);
      const __m512 xv = _mm512_loadu_ps(xp + i + 16 * M);
      d[M % 2] = M < 2 ? _mm512_mul_ps(wv, xv) : _mm512_fmadd_ps(wv, xv, d[M % 2]);
    });
    const __m512 scales = _mm512_permutexvar_ps(lane_group, load_scales<G>(gscale + i / kGroup));
    total[u] = _mm512_fmadd_ps(_mm512_add_ps(d[0], d[1]), scales, total[u]);
  };
  int64_t i = 0;
  for (; i + 256 <= full; i += 256) {
    block.template operator()<0>(i);
    block.template operator()<1>(i + 128);
  }
  if (i < full) block.template operator()<0>(i);
  float tail = 0.0f;  // inputs after the last full block, natural order, up to G groups
  for (int64_t k = full; k < cols; ++k) tail += nibble_value(row, k) * gscale[k / kGroup] * xp[k];
  *y = _mm512_reduce_add_ps(_mm512_add_ps(total[0], total[1])) + tail;
}

// Rows [row_begin, row_end): one at a time at n = 1; otherwise four at a time, so that each
// activation load feeds four FMAs (the activations of a tile, T x cols floats, live in L2), and
// the last rows % 4 rows of the matrix one at a time. Ranges start at multiples of
// kRowAlignment, so which rows go together (and so each row's summation order) does not
// depend on the thread count.
template <typename Tile>
void walk_rows(int64_t n, int64_t row_begin, int64_t row_end, Tile&& tile) {
  static_assert(kRowAlignment % 4 == 0);
  int64_t o = row_begin;
  if (n > 1)
    for (; o + 4 <= row_end; o += 4) tile.template operator()<4>(o);
  for (; o < row_end; ++o) tile.template operator()<1>(o);
}

template <int L, bool Grouped>
void int4_rows(const QuantMatrixView& w, const float* xp, int64_t n, float* y, int64_t y_stride,
               int64_t row_begin, int64_t row_end) {
  const int64_t rb = (w.cols + 1) / 2;
  const int64_t ng = Grouped ? (w.cols + w.group_size - 1) / w.group_size : 1;
  walk_rows(n, row_begin, row_end, [&]<int RO>(int64_t o) {
    const uint8_t* rows[RO];
    const float* gscale[RO];
    float row_scale[RO];
    for (int r = 0; r < RO; ++r) {
      rows[r] = w.data + (o + r) * rb;
      gscale[r] = Grouped ? w.scales + (o + r) * ng : nullptr;
      row_scale[r] = Grouped ? 1.0f : w.scales[o + r];
    }
    for_tiles<kMaxTile>(n, [&]<int T>(int64_t t0) {
      float* out[RO];
      for (int r = 0; r < RO; ++r) out[r] = y + t0 * y_stride + o + r;
      int4_tile<L, Grouped, RO, T>(rows, gscale, row_scale, w.cols, w.group_size, xp + t0 * w.cols,
                                   out, y_stride);
    });
  });
}

void int8_rows(const QuantMatrixView& w, const float* x, int64_t n, float* y, int64_t y_stride,
               int64_t row_begin, int64_t row_end) {
  walk_rows(n, row_begin, row_end, [&]<int RO>(int64_t o) {
    const int8_t* rows[RO];
    float row_scale[RO];
    for (int r = 0; r < RO; ++r) {
      rows[r] = reinterpret_cast<const int8_t*>(w.data) + (o + r) * w.cols;
      row_scale[r] = w.scales[o + r];
    }
    for_tiles<kMaxTile>(n, [&]<int T>(int64_t t0) {
      float* out[RO];
      for (int r = 0; r < RO; ++r) out[r] = y + t0 * y_stride + o + r;
      int8_tile<RO, T>(rows, row_scale, w.cols, x + t0 * w.cols, out, y_stride);
    });
  });
}

template <int G>
void int4_rows_split_scales(const QuantMatrixView& w, const float* xp, int64_t n, float* y,
                            int64_t y_stride, int64_t row_begin, int64_t row_end) {
  const int64_t rb = (w.cols + 1) / 2, ng = (w.cols + w.group_size - 1) / w.group_size;
  for (int64_t o = row_begin; o < row_end; ++o)
    int4_row_split_scales<G>(w.data + o * rb, w.scales + o * ng, w.cols, xp, y + o);
}

}  // namespace

void rows_avx512(const QuantMatrixView& w, const float* xp, int64_t n, float* y, int64_t y_stride,
                 int64_t row_begin, int64_t row_end) {
  const auto run = [&](auto kernel) { kernel(w, xp, n, y, y_stride, row_begin, row_end); };
  if (w.format == QuantFormat::kInt8Row) return run(int8_rows);
  if (w.format == QuantFormat::kInt4Row) return run(int4_rows<8, false>);
  // The layout rule of quant_detail.h.
  const int gs = w.group_size;
  if (n == 1 && gs == 64) return run(int4_rows_split_scales<2>);
  if (n == 1 && gs == 32) return run(int4_rows_split_scales<4>);
  if (n == 1 && gs == 16) return run(int4_rows_split_scales<8>);
  if (gs % 128 == 0) return run(int4_rows<8, true>);
  if (gs % 64 == 0) return run(int4_rows<4, true>);
  if (gs % 32 == 0) return run(int4_rows<2, true>);
  return run(int4_rows<1, true>);
}

}  // namespace colibri::kernels::detail
