#include "model/matrix.h"

#include <algorithm>

#include "common/error.h"
#include "cpu/linear.h"
#include "cpu/quant.h"

namespace colibri {

uint64_t Matrix::bytes() const {
  switch (format()) {
    case WeightFormat::kF32:
      return 4 * data.size();
    case WeightFormat::kBF16:
      return 2 * bf16.size();
    case WeightFormat::kFp8Block:
      return fp8.bytes();
    case WeightFormat::kNvfp4:
      return nvfp4.bytes();
    case WeightFormat::kInt8Row:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped:
      return quant.bytes();
  }
  return 0;
}

namespace {

// y[n, held rows] from the rows held here.
void linear_held(const Matrix& w, const float* x, int64_t n, float* y) {
  const int64_t rows = w.held_rows();
  switch (w.format()) {
    case WeightFormat::kF32:
      return kernels::linear_f32(x, n, w.data.data(), rows, w.cols, y);
    case WeightFormat::kBF16:
      return kernels::linear_bf16(x, n, w.bf16.data(), rows, w.cols, y);
    case WeightFormat::kFp8Block:
      return kernels::linear_fp8(x, n,
                                 {w.fp8.bits.data(), w.fp8.scales.data(), rows, w.cols,
                                  w.fp8.block_rows, w.fp8.block_cols},
                                 y);
    case WeightFormat::kNvfp4:
      // int8 activations where --activations selects them for 4-bit weights (int8, mixed).
      return kernels::linear_nvfp4_selected(
          x, n, {w.nvfp4.codes.data(), w.nvfp4.scales.data(), w.nvfp4.global, rows, w.cols}, y);
    case WeightFormat::kInt8Row:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped:
      return kernels::quant_linear(w.quant.view(), x, n, y);
  }
}

template <class V>
V copy_range(const V& v, int64_t begin, int64_t end) {
  return V(v.begin() + begin, v.begin() + end);
}

// Columns [c0, c1) of each of the rows of a row-major [rows, cols] v.
template <class V>
V copy_cols(const V& v, int64_t rows, int64_t cols, int64_t c0, int64_t c1) {
  V out(size_t(rows * (c1 - c0)));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(v.begin() + r * cols + c0, c1 - c0, out.begin() + r * (c1 - c0));
  return out;
}

Fp8Matrix fp8_rows(const Fp8Matrix& m, int64_t cols, int64_t r0, int64_t r1) {
  Fp8Matrix s;
  s.block_rows = m.block_rows;
  s.block_cols = m.block_cols;
  s.bits = copy_range(m.bits, r0 * cols, r1 * cols);
  const int64_t scale_cols = (cols + m.block_cols - 1) / m.block_cols;
  const int64_t b0 = r0 / m.block_rows, b1 = (r1 + m.block_rows - 1) / m.block_rows;
  s.scales = copy_range(m.scales, b0 * scale_cols, b1 * scale_cols);
  return s;
}

Fp8Matrix fp8_cols(const Fp8Matrix& m, int64_t rows, int64_t cols, int64_t c0, int64_t c1) {
  if (c0 % m.block_cols != 0)
    fail("columns {}..{} of a [{}, {}] FP8 matrix do not start a block of {}", c0, c1, rows, cols,
         m.block_cols);
  Fp8Matrix s;
  s.block_rows = m.block_rows;
  s.block_cols = m.block_cols;
  s.bits = copy_cols(m.bits, rows, cols, c0, c1);
  const int64_t blocks = (cols + m.block_cols - 1) / m.block_cols;
  const int64_t k0 = c0 / m.block_cols, k1 = (c1 + m.block_cols - 1) / m.block_cols;
  const int64_t block_rows = (rows + m.block_rows - 1) / m.block_rows;
  s.scales = copy_cols(m.scales, block_rows, blocks, k0, k1);
  return s;
}

// NVFP4 rows and columns: 16 columns a scale byte, two a code byte; the global scale is the
// matrix's.
constexpr int64_t kNvfp4Block = 16;

Nvfp4Matrix nvfp4_rows(const Nvfp4Matrix& m, int64_t cols, int64_t r0, int64_t r1) {
  Nvfp4Matrix s;
  s.global = m.global;
  s.codes = copy_range(m.codes, r0 * cols / 2, r1 * cols / 2);
  s.scales = copy_range(m.scales, r0 * cols / kNvfp4Block, r1 * cols / kNvfp4Block);
  return s;
}

Nvfp4Matrix nvfp4_cols(const Nvfp4Matrix& m, int64_t rows, int64_t cols, int64_t c0, int64_t c1) {
  if (c0 % kNvfp4Block != 0 || c1 % kNvfp4Block != 0)
    fail("columns {}..{} of a [{}, {}] NVFP4 matrix are not whole blocks of {}", c0, c1, rows, cols,
         kNvfp4Block);
  Nvfp4Matrix s;
  s.global = m.global;
  s.codes = copy_cols(m.codes, rows, cols / 2, c0 / 2, c1 / 2);
  s.scales = copy_cols(m.scales, rows, cols / kNvfp4Block, c0 / kNvfp4Block, c1 / kNvfp4Block);
  return s;
}

}  // namespace

void linear(const Matrix& w, const float* x, int64_t n, float* y) {
  if (n == 0) return;  // e.g. the lm_head of a prefill chunk that ends no prompt
  if (!w.remote) {
    linear_held(w, x, n, y);
    return;
  }
  w.remote->start(x, n);
  float* local = w.remote->local_buffer(n);
  linear_held(w, x, n, local);
  w.remote->finish(local, n, y);
}

int64_t row_slice_step(const Matrix& m) {
  switch (m.format()) {
    case WeightFormat::kFp8Block:
      return m.fp8.block_rows;
    case WeightFormat::kF32:
    case WeightFormat::kBF16:
    case WeightFormat::kNvfp4:
    case WeightFormat::kInt8Row:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped:
      return kernels::kTileRows;
  }
  return kernels::kTileRows;
}

std::vector<int64_t> split_bounds(const Matrix& m, int parts) {
  const int64_t step = row_slice_step(m);
  const int64_t steps = (m.rows + step - 1) / step;
  if (parts < 1 || steps < parts) return {};
  std::vector<int64_t> bounds;
  for (int p = 0; p <= parts; ++p) bounds.push_back(std::min(m.rows, steps * p / parts * step));
  return bounds;
}

Matrix slice_rows(const Matrix& m, int64_t r0, int64_t r1) {
  const int64_t step = row_slice_step(m);
  if (m.remote || r0 < 0 || r1 <= r0 || r1 > m.rows || r0 % step != 0 ||
      (r1 % step != 0 && r1 != m.rows))
    fail("rows {}..{} of a [{}, {}] matrix are not a slice of whole {}-row steps", r0, r1, m.rows,
         m.cols, step);
  Matrix s;
  s.rows = r1 - r0;
  s.cols = m.cols;
  switch (m.format()) {
    case WeightFormat::kF32:
      s.data = copy_range(m.data, r0 * m.cols, r1 * m.cols);
      break;
    case WeightFormat::kBF16:
      s.bf16 = copy_range(m.bf16, r0 * m.cols, r1 * m.cols);
      break;
    case WeightFormat::kFp8Block:
      s.fp8 = fp8_rows(m.fp8, m.cols, r0, r1);
      break;
    case WeightFormat::kNvfp4:
      s.nvfp4 = nvfp4_rows(m.nvfp4, m.cols, r0, r1);
      break;
    case WeightFormat::kInt8Row:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped:
      s.quant = quant_rows(m.quant, r0, r1);
      break;
  }
  return s;
}

Matrix slice_cols(const Matrix& m, int64_t c0, int64_t c1) {
  Matrix s;
  s.rows = m.rows;
  s.cols = c1 - c0;
  switch (m.format()) {
    case WeightFormat::kF32:
      s.data = copy_cols(m.data, m.rows, m.cols, c0, c1);
      break;
    case WeightFormat::kBF16:
      s.bf16 = copy_cols(m.bf16, m.rows, m.cols, c0, c1);
      break;
    case WeightFormat::kFp8Block:
      s.fp8 = fp8_cols(m.fp8, m.rows, m.cols, c0, c1);
      break;
    case WeightFormat::kNvfp4:
      s.nvfp4 = nvfp4_cols(m.nvfp4, m.rows, m.cols, c0, c1);
      break;
    case WeightFormat::kInt8Row:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped: {
      QuantMatrix rows = m.quant;
      set_layout(rows, kernels::QuantLayout::kRows);
      s.quant = quant_cols(rows, c0, c1);
      if (m.quant.layout != kernels::QuantLayout::kRows) use_cpu_layout(s.quant);
      break;
    }
  }
  return s;
}

}  // namespace colibri
