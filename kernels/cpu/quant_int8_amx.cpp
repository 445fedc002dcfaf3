// int8-activation kernel with AMX int8 tiles (compiled with -mamx-tile -mamx-int8 and the AVX-512
// flags; called only after CPUID, XCR0, the kernel's permission and amx_enabled(): quant.h). The
// operations: quant_int8_detail.h, the same per-block fp32 steps in the same order, so the results
// are the scalar reference's bit for bit.
//
// Weights: per 16 output rows, unpacked on the fly into a per-thread buffer as the B operand of
// tdpbssd: block k is a 16 x 64-byte tile whose row kk holds, for each output row n, the 4 signed
// weights (int4: nibble - 8) that meet activation bytes 4kk..4kk+3 of the block (their order in
// quant_int8_detail.h). The container's bytes cannot feed a tile as they are (int4 has no tile
// type; a kTiles word spans 8 rows, a tile row 16); unpacked once per call and 16 rows, the
// buffer (cols bytes: 96 KiB at 6144 inputs) serves every activation row, which is why the kernel
// is used from kAmxMinRows rows up. The weights in memory keep the one layout the decode kernels
// read.
//
// Activations: copied as A tiles, [block][tile of 16 rows][16][64] (rows past n zero). Loop: two
// output tiles (tiles 6, 7) per pass; per block, each activation tile (4 or 5) against both into
// two accumulators (0-1 or 2-3, alternating), whose int32 sums d_k (exact) are stored and scaled
// into fp32 accumulators in memory one activation tile later, while the next multiplies run.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "cpu/quant_detail.h"
#include "cpu/quant_int8_detail.h"

// GCC 12 warns inside the intrinsic headers (their _mm512_undefined_* operands, GCC PR 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace colibri::kernels::detail {
namespace {

constexpr int64_t kTileBytes = 16 * 64;  // one B tile: 16 rows of 64 bytes

// The palette-1 tile configuration (64 bytes, as ldtilecfg reads it).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Tiles 0-7, each 16 rows of 64 bytes: 0-3 accumulators, 4-5 activations, 6-7 weights.
void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// 64-byte aligned storage for the buffers the tiles load.
template <typename T>
struct AlignedAlloc {
  using value_type = T;
  AlignedAlloc() = default;
  template <typename U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* q, size_t) { ::operator delete(q, std::align_val_t(64)); }
  bool operator==(const AlignedAlloc&) const { return true; }
};

// 16 output rows unpacked: the B tiles [blocks][16][64], the block scales [blocks][16] (zero for
// rows past the matrix) and the row scales [16].
struct Weights {
  std::vector<int8_t, AlignedAlloc<int8_t>> b;
  std::vector<float> s_w;
  float row_scale[16];
};

// Per thread: two output tiles of weights; the activations as A tiles [blocks][tiles][16][64]
// (rows past n zero); the accumulators [tiles * 16][32] (activation row, output row).
struct Packed {
  Weights w[2];
  std::vector<int8_t, AlignedAlloc<int8_t>> a;
  std::vector<float, AlignedAlloc<float>> acc;
};
thread_local Packed packed;

inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i hi =
      b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Rows o0..o0+15 of w (those below w.rows) into p; rows past w.rows are zero weights with
