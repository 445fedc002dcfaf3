// colibri::cuda::matrix_linear on int4 weights with zero points (a compressed-tensors W4A16
// asymmetric checkpoint's: the nibbles and scales of the container, and fp32 offsets -zp * s per
// (row, group)) against the CPU oracle: kernels::dequantize (q * s + offset), then
// kernels::linear_f32. Skips without a CUDA device. The per-lane arithmetic is checked without one
// by expert_ffn_lanes_test and expert_ffn_mma_test, the grouped expert FFN with zero points by
// expert_ffn_cuda_test.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/quant.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/expert_ffn.cuh"
#include "device_memory.h"

namespace {

namespace kernels = colibri::kernels;
using colibri::cuda::WeightFormat;
using colibri::testing::upload;

struct Shape {
  int group_size;  // 0: a scale and an offset per row
  int64_t n, rows, cols;
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << (s.group_size ? "g" + std::to_string(s.group_size) : std::string("row")) << "_n"
            << s.n << "_rows" << s.rows << "_cols" << s.cols;
}

class ZeroPointsCuda : public testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    std::string why_none;
    if (colibri::cuda::device_count(&why_none) == 0) GTEST_SKIP() << "no CUDA device: " << why_none;
  }
};

// Weights quantized by the container's rule, zero points zp in [-8, 7] (offset -zp * s); x uniform
// in (-1, 1). Each output within the fp32 bound of both sums against the exact product in double,
// taken over |(q - 8) s x| + |offset x| (the two terms the kernels sum apart): CPU cols / 8 + 16
// terms in sequence; GPU cols / 32 + 32 a lane, 5 shuffle levels, the scale and the offset's
// product per 32 columns, the x sums of 32 columns; twice for slack.
TEST_P(ZeroPointsCuda, LinearMatchesDequantizedFp32WithinRoundingBound) {
  const Shape s = GetParam();
  const WeightFormat format = s.group_size ? WeightFormat::kInt4Grouped : WeightFormat::kInt4Row;
  const auto qf =
      s.group_size ? kernels::QuantFormat::kInt4Grouped : kernels::QuantFormat::kInt4Row;
  std::mt19937 rng(unsigned(s.rows * 7 + s.cols + s.group_size));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> wide(size_t(s.rows * s.cols));
  for (float& v : wide) v = uniform(rng);
  std::vector<uint8_t> data(size_t(kernels::packed_bytes(qf, s.rows, s.cols)));
  std::vector<float> scales(size_t(kernels::scale_count(qf, s.rows, s.cols, s.group_size)));
  kernels::quantize(qf, s.group_size, wide.data(), s.rows, s.cols, data.data(), scales.data());
  kernels::QuantMatrixView view{qf, s.rows, s.cols, s.group_size, data.data(), scales.data()};
  std::vector<float> symmetric(wide.size());
  kernels::dequantize(view, symmetric.data());
  std::vector<float> offsets(scales.size());
  std::uniform_int_distribution<int> zp(-8, 7);
  for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = float(-zp(rng)) * scales[i];
  view.offsets = offsets.data();
  kernels::dequantize(view, wide.data());
  std::vector<float> x(size_t(s.n * s.cols));
  for (float& v : x) v = uniform(rng);
  std::vector<float> want(size_t(s.n * s.rows));
  kernels::linear_f32(x.data(), s.n, wide.data(), s.rows, s.cols, want.data());

  uint8_t* d_data = upload(data);
  float* d_scales = upload(scales);
  float* d_offsets = upload(offsets);
  float* d_x = upload(x);
  float* d_y = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_y), want.size() * 4));
  CHECK_CUDA(cudaMemset(d_y, 0xff, want.size() * 4));  // NaN: an output never written fails
  const colibri::cuda::DeviceMatrix w = colibri::cuda::device_matrix(
      format, s.group_size, s.rows, s.cols, d_data, d_scales, "w", d_offsets);
  EXPECT_EQ(w.wide, s.cols % 32 == 0 && s.group_size % 32 == 0 ? 1 : 0);
  colibri::cuda::matrix_linear(w, d_x, s.n, d_y, nullptr);
  std::vector<float> got(want.size());
  CHECK_CUDA(cudaMemcpy(got.data(), d_y, got.size() * 4, cudaMemcpyDeviceToHost));
  cudaFree(d_data);
  cudaFree(d_scales);
  cudaFree(d_offsets);
  cudaFree(d_x);
  cudaFree(d_y);

  const double u = std::ldexp(1.0, -24);
  const double terms = double(s.cols / 8 + 16) + double(s.cols / 32 + 32 + 5 + 2 + 32 + 2);
  const int64_t groups = kernels::offset_groups(view);
  double sum_abs = 0, zero_point_terms = 0;
  for (int64_t t = 0; t < s.n; ++t)
    for (int64_t r = 0; r < s.rows; ++r) {
      double exact = 0, abs_terms = 0;
      for (int64_t c = 0; c < s.cols; ++c) {
        const double xv = x[size_t(t * s.cols + c)];
        const double o = offsets[size_t(r * groups + (s.group_size ? c / s.group_size : 0))];
        exact += double(wide[size_t(r * s.cols + c)]) * xv;
        abs_terms += std::fabs(double(symmetric[size_t(r * s.cols + c)]) * xv) + std::fabs(o * xv);
        zero_point_terms += std::fabs(o * xv);
      }
      const size_t i = size_t(t * s.rows + r);
      ASSERT_TRUE(std::isfinite(got[i])) << "y[" << t << ", " << r << "] not written";
      ASSERT_LE(std::fabs(got[i] - exact), 2 * terms * u * abs_terms)
          << "y[" << t << ", " << r << "]: gpu " << got[i] << " cpu " << want[i];
      sum_abs += std::fabs(got[i]);
    }
  EXPECT_GT(sum_abs, 0.0) << "all-zero output: the comparison proved nothing";
  EXPECT_GT(zero_point_terms, 0.0) << "all-zero offsets: the zero points were not tested";
}

