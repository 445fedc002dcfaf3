// The tensor-core tile of the grouped expert FFN (cuda/expert_ffn_mma.cuh) compiled for the host:
// the 32 lanes' fragments built by the kernel's own code, multiplied by an emulated
// mma.m16n8k16 in PTX's fragment layout, against the exact products over the CPU's dequantised
// int4 weights (kernels::dequantize). Needs no device: it checks the column permutation, the
// nibble-to-BF16 conversion, the hi + lo split of the activations, chunk scales, zero points
// (each chunk's offsets times its x sums, gathered across lanes as the shuffles do), and row
// clamping at the matrix's end. The PTX layout itself is checked on a GPU by
// expert_ffn_cuda_test (batches of 8+ slots run this path).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/quant.h"
#include "cuda/expert_ffn_mma.cuh"

namespace {

using colibri::cuda::DeviceMatrix;
using colibri::cuda::WeightFormat;
namespace kernels = colibri::kernels;
namespace mma = colibri::cuda::mma;

float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(ExpertFfnMma, NibblesBecomeExactBf16Integers) {
  for (uint32_t byte = 0; byte < 256; ++byte) {
    const uint32_t packed = mma::int4_byte_to_bf16x2(byte);
    EXPECT_EQ(bits_to_float((packed & 0xFFFFu) << 16), float(int(byte & 15) - 8)) << byte;
    EXPECT_EQ(bits_to_float(packed & 0xFFFF0000u), float(int(byte >> 4) - 8)) << byte;
  }
}

TEST(ExpertFfnMma, HiPlusLoCarriesActivationsToTwoToTheMinus17) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::ldexp(mantissa(rng), exponent(rng));
    uint32_t hi, lo;
    mma::split_bf16(x, hi, lo);
    const double sum = double(bits_to_float(hi << 16)) + double(bits_to_float(lo << 16));
    ASSERT_LE(std::fabs(sum - double(x)), std::ldexp(std::fabs(double(x)), -17)) << x;
  }
  uint32_t hi, lo;
  mma::split_bf16(0.0f, hi, lo);
  EXPECT_EQ(hi, 0u);
  EXPECT_EQ(lo, 0u);
}

struct Case {
  WeightFormat format;
  int group_size;
  int64_t rows, cols;
  bool zero_points = false;  // fp32 offsets -zp * s per (row, group), zp in [-8, 7]
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << (c.format == WeightFormat::kInt4Row ? "int4_row" : "int4_g") << c.group_size << "_"
            << c.rows << "x" << c.cols << (c.zero_points ? "_zp" : "");
}

struct Aligned {
  void* p = nullptr;
  explicit Aligned(size_t bytes) : p(std::aligned_alloc(64, (bytes + 63) / 64 * 64)) {}
  ~Aligned() { std::free(p); }
};

class ExpertFfnMmaTile : public testing::TestWithParam<Case> {};

