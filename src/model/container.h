// colibri's int4/int8 container, as far as the loader and the converter need it: a quantized
// weight `<name>` is stored as dtype U8 (packed bytes, any shape) with a companion `<name>.qs`
// (F32 scales, any shape). Nothing on disk names the format: it is inferred from the byte count,
// the scale count and the [rows, cols] the config expects, and anything inconsistent or ambiguous
// is refused rather than guessed. The packing itself is described in kernels/cpu/quant.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/huge_pages.h"

#include "cpu/quant.h"

namespace colibri {

// Suffix of the scale tensor of a quantized weight.
inline constexpr const char* kQuantScaleSuffix = ".qs";

// A quantized [rows, cols] matrix that owns its packed bytes and scales.
struct QuantMatrix {
  kernels::QuantFormat format = kernels::QuantFormat::kInt8Row;
  int64_t rows = 0, cols = 0;
  int group_size = 0;          // 0 for the per-row formats
  WeightVector<uint8_t> data;  // [rows, row_bytes(format, cols)] in `layout`
  WeightVector<float> scales;  // [scale_count(format, rows, cols, group_size)] in `layout`
  kernels::QuantLayout layout = kernels::QuantLayout::kRows;  // as stored: kRows
  // int4 zero points (an asymmetric checkpoint's): fp32 offsets -zp * s, [rows, offset groups]
  // in row order whatever the layout (kernels/cpu/quant.h); empty for a symmetric matrix.
  WeightVector<float> offsets;

  bool empty() const { return data.empty(); }
  bool has_zero_points() const { return !offsets.empty(); }
  // What it holds: packed bytes, fp32 scales and fp32 offsets.
  uint64_t bytes() const { return data.size() + 4 * scales.size() + 4 * offsets.size(); }
  kernels::QuantMatrixView view() const {
    return {format,      rows,          cols,   group_size,
            data.data(), scales.data(), layout, offsets.empty() ? nullptr : offsets.data()};
  }
};

// Rearranges q's bytes and scales into `layout`, in place (no change when it is q's already);
// std::invalid_argument when q's shape does not allow it (kernels::tiles_supported).
void set_layout(QuantMatrix& q, kernels::QuantLayout layout);
// Into the layout the CPU kernels read fastest here (kernels::tiles_preferred): for a matrix that
// only the quantized kernels read, never by rows.
void use_cpu_layout(QuantMatrix& q);

// Rows [r0, r1) of q, copied: a range of its bytes and scales in the rows layout, and in the tiles
// layout when r0 and r1 are whole tiles.
QuantMatrix quant_rows(const QuantMatrix& q, int64_t r0, int64_t r1);
// Columns [c0, c1) of q in the rows layout, copied: c0 starts a group (and a byte), else an Error.
QuantMatrix quant_cols(const QuantMatrix& q, int64_t c0, int64_t c1);

// A format with its group size (0 for per-row).
struct QuantSpec {
  kernels::QuantFormat format;
  int group_size;
};

// The outcome of inferring a format: `error` is empty on success and otherwise says why the
// sizes fit no format, or fit more than one.
struct QuantResolution {
  QuantSpec spec{kernels::QuantFormat::kInt8Row, 0};
  std::string error;
  bool ok() const { return error.empty(); }
};

// Infers the format of a [rows, cols] weight from its packed byte count and scale count:
//   int8-row      bytes = rows * cols,            scales = rows
//   int4-row      bytes = rows * ceil(cols / 2),  scales = rows
//   int4-grouped  bytes = rows * ceil(cols / 2),  scales = rows * ceil(cols / gs),
//                 gs in the container's candidates (16, 32, ..., 256), exactly one of them.
// A grouped matrix with a single group per row is the same numbers as int4-row and reads as such.
QuantResolution resolve_quant_format(int64_t n_bytes, int64_t n_scales, int64_t rows, int64_t cols);

// Quantises w [rows, cols] into the container's format. For int4-grouped, a group size that
// covers the whole row is written as int4-row (the same numbers), so that the result always
// resolves back to `spec`; a grouping the reader could not tell apart from another is refused
// (Error naming `name`).
QuantMatrix quantize_matrix(const std::string& name, QuantSpec spec, const float* w, int64_t rows,
                            int64_t cols);

// "int8-row", "int4-row", "int4-g64", ...
std::string quant_spec_name(QuantSpec spec);

}  // namespace colibri
