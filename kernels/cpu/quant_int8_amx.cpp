// int8-activation kernel with AMX int8 tiles (compiled with -mamx-tile -mamx-int8 and the AVX-512
// flags; called only after CPUID, the kernel's permission request and amx_enabled(): quant.h).
// The operations: quant_int8_detail.h, the same per-block fp32 steps in the same order, so the
// results are the scalar reference's bit for bit.
//
// Per 16 output rows, the weights are first unpacked into a per-thread buffer as the B operand of
// tdpbssd: block k is a 16 x 64-byte tile whose row kk holds, for each output row n, the 4 signed
// weights (int4: nibble - 8) that meet activation bytes 4kk..4kk+3 of the block (their order in
// quant_int8_detail.h). The container's bytes cannot feed a tile as they are (int4 has no tile
// type; a kTiles word spans 8 rows, a tile row 16), and the unpacked 16 rows (cols bytes, 96 KiB
// at 6144 inputs) stay in L2 while every 16 activation rows pass over them, so the unpack is paid
// once per call and output tile. The activations are the A operand as quantized (16 rows x one
// 64-byte block, stride blocks * 64). Each block's dot products d_k come out of one tdpbssd into
// int32, exactly, and are scaled and summed in fp32 on AVX-512 as in every other kernel.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Tiles: 0, 1 accumulators (two blocks in flight), 2, 3 activations, 4, 5 weights. m activation
// rows (1..16).
void configure(int m) {
  TileConfig c;
  for (int t = 0; t < 6; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = uint8_t(t >= 4 ? 16 : m);
  }
  _tile_loadconfig(&c);
}

// Per thread: the unpacked weights [blocks][16][64], their block scales [blocks][16] and row
// scales [16].
struct Packed {
  std::vector<int8_t> b;
  std::vector<float> s_w;
  alignas(64) float row_scale[16];
};
thread_local Packed packed;

// The first 64-byte boundary in v (sized 64 bytes more than it holds).
inline int8_t* aligned(std::vector<int8_t>& v) {
  return reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i hi =
      b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Rows o0..o0+15 of w (those below w.rows) into `packed`; rows past w.rows are zero weights with
// zero scales.
void pack(const QuantMatrixView& w, int64_t o0, int64_t blocks) {
  const int64_t rb = row_bytes(w.format, w.cols);
  const bool int8 = w.format == QuantFormat::kInt8Row;
  const bool grouped = w.format == QuantFormat::kInt4Grouped;
  const int64_t ng = grouped ? (w.cols + w.group_size - 1) / w.group_size : 1;
  const int live = int(std::min<int64_t>(16, w.rows - o0));
  if (int64_t(packed.b.size()) < blocks * kTileBytes + 64)
    packed.b.resize(size_t(blocks * kTileBytes + 64));
  if (int64_t(packed.s_w.size()) < blocks * 16) packed.s_w.resize(size_t(blocks * 16));
  int8_t* b = aligned(packed.b);

  for (int n = 0; n < 16; ++n) {
    packed.row_scale[n] = n < live && !grouped ? w.scales[scale_at(w, ng, o0 + n, 0)] : 0.0f;
    for (int64_t k = 0; k < blocks; ++k)
      packed.s_w[size_t(k * 16 + n)] =
          n >= live
              ? 0.0f
              : (grouped ? w.scales[scale_at(w, ng, o0 + n, k * kInt8Block / w.group_size)] : 1.0f);
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
        const int64_t p = int8_position(int8 ? Int8Layout::kForInt8 : Int8Layout::kForInt4, i - i0);
        const int v =
            int8 ? int(int8_t(row[i])) : int((i & 1) ? row[i >> 1] >> 4 : row[i >> 1] & 15) - 8;
        bk[64 * (p / 4) + p % 4] = int8_t(v);
      }
    }
  }
}

}  // namespace

void int8_rows_amx(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                   int64_t row_begin, int64_t row_end) {
  row_end = std::min(row_end, w.rows);
  const int64_t blocks = x.blocks;
  alignas(64) int32_t c[2][16][16];
  int configured = 0;
  for (int64_t o0 = row_begin; o0 < row_end; o0 += 16) {
    pack(w, o0, blocks);
    const int8_t* b = aligned(packed.b);
    const int live = int(std::min<int64_t>(16, row_end - o0));
    const __mmask16 store_mask = __mmask16((1u << live) - 1);
    const __m512 row_scale = _mm512_loadu_ps(packed.row_scale);
    for (int64_t t0 = 0; t0 < x.n; t0 += 16) {
      const int m = int(std::min<int64_t>(16, x.n - t0));
      if (m != configured) {
        configure(m);
        configured = m;
      }
      const int8_t* a = x.q + t0 * blocks * kInt8Block;
      const int64_t a_stride = blocks * kInt8Block;
      __m512 acc[16];
      for (int r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
      // d_k of every (activation row, output row), exactly; then fp32 in block order.
      auto scale_block = [&](const int32_t(*d)[16], int64_t k) {
        const __m512 s_w = _mm512_loadu_ps(packed.s_w.data() + k * 16);
        for (int r = 0; r < m; ++r) {
          const __m512 s = _mm512_mul_ps(s_w, _mm512_set1_ps(x.scale[(t0 + r) * blocks + k]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(d[r])), s, acc[r]);
        }
      };
      int64_t k = 0;
      for (; k + 2 <= blocks; k += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, a + k * kInt8Block, a_stride);
        _tile_loadd(4, b + k * kTileBytes, 64);
        _tile_loadd(3, a + (k + 1) * kInt8Block, a_stride);
        _tile_loadd(5, b + (k + 1) * kTileBytes, 64);
        _tile_dpbssd(0, 2, 4);
        _tile_dpbssd(1, 3, 5);
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        scale_block(c[0], k);
        scale_block(c[1], k + 1);
      }
      if (k < blocks) {
        _tile_zero(0);
        _tile_loadd(2, a + k * kInt8Block, a_stride);
        _tile_loadd(4, b + k * kTileBytes, 64);
        _tile_dpbssd(0, 2, 4);
        _tile_stored(0, c[0], 64);
        scale_block(c[0], k);
      }
      for (int r = 0; r < m; ++r)
        _mm512_mask_storeu_ps(
            y + (t0 + r) * y_stride + o0, store_mask,
            w.format == QuantFormat::kInt4Grouped ? acc[r] : _mm512_mul_ps(acc[r], row_scale));
    }
  }
  if (configured) _tile_release();
}

}  // namespace colibri::kernels::detail