// Every lane's 4 outputs of every 16-row tile against the exact dot products. Bound: the
// activations' split (2^-17 |x|, in the worst case on every term), the fp32 sums of each k-step
// (16 terms), of the 8 mma per chunk and of the chunks, and the scale's rounding.
TEST_P(ExpertFfnMmaTile, TilesMatchTheDequantisedProducts) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.rows * 7 + c.cols));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const auto qf = c.format == WeightFormat::kInt4Row ? kernels::QuantFormat::kInt4Row
                                                     : kernels::QuantFormat::kInt4Grouped;
  const int group = c.format == WeightFormat::kInt4Grouped ? c.group_size : 0;
  std::vector<float> values(size_t(c.rows * c.cols));
  for (float& v : values) v = uniform(rng);
  Aligned data(size_t(kernels::packed_bytes(qf, c.rows, c.cols)));
  Aligned scales(4 * size_t(kernels::scale_count(qf, c.rows, c.cols, group)));
  auto* d = static_cast<uint8_t*>(data.p);
  auto* s = static_cast<float*>(scales.p);
  kernels::quantize(qf, group, values.data(), c.rows, c.cols, d, s);
  kernels::dequantize({qf, c.rows, c.cols, group, d, s}, values.data());
  // |each term| the tile sums apart: (q - 8) s x and offset x (their sum may cancel).
  std::vector<float> magnitudes = values;
  std::vector<float> offsets;
  if (c.zero_points) {
    kernels::QuantMatrixView view{qf, c.rows, c.cols, group, d, s};
    offsets.resize(size_t(kernels::scale_count(qf, c.rows, c.cols, group)));
    std::uniform_int_distribution<int> zp(-8, 7);
    for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = float(-zp(rng)) * s[i];
    view.offsets = offsets.data();
    kernels::dequantize(view, values.data());
    const int64_t groups = kernels::offset_groups(view);
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t i = 0; i < c.cols; ++i) {
        float& m = magnitudes[size_t(r * c.cols + i)];
        m = std::fabs(m) + std::fabs(offsets[size_t(r * groups + (group ? i / group : 0))]);
      }
  }
  const DeviceMatrix w =
      colibri::cuda::device_matrix(c.format, group, c.rows, c.cols, d, s, "tile test",
                                   offsets.empty() ? nullptr : offsets.data());
  ASSERT_TRUE(mma::tile_ok(w));

  // 8 slot inputs of different magnitudes (1e-3 .. 1e3), so that the split's lo part matters.
  Aligned x_memory(size_t(mma::kTileSlots * c.cols) * 4);
  auto* x = static_cast<float*>(x_memory.p);
  for (int t = 0; t < mma::kTileSlots; ++t)
    for (int64_t i = 0; i < c.cols; ++i)
      x[t * c.cols + i] = uniform(rng) * std::pow(10.0f, float(t % 7 - 3));
  const float* xs[mma::kTileSlots];
  for (int t = 0; t < mma::kTileSlots; ++t) xs[t] = x + t * c.cols;

  const double u = std::ldexp(1.0, -24);
  int checked = 0;
  for (int64_t r0 = 0; r0 < c.rows; r0 += mma::kTileRows) {
    float acc[mma::kWarpSize][4];
    mma::int4_tile_warp(w, r0, xs, acc);
    for (int lane = 0; lane < mma::kWarpSize; ++lane)
      for (int i = 0; i < 4; ++i) {
        int row, slot;
        mma::acc_position(lane, i, row, slot);
        if (r0 + row >= c.rows) continue;  // clamped rows: computed, never written
        double exact = 0, sum_abs = 0;
        for (int64_t k = 0; k < c.cols; ++k) {
          const double term = double(values[size_t((r0 + row) * c.cols + k)]) * xs[slot][k];
          exact += term;
          sum_abs += std::fabs(double(magnitudes[size_t((r0 + row) * c.cols + k)]) * xs[slot][k]);
        }
        // Zero points: the x sums of each chunk (64 terms in 16 + 2 + 2 levels) and one more
        // rounding for their product with the offset.
        const double bound = (std::ldexp(1.0, -16) + 2 * (16.0 + 8 + double(c.cols) / 64 + 2) * u +
                              (c.zero_points ? 2 * (20.0 + 2) * u : 0.0)) *
                             sum_abs;
        ASSERT_LE(std::fabs(double(acc[lane][i]) - exact), bound)
            << "row " << r0 + row << " slot " << slot << " (lane " << lane << ", c" << i
            << "): tile " << acc[lane][i] << " exact " << exact;
        ++checked;
      }
  }
  EXPECT_EQ(checked, c.rows * mma::kTileSlots);
}

INSTANTIATE_TEST_SUITE_P(Table, ExpertFfnMmaTile,
                         testing::Values(Case{WeightFormat::kInt4Grouped, 64, 32, 64},
                                         Case{WeightFormat::kInt4Grouped, 64, 40, 256},
                                         Case{WeightFormat::kInt4Grouped, 128, 16, 512},
                                         Case{WeightFormat::kInt4Grouped, 64, 24, 2048},
                                         Case{WeightFormat::kInt4Row, 0, 21, 192},
                                         Case{WeightFormat::kInt4Row, 0, 3, 128},
                                         Case{WeightFormat::kInt4Grouped, 64, 40, 256, true},
                                         Case{WeightFormat::kInt4Grouped, 128, 16, 512, true},
                                         Case{WeightFormat::kInt4Row, 0, 21, 192, true}),
                         [](const testing::TestParamInfo<Case>& param_info) {
                           std::ostringstream name;
                           name << param_info.param;
                           return name.str();
                         });

TEST(ExpertFfnMma, TilePathTakesOnlyWideInt4InChunksOf64) {
  alignas(16) uint8_t data[64] = {};
  float scales[4] = {1, 1, 1, 1};
  using colibri::cuda::device_matrix;
  EXPECT_TRUE(mma::tile_ok(device_matrix(WeightFormat::kInt4Row, 0, 1, 128, data, scales, "w")));
  EXPECT_FALSE(mma::tile_ok(device_matrix(WeightFormat::kInt4Row, 0, 1, 96, data, scales, "w")));
  EXPECT_FALSE(
      mma::tile_ok(device_matrix(WeightFormat::kInt4Grouped, 32, 1, 128, data, scales, "w")));
  EXPECT_TRUE(
      mma::tile_ok(device_matrix(WeightFormat::kInt4Grouped, 128, 1, 128, data, scales, "w")));
  EXPECT_FALSE(mma::tile_ok(device_matrix(WeightFormat::kInt8Row, 0, 1, 64, data, scales, "w")));
}

}  // namespace
