// A weight matrix of a Linear layer in any of the formats of model/weight_format.h, the product
// with it (linear) and its slices by rows and columns (tensor parallelism, sliced experts).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/checkpoint.h"
#include "model/container.h"
#include "model/weight_format.h"

namespace colibri {

// The rows of a Matrix that other ranks hold (tensor_parallel/split_linear.h): the Matrix keeps
// rows [0, local_rows) and this computes the others of y = W x where they are.
class RemoteRows {
 public:
  virtual ~RemoteRows() = default;
  // Sends x [n, cols] to the ranks that hold the other rows, which start on them at once.
  virtual void start(const float* x, int64_t n) = 0;
  // Room for the local rows' product, [n, local_rows].
  virtual float* local_buffer(int64_t n) = 0;
  // Waits for the other rows and writes y [n, rows]: `local` [n, local_rows] and theirs.
  virtual void finish(const float* local, int64_t n, float* y) = 0;
};

// Row-major [rows, cols] weight of a Linear layer: y = W x. Its format (format()) is that of the
// one non-empty member: fp32, BF16, FP8 (block-scaled) or NVFP4 as stored, or a container weight
// kept as stored (int8/int4 rows or groups with fp32 scales). With `remote`, only rows [0,
// local_rows) are held here.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<float> data;             // kF32
  QuantMatrix quant;                   // the container formats
  std::vector<uint16_t> bf16;          // kBF16: BF16 bits
  Fp8Matrix fp8;                       // kFp8Block: FP8 E4M3 with block scales
  int64_t local_rows = 0;              // with `remote`: the rows held here
  std::shared_ptr<RemoteRows> remote;  // null: every row is held here
  Nvfp4Matrix nvfp4;  // kNvfp4: E2M1 codes, E4M3 block scales, global scale (last: aggregates
                      // that list the members before it stay valid)
  int64_t held_rows() const { return remote ? local_rows : rows; }
  // The one place that tells the format from the members; kF32 for an empty matrix.
  WeightFormat format() const {
    if (!quant.empty()) return weight_format(quant.format);
    if (!bf16.empty()) return WeightFormat::kBF16;
    if (!fp8.empty()) return WeightFormat::kFp8Block;
    if (!nvfp4.empty()) return WeightFormat::kNvfp4;
    return WeightFormat::kF32;
  }
  bool empty() const { return bytes() == 0; }
  bool quantized() const { return is_container(format()); }
  bool stored_bf16() const { return format() == WeightFormat::kBF16; }
  bool stored_fp8() const { return format() == WeightFormat::kFp8Block; }
  // Bytes of the weights held here, scales included.
  uint64_t bytes() const;
};

// y[n, rows] = x[n, cols] · W^T with the kernel of W's format (and, for rows held elsewhere, the
// ranks that hold them).
void linear(const Matrix& w, const float* x, int64_t n, float* y);

// Rows [r0, r1) of m as a Matrix of their own, the same bytes. A slice starts at a multiple of
// row_slice_step(m) and ends at one or at m.rows; within those bounds every kernel computes a
// slice's rows with the bits of the whole matrix's (QuantTiles.ARowSliceGivesTheWholeMatrixsRows).
Matrix slice_rows(const Matrix& m, int64_t r0, int64_t r1);
// The rows a slice of m starts at a multiple of: 8 (kernels::kTileRows, whatever m's layout, so
// that ranks whose CPUs choose different layouts agree), or an FP8 matrix's block rows.
int64_t row_slice_step(const Matrix& m);
// Row bounds of `parts` slices of m: parts + 1 ascending values from 0 to m.rows, each inner one
// a multiple of row_slice_step(m), the slices as even as the steps allow. Empty when m has fewer
// steps than parts: such a matrix is not split.
std::vector<int64_t> split_bounds(const Matrix& m, int parts);

// Columns [c0, c1) of m (held whole), copied; c0 starts a group of a grouped container matrix, a
// byte of an int4 one and a block of an FP8 one, and c0 and c1 blocks of 16 of an NVFP4 one
// (else an Error). A container matrix held by rows
// stays so; one held in tiles comes back in the layout the CPU kernels prefer (use_cpu_layout).
Matrix slice_cols(const Matrix& m, int64_t c0, int64_t c1);

}  // namespace colibri