// The 16-byte path (cols and groups multiples of 32: Kimi-K2-Thinking's groups of 32, 64, 128, a
// short last group, row scales) and the per-element one (groups of 16 and 48, odd widths); decode,
// the 4-row pass with a remainder, 8-row passes.
INSTANTIATE_TEST_SUITE_P(Shapes, ZeroPointsCuda,
                         testing::Values(Shape{32, 1, 2048, 7168}, Shape{32, 3, 7168, 2048},
                                         Shape{64, 8, 257, 1024}, Shape{128, 11, 40, 288},
                                         Shape{0, 5, 70, 512}, Shape{16, 1, 33, 80},
                                         Shape{48, 9, 21, 200}, Shape{32, 4, 19, 101},
                                         Shape{0, 2, 17, 45}),
                         [](const testing::TestParamInfo<Shape>& shape_info) {
                           std::ostringstream name;
                           name << shape_info.param;
                           return name.str();
                         });

// Runs without a device: offsets are taken for int4 only, named in the refusal.
TEST(ZeroPointsCudaShapes, OffsetsOnOtherFormatsAreRefusedWithTheirName) {
  alignas(16) uint8_t data[64] = {};
  float scales[4] = {1, 1, 1, 1}, offsets[4] = {0, 0, 0, 0};
  using colibri::cuda::device_matrix;
  EXPECT_EQ(device_matrix(WeightFormat::kInt4Row, 0, 1, 128, data, scales, "w", offsets).offsets,
            offsets);
  EXPECT_EQ(
      device_matrix(WeightFormat::kInt4Grouped, 32, 2, 64, data, scales, "w", offsets).offsets,
      offsets);
  try {
    device_matrix(WeightFormat::kInt8Row, 0, 1, 64, data, scales, "experts.5.down_proj", offsets);
    FAIL() << "device_matrix took offsets for int8";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("experts.5.down_proj"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("int4 only"), std::string::npos) << e.what();
  }
  EXPECT_THROW(device_matrix(WeightFormat::kBF16, 0, 1, 32, data, nullptr, "w", offsets),
               std::invalid_argument);
  EXPECT_EQ(colibri::cuda::device_matrix_offset_count(WeightFormat::kInt4Grouped, 3, 100, 32), 12);
  EXPECT_EQ(colibri::cuda::device_matrix_offset_count(WeightFormat::kInt4Row, 3, 100, 0), 3);
  EXPECT_EQ(colibri::cuda::device_matrix_offset_count(WeightFormat::kInt8Row, 3, 100, 0), 0);
}

}  // namespace
