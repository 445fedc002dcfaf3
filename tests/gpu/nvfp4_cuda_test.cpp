// colibri::cuda::matrix_linear on NVFP4 weights as stored (the codes and E4M3 scale bytes widened
// in registers) against the CPU oracle: kernels::dequantize_nvfp4, then kernels::linear_f32.
// Skips without a CUDA device. The per-lane arithmetic is checked without one by
// expert_ffn_lanes_test, the grouped expert FFN on NVFP4 experts by expert_ffn_cuda_test.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/expert_ffn.cuh"
#include "device_memory.h"

namespace {

namespace kernels = colibri::kernels;
using colibri::testing::upload;

struct Shape {
  int64_t n, rows, cols;
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "n" << s.n << "_rows" << s.rows << "_cols" << s.cols;
}

class Nvfp4Cuda : public testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    std::string why_none;
    if (colibri::cuda::device_count(&why_none) == 0) GTEST_SKIP() << "no CUDA device: " << why_none;
  }
};

// Random codes under random positive scale bytes (2^-3 .. 2^4); x uniform in (-1, 1). Each output
// within the fp32 bound of both sums (CPU: cols / 8 + 16 terms in sequence; GPU: cols / 32 + 32
// a lane, 5 shuffle levels, one rounding per 16 columns for the block's scale and one for
// e4m3 * global), twice for slack, against the exact product in double.
TEST_P(Nvfp4Cuda, LinearMatchesDequantizedFp32WithinRoundingBound) {
  const Shape s = GetParam();
  std::mt19937 rng(unsigned(s.rows * 7 + s.cols));
  std::vector<uint8_t> codes(size_t(s.rows * s.cols / 2)), scales(size_t(s.rows * s.cols / 16));
  for (uint8_t& c : codes) c = uint8_t(rng());
  for (uint8_t& b : scales) b = uint8_t(0x20 + rng() % 0x40);
  const float global = 0.0123f;
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x(size_t(s.n * s.cols)), wide(size_t(s.rows * s.cols));
  for (float& v : x) v = uniform(rng);
  kernels::dequantize_nvfp4({codes.data(), scales.data(), global, s.rows, s.cols}, wide.data());
  std::vector<float> want(size_t(s.n * s.rows));
  kernels::linear_f32(x.data(), s.n, wide.data(), s.rows, s.cols, want.data());

  uint8_t* d_codes = upload(codes);
  uint8_t* d_scales = upload(scales);
  float* d_x = upload(x);
  float* d_y = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_y), want.size() * 4));
  CHECK_CUDA(cudaMemset(d_y, 0xff, want.size() * 4));  // NaN: an output never written fails
  const colibri::cuda::DeviceMatrix w =
      colibri::cuda::device_matrix_nvfp4(s.rows, s.cols, d_codes, d_scales, global, "w");
  EXPECT_EQ(w.wide, s.cols % 32 == 0 ? 1 : 0);
  colibri::cuda::matrix_linear(w, d_x, s.n, d_y, nullptr);
  std::vector<float> got(want.size());
  CHECK_CUDA(cudaMemcpy(got.data(), d_y, got.size() * 4, cudaMemcpyDeviceToHost));
  cudaFree(d_codes);
  cudaFree(d_scales);
  cudaFree(d_x);
  cudaFree(d_y);

  const double u = std::ldexp(1.0, -24);
  const double terms = double(s.cols / 8 + 16) + double(s.cols / 32 + 32 + 5 + 2);
  double sum_abs = 0;
  for (int64_t t = 0; t < s.n; ++t)
    for (int64_t r = 0; r < s.rows; ++r) {
      double exact = 0, abs_terms = 0;
      for (int64_t c = 0; c < s.cols; ++c) {
        const double term = double(wide[size_t(r * s.cols + c)]) * x[size_t(t * s.cols + c)];
        exact += term;
        abs_terms += std::fabs(term);
      }
      const size_t i = size_t(t * s.rows + r);
      ASSERT_TRUE(std::isfinite(got[i])) << "y[" << t << ", " << r << "] not written";
      ASSERT_LE(std::fabs(got[i] - exact), 2 * terms * u * abs_terms)
          << "y[" << t << ", " << r << "]: gpu " << got[i] << " cpu " << want[i];
      sum_abs += std::fabs(got[i]);
    }
  EXPECT_GT(sum_abs, 0.0) << "all-zero output: the comparison proved nothing";
}

// The 16-byte path (cols % 32 == 0: GLM-5.2's expert shapes, a single chunk) and the
// per-element one (cols % 32 == 16); decode, the 4-row pass with a remainder, 8-row passes.
INSTANTIATE_TEST_SUITE_P(Shapes, Nvfp4Cuda,
                         testing::Values(Shape{1, 2048, 6144}, Shape{3, 6144, 2048},
                                         Shape{8, 257, 1024}, Shape{11, 40, 32}, Shape{1, 33, 48},
                                         Shape{5, 70, 272}),
                         [](const testing::TestParamInfo<Shape>& shape_info) {
                           std::ostringstream name;
                           name << shape_info.param;
                           return name.str();
                         });

TEST(Nvfp4CudaShapes, BadDescriptionsAreRefusedWithTheirName) {
  const uint8_t byte = 0;
  EXPECT_THROW(colibri::cuda::device_matrix_nvfp4(4, 24, &byte, &byte, 1.0f, "w"),
               std::invalid_argument);
  EXPECT_THROW(colibri::cuda::device_matrix_nvfp4(4, 32, nullptr, &byte, 1.0f, "w"),
               std::invalid_argument);
  try {
    colibri::cuda::device_matrix(colibri::cuda::WeightFormat::kNvfp4, 0, 4, 32, &byte, nullptr,
                                 "experts.3.up_proj");
    FAIL() << "device_matrix took an NVFP4 matrix";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("experts.3.up_proj"), std::string::npos) << e.what();
  }
}

}  // namespace
