// The formats a weight matrix (Matrix, model/matrix.h) holds in memory, one row each in
// kWeightFormats: what an element is, how it is scaled, what a checkpoint stores it as and which
// kernels read it. The CPU kernels run every format (linear(), model/matrix.h); the CUDA expert
// kernels have their own enum, mapped from this one in rank/cuda_expert_backend.cpp. A new format
// is one row here, its storage in Matrix and its cases in model/matrix.cpp (the switches over
// WeightFormat: linear, slices, bytes), its kernels (kernels/cpu with a scalar reference,
// kernels/cuda) and the loader's recognition of its tensors (model/weight_loader.cpp,
// model/checkpoint.h).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "common/dtype.h"
#include "cpu/quant.h"

namespace colibri {

enum class WeightFormat : uint8_t {
  kF32,          // fp32, any float dtype converted at load
  kBF16,         // BF16 bits as stored
  kFp8Block,     // FP8 E4M3 as stored, fp32 scales per block (Fp8Matrix)
  kInt8Row,      // container int8, fp32 scale per row (QuantMatrix, kernels/cpu/quant.h)
  kInt4Row,      // container int4, fp32 scale per row
  kInt4Grouped,  // container int4, fp32 scale per row and group of group_size columns
  // compressed-tensors pack-quantized INT4 (I32 `_packed` + `_scale` + `_shape`, and
  // `_zero_point` when asymmetric) is held as kInt4Grouped, or kInt4Row for one group a row: the
  // same nibbles, its scales widened to fp32 at load, its zero points as fp32 offsets
  // (QuantMatrix::offsets; model/checkpoint.h).
  kNvfp4,  // NVIDIA ModelOpt NVFP4 as stored: E2M1 codes, E4M3 scales per 16 columns, fp32 global
           // (Nvfp4Matrix, kernels/cpu/linear.h: linear_nvfp4)
};

// Which scale an element is multiplied by.
enum class WeightScales : uint8_t {
  kNone,      // the element is the weight
  kPerRow,    // one fp32 scale per row
  kPerGroup,  // one fp32 scale per row and group of columns (the matrix's group_size)
  kPerBlock,  // one fp32 scale per block of rows and columns (the matrix's block_rows x block_cols)
  // one FP8 E4M3 scale (a byte) per row and block of 16 columns, times one fp32 scale per matrix
  kPerBlock16AndMatrix,
};

struct WeightFormatRow {
  WeightFormat format;
  std::string_view name;
  int element_bits;  // bits of one element in memory (int4: two a byte, a row padded to bytes)
  WeightScales scales;
  Dtype stored_as;  // its tensor's dtype in a checkpoint (container formats: U8 + `.qs` F32)
  // The absorbed attention reads kv_b_proj in it a row at a time (coordinator/cpu_attention.cpp);
  // the loader keeps kv_b_proj as stored only in such a format.
  bool read_by_rows;
  // The container kernels' format (kernels::quant_linear and the others) for a container format.
  std::optional<kernels::QuantFormat> container;
};

inline constexpr std::array<WeightFormatRow, 7> kWeightFormats = {{
    {WeightFormat::kF32, "f32", 32, WeightScales::kNone, Dtype::F32, true, std::nullopt},
    {WeightFormat::kBF16, "bf16", 16, WeightScales::kNone, Dtype::BF16, true, std::nullopt},
    {WeightFormat::kFp8Block, "fp8-block", 8, WeightScales::kPerBlock, Dtype::F8_E4M3, false,
     std::nullopt},
    {WeightFormat::kInt8Row, "int8-row", 8, WeightScales::kPerRow, Dtype::U8, true,
     kernels::QuantFormat::kInt8Row},
    {WeightFormat::kInt4Row, "int4-row", 4, WeightScales::kPerRow, Dtype::U8, false,
     kernels::QuantFormat::kInt4Row},
    {WeightFormat::kInt4Grouped, "int4-grouped", 4, WeightScales::kPerGroup, Dtype::U8, false,
     kernels::QuantFormat::kInt4Grouped},
    // Stored as U8 too, but told apart by its `_scale` (F8_E4M3) and `_scale_2` tensors
    // (Checkpoint::is_nvfp4): stored_format(U8) is the container's row above.
    {WeightFormat::kNvfp4, "nvfp4", 4, WeightScales::kPerBlock16AndMatrix, Dtype::U8, false,
     std::nullopt},
}};

// The row of `format`.
constexpr const WeightFormatRow& format_row(WeightFormat format) {
  return kWeightFormats[size_t(format)];
}
static_assert([] {
  for (size_t i = 0; i < kWeightFormats.size(); ++i)
    if (size_t(kWeightFormats[i].format) != i) return false;
  return true;
}());

// The container format's row (a QuantMatrix's format).
constexpr WeightFormat weight_format(kernels::QuantFormat container) {
  for (const WeightFormatRow& row : kWeightFormats)
    if (row.container == container) return row.format;
  return WeightFormat::kF32;  // not reached: every container format has a row
}

// "f32", "bf16", "fp8-block", "int8-row", "int4-row", "int4-grouped", "nvfp4".
constexpr std::string_view weight_format_name(WeightFormat format) {
  return format_row(format).name;
}

// The format a checkpoint tensor of this dtype is kept in as stored: the first row stored as it
// (U8: a container format, which one its sizes tell), none for a dtype only converted to fp32.
constexpr std::optional<WeightFormat> stored_format(Dtype dtype) {
  for (const WeightFormatRow& row : kWeightFormats)
    if (row.stored_as == dtype) return row.format;
  return std::nullopt;
}

// A container format: held as a QuantMatrix and run by the container kernels.
constexpr bool is_container(WeightFormat format) {
  return format_row(format).container.has_value();
}

}  // namespace colibri