// zero scales.
void pack(const QuantMatrixView& w, int64_t o0, int64_t blocks, Weights& p) {
  const int64_t rb = row_bytes(w.format, w.cols);
  const bool int8 = w.format == QuantFormat::kInt8Row;
  const bool grouped = w.format == QuantFormat::kInt4Grouped;
  const int64_t ng = grouped ? (w.cols + w.group_size - 1) / w.group_size : 1;
  const int live = int(std::min<int64_t>(16, w.rows - o0));
  if (int64_t(p.b.size()) < blocks * kTileBytes) p.b.resize(size_t(blocks * kTileBytes));
  if (int64_t(p.s_w.size()) < blocks * 16) p.s_w.resize(size_t(blocks * 16));
  int8_t* b = p.b.data();

  // scale_at, inline: per row [rows]; grouped [rows][groups] or [tile][group][8].
  const bool tiles = w.layout == QuantLayout::kTiles;
  for (int n = 0; n < 16; ++n) {
    const int64_t o = o0 + n;
    p.row_scale[n] = n < live && !grouped ? w.scales[o] : 0.0f;
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t g = k * kInt8Block / std::max(w.group_size, 1);
      p.s_w[size_t(k * 16 + n)] =
          n >= live ? 0.0f
          : !grouped
              ? 1.0f
              : w.scales[tiles ? (o / kTileRows * ng + g) * kTileRows + o % kTileRows : o * ng + g];
    }
  }

  // kTiles with whole blocks: each tile word (4 bytes of 8 rows) is half a B row, loaded as is.
  if (w.layout == QuantLayout::kTiles) {
    const uint8_t* tile_a = w.data + o0 * rb;
    const uint8_t* tile_b = live > 8 ? tile_a + 8 * rb : nullptr;  // rows are whole tiles of 8
    const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t k = 0; k < blocks; ++k) {
      int8_t* bk = b + k * kTileBytes;
      for (int kk = 0; kk < 16; ++kk) {
        if (int8) {  // chunk 2k + kk / 8, word kk % 8
          const int64_t at = (2 * k + kk / 8) * 256 + 32 * (kk % 8);
          _mm512_store_si512(bk + 64 * kk, load_pair(tile_a + at, tile_b ? tile_b + at : nullptr));
        } else if (kk % 2 == 0) {  // chunk k, word kk / 2: low nibbles, then high nibbles
          const int64_t at = k * 256 + 32 * (kk / 2);
          const __m512i z = load_pair(tile_a + at, tile_b ? tile_b + at : nullptr);
          __m512i lo = _mm512_sub_epi8(_mm512_and_si512(z, low4), eight);
          __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(z, 4), low4), eight);
          if (!tile_b) {  // rows 8..15 are absent: zero, not -8
            lo = _mm512_maskz_mov_epi32(0x00FF, lo);
            hi = _mm512_maskz_mov_epi32(0x00FF, hi);
          }
          _mm512_store_si512(bk + 64 * kk, lo);
          _mm512_store_si512(bk + 64 * (kk + 1), hi);
        }
      }
    }
    return;
  }

  // kRows: word by word (4 bytes of one row), the last block of a short row padded with zeros.
  std::memset(b, 0, size_t(blocks * kTileBytes));
  const int64_t cols = w.cols;
  for (int n = 0; n < live; ++n) {
    const uint8_t* row = w.data + (o0 + n) * rb;
    for (int64_t k = 0; k < blocks; ++k) {
      int8_t* bk = b + k * kTileBytes + 4 * n;
      const int64_t i0 = k * kInt8Block;
      if (i0 + kInt8Block <= cols) {
        if (int8) {
          for (int kk = 0; kk < 16; ++kk) std::memcpy(bk + 64 * kk, row + i0 + 4 * kk, 4);
        } else {
          for (int j = 0; j < 8; ++j) {
            uint32_t word;
            std::memcpy(&word, row + i0 / 2 + 4 * j, 4);
            for (int e = 0; e < 4; ++e) {
              bk[64 * (2 * j) + e] = int8_t(int((word >> (8 * e)) & 15) - 8);
              bk[64 * (2 * j + 1) + e] = int8_t(int((word >> (8 * e + 4)) & 15) - 8);
            }
          }
        }
        continue;
      }
      for (int64_t i = i0; i < cols; ++i) {  // short last block: element by element
        const int64_t at =
            int8_position(int8 ? Int8Layout::kForInt8 : Int8Layout::kForInt4, i - i0);
        const int v =
            int8 ? int(int8_t(row[i])) : int((i & 1) ? row[i >> 1] >> 4 : row[i >> 1] & 15) - 8;
        bk[64 * (at / 4) + at % 4] = int8_t(v);
      }
    }
  }
}

}  // namespace

