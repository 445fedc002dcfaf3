// Internals shared by quant.cpp (dispatch, generic code) and the per-ISA kernel files.
//
// Declarations only, on purpose: quant_avx2.cpp and quant_avx512.cpp are compiled with
// -mavx2 / -mavx512f, and an inline function defined here would be compiled once per flag set
// with the linker free to keep the AVX-512 copy for everyone. Each ISA file keeps its helpers in
// an anonymous namespace and uses no inline code from other headers.
#pragma once

#include <cstdint>

#include "cpu/quant.h"

// The one place that knows whether this build has the x86 kernels (quant_avx2.cpp and the
// others the build adds on x86).
#if defined(__x86_64__) || defined(_M_X64)
#define COLIBRI_QUANT_X86 1
#else
#define COLIBRI_QUANT_X86 0
#endif

namespace colibri::kernels::detail {

// A kernel choice the environment can turn off: false only when the variable `name` is "0".
bool allowed_by_env(const char* name);

// Activation layout the SIMD int4 kernels read: blocks of B inputs (blocks start at multiples
// of B) spread over B / P vector lanes, P consecutive inputs per lane; step m of a block handles
// input m of every lane. Within each full block the activations are stored step-major:
//   xp[k*B + m*(B/P) + lane] = x[k*B + lane*P + m]      (0 <= m < P, 0 <= lane < B/P)
// which is the order in which the kernel decodes the block's nibbles. Inputs after the last full
// block keep their natural order; B = 0 means natural order throughout. The block divides the
// group size (a block never straddles groups) except in the AVX-512 n = 1 kernel for group
// sizes 16, 32, 64, which scales each lane by its own group's scale. Per ISA and matrix:
//   scalar, and int8 on every ISA: natural;   AVX2 int4: B 16, P 2;
//   AVX-512 int4: B 128, P 8 for the per-row format, a group size that is a multiple of 128,
//     or (n = 1 only) a group size of 16, 32 or 64; otherwise B 64, P 4 for multiples of 64;
//     B 32, P 2 for multiples of 32; else B 16, P 2. The kernels take n and choose the same.
//   AVX-512 with BF16 pairs (bf16_pairs_enabled()), n = 1, int4 per row or with groups that are
//     multiples of 64: BF16 pairs instead. Each full block of 64 inputs holds, in the space of its
//     64 floats, 128 BF16 values in four runs of 32: hi(x[2w]), hi(x[2w+1]), lo(x[2w]),
//     lo(x[2w+1]) for w = 0..31, where hi = BF16(x) rounded to nearest even and
//     lo = BF16(x - hi); inputs after the last full block are floats in natural order.
//     hi + lo carries x to within 2^-18 |x|; the products and sums are fp32.

// Rows [row_begin, row_end) of y: y[t * y_stride + o] = sum_i W[o, i] * xp[t * cols + i] for
// t < n, with xp in the layout above for that ISA and matrix.
using RowsKernel = void (*)(const QuantMatrixView& w, const float* xp, int64_t n, float* y,
                            int64_t y_stride, int64_t row_begin, int64_t row_end);

void rows_avx2(const QuantMatrixView& w, const float* xp, int64_t n, float* y, int64_t y_stride,
               int64_t row_begin, int64_t row_end);
void rows_avx512(const QuantMatrixView& w, const float* xp, int64_t n, float* y, int64_t y_stride,
                 int64_t row_begin, int64_t row_end);
// One row x [cols] as the BF16 pairs above (vcvtne2ps2bf16: denormals count as zero) into xp,
// which may be x.
void bf16_pairs_avx512bf16(const float* x, int64_t cols, float* xp);
// n = 1 with the BF16 pairs above (vdpbf16ps).
void rows_avx512bf16(const QuantMatrixView& w, const float* xp, int64_t n, float* y,
                     int64_t y_stride, int64_t row_begin, int64_t row_end);

// The row ranges handed to a kernel start at multiples of this (the last one ends at rows), so
// that kernels may group rows by absolute index and stay independent of the thread count.
inline constexpr int64_t kRowAlignment = 4;

// Rows [begin, end) of `total` for thread `tid` of `nth`: what schedule(static) hands out over
// units of `unit` rows.
void static_range(int64_t total, int nth, int tid, int64_t& begin, int64_t& end,
                  int64_t unit = kRowAlignment);

// The offset in w.data of byte b of row o, and in w.scales of group g of row o (g = 0 for the
// per-row formats), in w's layout (quant.h).
int64_t byte_at(const QuantMatrixView& w, int64_t row_bytes, int64_t o, int64_t b);
int64_t scale_at(const QuantMatrixView& w, int64_t n_groups, int64_t o, int64_t g);

// The kTiles tile holding rows [o0, o0 + 8) (o0 a multiple of 8) as an 8-row kRows matrix, copied
// into the calling thread's scratch; valid until its next call on this thread.
QuantMatrixView tile_as_rows(const QuantMatrixView& w, int64_t o0);

// kernel on rows [row_begin, row_end) of w: directly for kRows; for kTiles (row_begin a multiple
// of 8) one tile at a time through tile_as_rows, for the kernels that read rows only.
void run_rows(RowsKernel kernel, const QuantMatrixView& w, const float* xp, int64_t n, float* y,
              int64_t y_stride, int64_t row_begin, int64_t row_end);

// The unit of rows a thread's range is made of for w: kRowAlignment, or kTileRows for kTiles.
int64_t row_unit(const QuantMatrixView& w);

// Throws std::invalid_argument unless gate and up are [inter, hidden] and down [hidden, inter].
void check_ffn_shapes(const QuantMatrixView& gate, const QuantMatrixView& up,
                      const QuantMatrixView& down);

// Zero points (quant.h): sums [n, groups] of x [n, cols] over groups of group_size inputs (0: one
// group, the row), each summed in input order.
void group_sums(const float* x, int64_t n, int64_t cols, int group_size, float* sums);
// For rows o in [row_begin, row_end) of w and t < n: y[t * y_stride + o] += sum over g of
// w.offsets[o * groups + g] * sums[t * groups + g], groups = offset_groups(w), in a fixed order
// (8 partial sums, group g in sum g % 8, added in order).
void add_offsets(const QuantMatrixView& w, const float* sums, int64_t n, float* y, int64_t y_stride,
                 int64_t row_begin, int64_t row_end);

// The group sums an expert FFN's zero points need, in buffers of the calling thread: of x for gate
// and up (computed at construction, before the parallel region), of the hidden activations for
// down (sum_hidden, by one thread once h is whole). Each add_* adds the terms of rows
// [begin, end) of its matrices that have offsets; gate and up with offsets share their groups.
struct ZeroPointSums {
  ZeroPointSums(const QuantMatrixView& gate, const QuantMatrixView& up, const QuantMatrixView& down,
                const float* x, int64_t n);
  void add_gate_up(const QuantMatrixView& gate, const QuantMatrixView& up, int64_t n,
                   float* gate_out, float* up_out, int64_t begin, int64_t end) const;
  void sum_hidden(const QuantMatrixView& down, const float* h, int64_t n) const;
  void add_down(const QuantMatrixView& down, int64_t n, float* y, int64_t begin, int64_t end) const;
  int64_t x_groups, h_groups;
  float *x_sums, *h_sums;
};

// Below this many multiply-adds a call stays on the calling thread.
inline constexpr int64_t kParallelMinMacs = int64_t(1) << 16;

// Per-row int4 formats are walked in virtual groups of this many inputs (scale 1, the row scale
// applied at the end) so the SIMD kernels keep several independent partial sums.
inline constexpr int64_t kRowFormatChunk = 256;

}  // namespace colibri::kernels::detail
