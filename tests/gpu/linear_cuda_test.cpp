// colibri::cuda::linear_f32 against the CPU oracle colibri::kernels::linear_f32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/linear.cuh"

namespace {

// A device allocation of `count` floats plus `offset` leading floats, so that the data pointer
// can be deliberately misaligned (offset 1) to reach the scalar kernel path.
class DeviceFloats {
 public:
  explicit DeviceFloats(size_t count, size_t offset = 0) : offset_(offset) {
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&base_), (count + offset) * sizeof(float)));
  }
  ~DeviceFloats() { cudaFree(base_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  float* data() { return base_ + offset_; }

 private:
  float* base_ = nullptr;
  size_t offset_;
};

struct Shape {
  int64_t n, rows, cols;
  size_t x_offset;  // floats; 1 misaligns x and forces the scalar path
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "n" << s.n << "_rows" << s.rows << "_cols" << s.cols << "_xoff" << s.x_offset;
}

// Runs the CUDA kernel on host data and returns y[n, rows].
std::vector<float> linear_on_device(const std::vector<float>& x, const std::vector<float>& w,
                                    const Shape& s) {
  DeviceFloats dx(x.size(), s.x_offset), dw(w.size()), dy(size_t(s.n * s.rows));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  CHECK_CUDA(cudaMemcpyAsync(dx.data(), x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice,
                             stream));
  CHECK_CUDA(cudaMemcpyAsync(dw.data(), w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice,
                             stream));
  // NaN-fill y so that an output the kernel never writes cannot pass.
  CHECK_CUDA(cudaMemsetAsync(dy.data(), 0xff, size_t(s.n * s.rows) * sizeof(float), stream));
  colibri::cuda::linear_f32(dx.data(), s.n, dw.data(), s.rows, s.cols, dy.data(), stream);
  std::vector<float> y(size_t(s.n * s.rows));
  CHECK_CUDA(cudaMemcpyAsync(y.data(), dy.data(), y.size() * sizeof(float), cudaMemcpyDeviceToHost,
                             stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return y;
}

class LinearCuda : public testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    std::string why_none;
    if (colibri::cuda::device_count(&why_none) == 0) GTEST_SKIP() << "no CUDA device: " << why_none;
  }
};

// Small integers: every partial sum is an integer below 2^24, so both implementations are exact
// whatever their summation order and the results must be bitwise equal.
TEST_P(LinearCuda, IntegerDataMatchesCpuExactly) {
  const Shape s = GetParam();
  ASSERT_LE(9 * s.cols, int64_t(1) << 24) << "shape too wide for an exact check";
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> small(-3, 3);
  std::vector<float> x(size_t(s.n * s.cols)), w(size_t(s.rows * s.cols));
  for (float& v : x) v = float(small(rng));
  for (float& v : w) v = float(small(rng));

  std::vector<float> expected(size_t(s.n * s.rows));
  colibri::kernels::linear_f32(x.data(), s.n, w.data(), s.rows, s.cols, expected.data());
  const std::vector<float> got = linear_on_device(x, w, s);

  double sum_abs = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], expected[i]) << "y[" << i / s.rows << ", " << i % s.rows << "]";
    sum_abs += std::fabs(got[i]);
  }
  EXPECT_GT(sum_abs, 0.0) << "all-zero output: the comparison proved nothing";
}

// Uniform(-1, 1) data. Both sides accumulate in fp32 in different orders; a sum of k terms in
// any order is within (k - 1)·u·Σ|x_i w_i| of the exact value (u = 2^-24), so the two results
// differ by at most the sum of both bounds. The CPU sums cols/8 + 16 terms in sequence (8
// partial sums, then the tail and the combine); the GPU sums cols/32 (+4 for float4 lanes) per
// lane and 5 shuffle levels. 2x slack for FMA rounding differences.
TEST_P(LinearCuda, RandomDataWithinRoundingBound) {
  const Shape s = GetParam();
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x(size_t(s.n * s.cols)), w(size_t(s.rows * s.cols));
  for (float& v : x) v = uniform(rng);
  for (float& v : w) v = uniform(rng);

  std::vector<float> expected(size_t(s.n * s.rows));
  colibri::kernels::linear_f32(x.data(), s.n, w.data(), s.rows, s.cols, expected.data());
  const std::vector<float> got = linear_on_device(x, w, s);

  const double u = std::ldexp(1.0, -24);
  const double sequential_terms = double(s.cols / 8 + 16) + double(s.cols / 32 + 4 + 5);
  double max_ratio = 0;  // largest |error| / bound seen, reported on success
  for (int64_t t = 0; t < s.n; ++t) {
    for (int64_t r = 0; r < s.rows; ++r) {
      double sum_abs_terms = 0;
      for (int64_t c = 0; c < s.cols; ++c)
        sum_abs_terms += std::fabs(double(x[t * s.cols + c]) * w[r * s.cols + c]);
      const double bound = 2.0 * sequential_terms * u * sum_abs_terms;
      const size_t i = size_t(t * s.rows + r);
      const double err = std::fabs(double(got[i]) - expected[i]);
      ASSERT_TRUE(std::isfinite(got[i])) << "y[" << t << ", " << r << "] not written";
      ASSERT_LE(err, bound) << "y[" << t << ", " << r << "]: gpu " << got[i] << " cpu "
                            << expected[i];
      if (bound > 0) max_ratio = std::max(max_ratio, err / bound);
    }
  }
  RecordProperty("max_error_over_bound", std::to_string(max_ratio));
}

// Shapes cover: the float4 path (cols % 4 == 0) and the scalar path (odd cols, misaligned x);
// token counts below, at and above the 4-token pass with remainders; row counts that do not
// fill the last 8-warp block; cols below one warp width; a 7168-wide row as in DeepSeek-V3.
INSTANTIATE_TEST_SUITE_P(Shapes, LinearCuda,
                         testing::Values(Shape{1, 1, 1, 0}, Shape{1, 257, 4096, 0},
                                         Shape{3, 100, 1001, 0}, Shape{4, 33, 64, 0},
                                         Shape{5, 129, 200, 0}, Shape{17, 70, 31, 0},
                                         Shape{6, 65, 128, 1}, Shape{2, 40, 7168, 0},
                                         Shape{9, 3000, 20, 0}),
                         [](const testing::TestParamInfo<Shape>& shape_info) {
                           std::ostringstream name;
                           name << shape_info.param;
                           return name.str();
                         });

}  // namespace
