// Internals of the int8-activation kernels (quant.h, "int8 activations"), shared by
// quant_int8.cpp (quantization, scalar reference, dispatch) and the per-ISA kernel files.
// Declarations only, for the reason given in quant_detail.h.
//
// Activations: a row is quantized in blocks of 64 inputs (block k: inputs [64k, 64k + 64), the
// last one may be short): s_k = amax_k / 127, q_i = clip(rint(x_i * (127 / amax_k)), -127, 127); a
// block where 127 / amax_k is not finite (all zero, or amax_k below ~3.7e-37: subnormals, whose
// products are far below any normal sum) counts as zero, s_k = 0 and q = 0; a block with a
// non-finite input has s_k = NaN (q = 0), so the outputs it feeds are NaN. Per block the kernels
// also read sum_k = sum of its q. Inputs past cols are q = 0. Within a block the bytes are ordered
// for the weights they meet:
//   int4: each 8 inputs as [0 2 4 6 1 3 5 7], so that the low nibbles of 4 packed bytes meet one
//     32-bit word of activations and the high nibbles the next;
//   int8: natural order.
//
// Weights are read in tiles of 16 output rows (8 in 256-bit vectors), one row per 32-bit vector
// lane: the rows' bytes of a block are transposed in registers so that each lane holds 4 bytes of
// its row, and one vpdpbusd / pmaddubsw adds 4 products per lane against 4 broadcast activations.
// The weight bytes are used as unsigned (an int4 nibble n stands for n - 8, an int8 weight w is
// read as w + 128 by VNNI), and the bias times sum_k, started in each block's accumulator, corrects
// it. Every kernel thus computes each block's integer dot product d_k exactly, then per output
//   acc = fma(float(d_k), s_w * s_k, acc)   for k = 0, 1, ... in order,
// (s_w the weight's group scale, 1 for the per-row formats) and y = acc (grouped) or acc times the
// row scale: the same fp32 operations in the same order on every ISA, so all ISAs agree bit for
// bit with the scalar reference.
#pragma once

#include <cstdint>

#include "cpu/quant.h"

namespace colibri::kernels::detail {

enum class Int8Layout { kForInt4, kForInt8 };

inline constexpr int64_t kInt8Block = 64;
inline constexpr int64_t kInt8TileRows = 16;

// Quantized activations of n rows of cols inputs, laid out as above.
struct Int8Rows {
  Int8Layout layout;
  int64_t n, cols, blocks;  // blocks = ceil(cols / 64)
  const int8_t* q;          // [n, blocks * 64]
  const float* scale;       // [n, blocks]
  const int32_t* sum;       // [n, blocks]
};

// Byte offset of input j (0 <= j < 64) within its block.
int64_t int8_position(Int8Layout layout, int64_t j);

// Tiles of rows [row_begin, row_end) (row_begin a multiple of kInt8TileRows) of y:
// y[t * y_stride + o] for every t < x.n, as above.
using Int8RowsKernel = void (*)(const QuantMatrixView& w, const Int8Rows& x, float* y,
                                int64_t y_stride, int64_t row_begin, int64_t row_end);

// Quantizes block k of one row x [cols] into q[j], j < 64 (0 past cols), and returns its scale, by
// the rule above; the AVX2 and AVX-512 versions give the same values (every step is exact or one
// IEEE operation in the same order: the largest magnitude, 127 / amax, the product, rint, the
// clamp).
using QuantizeBlockFn = float (*)(const float* x, int64_t cols, int64_t k, int q[kInt8Block]);
float quantize_block_avx2(const float* x, int64_t cols, int64_t k, int q[kInt8Block]);
float quantize_block_avx512(const float* x, int64_t cols, int64_t k, int q[kInt8Block]);

// pmaddubsw + pmaddwd (every AVX2 CPU).
void int8_rows_avx2(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                    int64_t row_begin, int64_t row_end);
// vpdpbusd on ymm (AVX2 CPUs with AVX-VNNI): the tile kernel of int8_rows_avx2, either layout.
void int8_rows_avxvnni(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                       int64_t row_begin, int64_t row_end);
// vpdpbusd over two kTiles tiles at once (AVX-512 VNNI): the kernel for kTiles matrices on
// AVX-512 VNNI CPUs (a kRows w goes through the 8-row transpose).
void int8_tiles_vnni(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                     int64_t row_begin, int64_t row_end);
// vpdpbusd over tiles of 16 rows (AVX-512 VNNI): kRows matrices.
void int8_rows_avx512vnni(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                          int64_t row_begin, int64_t row_end);
// tdpbssd on AMX int8 tiles, 16 output rows by 16 activation rows a block (AVX-512 for the scales):
// either layout. Only after amx_available() (CPUID and the permission request).
void int8_rows_amx(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                   int64_t row_begin, int64_t row_end);
// `iterations` times four tdpbssd on resident 16 x 64 tiles (16 x 16 x 64 multiply-adds each,
// independent accumulators); returns iterations (read back from a tile). The peak probe.
int64_t amx_int8_peak_probe(int64_t iterations);

}  // namespace colibri::kernels::detail