void int8_rows_amx(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                   int64_t row_begin, int64_t row_end) {
  row_end = std::min(row_end, w.rows);
  if (row_begin >= row_end || x.n <= 0) return;
  Packed& p = packed;
  const int64_t blocks = x.blocks, tiles = (x.n + 15) / 16;
  // The activations as A tiles, in the order the loops below read them.
  if (int64_t(p.a.size()) < blocks * tiles * kTileBytes)
    p.a.resize(size_t(blocks * tiles * kTileBytes));
  int8_t* a = p.a.data();
  for (int64_t k = 0; k < blocks; ++k)
    for (int64_t t = 0; t < tiles * 16; ++t) {
      int8_t* dst = a + (k * tiles + t / 16) * kTileBytes + (t % 16) * 64;
      if (t < x.n)
        std::memcpy(dst, x.q + (t * blocks + k) * kInt8Block, 64);
      else
        std::memset(dst, 0, 64);
    }
  if (int64_t(p.acc.size()) < tiles * 512) p.acc.resize(size_t(tiles * 512));
  float* acc = p.acc.data();
  configure();
  alignas(64) int32_t c[2][16][16];
  // Per-row formats: s_w = 1 and s_w * s_x = s_x exactly (no multiply).
  const bool grouped = w.format == QuantFormat::kInt4Grouped;

  // Output tiles two at a time (tiles 6 and 7), the second one zero weights past row_end.
  for (int64_t o0 = row_begin; o0 < row_end; o0 += 32) {
    pack(w, o0, blocks, p.w[0]);
    const bool second = o0 + 16 < row_end;
    if (second) {
      pack(w, o0 + 16, blocks, p.w[1]);
    } else {
      p.w[1].b.assign(size_t(blocks * kTileBytes), 0);
      p.w[1].s_w.assign(size_t(blocks * 16), 0.0f);
    }
    const int8_t* b0 = p.w[0].b.data();
    const int8_t* b1 = p.w[1].b.data();
    std::fill(acc, acc + tiles * 512, 0.0f);
    for (int64_t k = 0; k < blocks; ++k) {
      _tile_loadd(6, b0 + k * kTileBytes, 64);
      _tile_loadd(7, b1 + k * kTileBytes, 64);
      const __m512 s_w0 = _mm512_loadu_ps(p.w[0].s_w.data() + k * 16);
      const __m512 s_w1 = _mm512_loadu_ps(p.w[1].s_w.data() + k * 16);
      const int8_t* ak = a + k * tiles * kTileBytes;
      // Activation tile i against both weight tiles into accumulators 2 (i % 2) and 2 (i % 2) + 1
      // (A in tile 4 + i % 2); their scaling one tile later, while the next multiplies run.
      const auto finish = [&](int64_t i) {
        if (i % 2 == 0) {
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
        } else {
          _tile_stored(2, c[0], 64);
          _tile_stored(3, c[1], 64);
        }
        const int m = int(std::min<int64_t>(16, x.n - 16 * i));
        for (int r = 0; r < m; ++r) {
          const int64_t t = 16 * i + r;
          const __m512 s_x = _mm512_set1_ps(x.scale[t * blocks + k]);
          float* at = acc + t * 32;
          _mm512_store_ps(
              at, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[0][r])),
                                  grouped ? _mm512_mul_ps(s_w0, s_x) : s_x, _mm512_load_ps(at)));
          _mm512_store_ps(at + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[1][r])),
                                                   grouped ? _mm512_mul_ps(s_w1, s_x) : s_x,
                                                   _mm512_load_ps(at + 16)));
        }
      };
      for (int64_t i = 0; i < tiles; ++i) {
        if (i % 2 == 0) {
          _tile_loadd(4, ak + i * kTileBytes, 64);
          _tile_zero(0);
          _tile_zero(1);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
        } else {
          _tile_loadd(5, ak + i * kTileBytes, 64);
          _tile_zero(2);
          _tile_zero(3);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
        if (i >= 1) finish(i - 1);
      }
      finish(tiles - 1);
    }
    for (int h = 0; h < (second ? 2 : 1); ++h) {
      const int64_t o = o0 + 16 * h;
      const int live = int(std::min<int64_t>(16, row_end - o));
      const __mmask16 store_mask = __mmask16((1u << live) - 1);
      const __m512 row_scale = _mm512_loadu_ps(p.w[h].row_scale);
      for (int64_t t = 0; t < x.n; ++t) {
        const __m512 v = _mm512_load_ps(acc + t * 32 + 16 * h);
        _mm512_mask_storeu_ps(y + t * y_stride + o, store_mask,
                              grouped ? v : _mm512_mul_ps(v, row_scale));
      }
    }
  }
  _tile_release();
}

int64_t amx_int8_peak_probe(int64_t iterations) {
  configure();
  alignas(64) int8_t ones[16][64];
  std::memset(ones, 0, sizeof ones);
  ones[0][0] = 1;
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iterations; ++i) {  // four independent chains
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  alignas(64) int32_t c[16][16];
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0][0];  // = iterations
}

}  // namespace colibri::kernels::detail
