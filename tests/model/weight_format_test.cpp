// The table of weight formats (model/weight_format.h) against the matrices that hold them: each
// row's element bits and scales give the bytes of a Matrix in its format, and the format a Matrix
// tells, its slices keep.
#include "model/weight_format.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpu/quant.h"
#include "model/matrix.h"

namespace colibri {
namespace {

constexpr int64_t kRows = 16, kCols = 64;
constexpr int kGroupSize = 16;                      // int4-grouped
constexpr int64_t kBlockRows = 8, kBlockCols = 32;  // FP8
constexpr int64_t kNvfp4Block = 16;                 // NVFP4: a scale byte a block of 16

// A [kRows, kCols] matrix in `format`, ones (their values do not matter here).
Matrix matrix_in(WeightFormat format) {
  Matrix m;
  m.rows = kRows;
  m.cols = kCols;
  const size_t count = size_t(kRows * kCols);
  switch (format) {
    case WeightFormat::kF32:
      m.data.assign(count, 1.0f);
      break;
    case WeightFormat::kBF16:
      m.bf16.assign(count, 0x3F80);
      break;
    case WeightFormat::kFp8Block:
      m.fp8.bits.assign(count, 0x38);
      m.fp8.block_rows = kBlockRows;
      m.fp8.block_cols = kBlockCols;
      m.fp8.scales.assign(size_t(kRows / kBlockRows * (kCols / kBlockCols)), 1.0f);
      break;
    case WeightFormat::kNvfp4:
      m.nvfp4.codes.assign(count / 2, 0x22);             // 1.0, 1.0
      m.nvfp4.scales.assign(count / kNvfp4Block, 0x38);  // 1.0
      m.nvfp4.global = 1.0f;
      break;
    case WeightFormat::kInt8Row:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped: {
      QuantMatrix& q = m.quant;
      q.format = *format_row(format).container;
      q.group_size = format == WeightFormat::kInt4Grouped ? kGroupSize : 0;
      q.rows = kRows;
      q.cols = kCols;
      q.data.resize(size_t(kernels::packed_bytes(q.format, kRows, kCols)));
      q.scales.resize(size_t(kernels::scale_count(q.format, kRows, kCols, q.group_size)));
      const std::vector<float> ones(count, 1.0f);
      kernels::quantize(q.format, q.group_size, ones.data(), kRows, kCols, q.data.data(),
                        q.scales.data());
      break;
    }
  }
  return m;
}

// The bytes of the scales of such a matrix of `rows`, from the row's kind of scale.
int64_t scale_bytes(WeightScales scales, int64_t rows = kRows) {
  switch (scales) {
    case WeightScales::kNone:
      return 0;
    case WeightScales::kPerRow:
      return 4 * rows;
    case WeightScales::kPerGroup:
      return 4 * rows * (kCols / kGroupSize);
    case WeightScales::kPerBlock:
      return 4 * (rows / kBlockRows * (kCols / kBlockCols));
    case WeightScales::kPerBlock16AndMatrix:
      return rows * (kCols / kNvfp4Block) + 4;
  }
  return -1;
}

TEST(WeightFormats, EachRowDescribesTheMatrixHoldingIt) {
  for (const WeightFormatRow& row : kWeightFormats) {
    SCOPED_TRACE(std::string(row.name));
    const Matrix m = matrix_in(row.format);
    EXPECT_EQ(m.format(), row.format);
    EXPECT_EQ(weight_format_name(m.format()), row.name);
    EXPECT_EQ(m.quantized(), is_container(row.format));
    EXPECT_EQ(m.bytes(), uint64_t(kRows * kCols * row.element_bits / 8 + scale_bytes(row.scales)));
    const Matrix rows = slice_rows(m, row_slice_step(m), kRows);
    EXPECT_EQ(rows.format(), row.format);
    const int64_t kept = kRows - row_slice_step(m);
    EXPECT_EQ(rows.bytes(),
              uint64_t(kept * kCols * row.element_bits / 8 + scale_bytes(row.scales, kept)));
    EXPECT_EQ(slice_cols(m, kCols / 2, kCols).format(), row.format);
    if (row.container) {
      EXPECT_EQ(weight_format(*row.container), row.format);
    }
  }
}

TEST(WeightFormats, AnEmptyMatrixIsAnEmptyF32One) {
  const Matrix m;
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.format(), WeightFormat::kF32);
  EXPECT_EQ(m.bytes(), 0u);
}

TEST(WeightFormats, StoredDtypesAreKeptInTheirRowsFormat) {
  EXPECT_EQ(stored_format(Dtype::F32), WeightFormat::kF32);
  EXPECT_EQ(stored_format(Dtype::BF16), WeightFormat::kBF16);
  EXPECT_EQ(stored_format(Dtype::F8_E4M3), WeightFormat::kFp8Block);
  ASSERT_TRUE(stored_format(Dtype::U8).has_value());
  EXPECT_TRUE(is_container(*stored_format(Dtype::U8)));  // NVFP4: told by its scale tensors
  EXPECT_FALSE(is_container(WeightFormat::kNvfp4));
  EXPECT_FALSE(stored_format(Dtype::F16).has_value()) << "converted to fp32";
}

}  // namespace
}  // namespace colibri
