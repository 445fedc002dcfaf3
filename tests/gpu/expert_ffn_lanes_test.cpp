// The per-lane arithmetic of the grouped expert FFN (cuda/expert_ffn_lanes.cuh), compiled for the
// host and run lane by lane: the 32 lanes' shares of a row's dot products, summed, against the
// exact dot product over the CPU's dequantised weights (kernels::dequantize). Needs no device: it
// checks the 16-byte paths' indexing (nibble order, chunk and group scales, short last groups)
// and the per-element paths, int4 zero points in both) on any machine that builds the CUDA code.
// The launches themselves
// (grids, slot loops, the combine) are checked on a GPU by expert_ffn_cuda_test.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/quant.h"
#include "cuda/expert_ffn_lanes.cuh"

namespace {

using colibri::cuda::DeviceMatrix;
using colibri::cuda::WeightFormat;
namespace kernels = colibri::kernels;
namespace lanes = colibri::cuda::lanes;

struct Case {
  WeightFormat format;
  int group_size;
  int64_t rows, cols;
  bool wide;                 // the 16-byte path is expected
  bool zero_points = false;  // int4: fp32 offsets per (row, group), as an asymmetric checkpoint's
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  std::string f = colibri::cuda::weight_format_name(c.format);
  for (char& ch : f)
    if (ch == '-') ch = '_';
  return os << f << "_g" << c.group_size << "_" << c.rows << "x" << c.cols
            << (c.wide ? "_wide" : "_elementwise") << (c.zero_points ? "_zp" : "");
}

// 64-byte aligned host memory, as cudaMalloc would give (the 16-byte paths need 16).
struct Aligned {
  void* p = nullptr;
  explicit Aligned(size_t bytes) : p(std::aligned_alloc(64, (bytes + 63) / 64 * 64)) {}
  ~Aligned() { std::free(p); }
};

kernels::QuantFormat quant_format(WeightFormat f) {
  return f == WeightFormat::kInt4Row       ? kernels::QuantFormat::kInt4Row
         : f == WeightFormat::kInt4Grouped ? kernels::QuantFormat::kInt4Grouped
                                           : kernels::QuantFormat::kInt8Row;
}

// A random matrix in the case's format: host bytes where the lanes read them, and its values.
// With zero points, the offsets are -zp * s for zp in [-8, 7] (as the loader makes them), and
// `magnitudes` holds |(q - 8) s| + |offset| per weight: the size of the two terms the kernels sum
// apart, which bounds their rounding (values alone may cancel).
struct HostMatrix {
  std::unique_ptr<Aligned> data, scales;
  std::vector<float> offsets;
  std::vector<float> values;      // [rows, cols], exactly what the format stands for
  std::vector<float> magnitudes;  // [rows, cols]
  DeviceMatrix m;

  HostMatrix(const Case& c, std::mt19937& rng) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    values.resize(size_t(c.rows * c.cols));
    for (float& v : values) v = uniform(rng);
    const int group = c.format == WeightFormat::kInt4Grouped ? c.group_size : 0;
    if (c.format == WeightFormat::kF32) {
      data = std::make_unique<Aligned>(values.size() * 4);
      std::memcpy(data->p, values.data(), values.size() * 4);
    } else if (c.format == WeightFormat::kBF16) {
      // The high halves of the fp32 bits (truncated); values become exactly those.
      data = std::make_unique<Aligned>(values.size() * 2);
      auto* bits = static_cast<uint16_t*>(data->p);
      for (size_t i = 0; i < values.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &values[i], 4);
        bits[i] = uint16_t(u >> 16);
        u &= 0xFFFF0000u;
        std::memcpy(&values[i], &u, 4);
      }
    } else if (c.format == WeightFormat::kNvfp4) {
      // The ModelOpt recipe's codes and scales; values become exactly the CPU's dequantization.
      data = std::make_unique<Aligned>(size_t(c.rows * c.cols / 2));
      scales = std::make_unique<Aligned>(size_t(c.rows * c.cols / 16));
      auto* codes = static_cast<uint8_t*>(data->p);
      auto* bytes = static_cast<uint8_t*>(scales->p);
      const float global = kernels::quantize_nvfp4(values.data(), c.rows, c.cols, codes, bytes);
      const kernels::Nvfp4Weights w{codes, bytes, global, c.rows, c.cols};
      kernels::dequantize_nvfp4(w, values.data());
      magnitudes = values;
      m = colibri::cuda::device_matrix_nvfp4(c.rows, c.cols, codes, bytes, global, "test matrix");
      return;
    } else {
      const auto qf = quant_format(c.format);
      data = std::make_unique<Aligned>(size_t(kernels::packed_bytes(qf, c.rows, c.cols)));
      scales =
          std::make_unique<Aligned>(4 * size_t(kernels::scale_count(qf, c.rows, c.cols, group)));
      auto* d = static_cast<uint8_t*>(data->p);
      auto* s = static_cast<float*>(scales->p);
      kernels::quantize(qf, group, values.data(), c.rows, c.cols, d, s);
      kernels::dequantize({qf, c.rows, c.cols, group, d, s}, values.data());
      magnitudes = values;
      if (c.zero_points) {
        offsets.resize(size_t(kernels::scale_count(qf, c.rows, c.cols, group)));
        std::uniform_int_distribution<int> zp(-8, 7);
        for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = float(-zp(rng)) * s[i];
        kernels::QuantMatrixView view{qf, c.rows, c.cols, group, d, s};
        view.offsets = offsets.data();
        kernels::dequantize(view, values.data());
        const int64_t groups = kernels::offset_groups(view);
        for (int64_t r = 0; r < c.rows; ++r)
          for (int64_t i = 0; i < c.cols; ++i)
            magnitudes[size_t(r * c.cols + i)] =
                std::fabs(magnitudes[size_t(r * c.cols + i)]) +
                std::fabs(offsets[size_t(r * groups + (group ? i / group : 0))]);
      }
    }
    if (magnitudes.empty()) magnitudes = values;
    m = colibri::cuda::device_matrix(c.format, group, c.rows, c.cols, data->p,
                                     scales ? static_cast<const float*>(scales->p) : nullptr,
                                     "test matrix", offsets.empty() ? nullptr : offsets.data());
  }
};

// Sum over the 32 lanes of each lane's row_dot share, for T inputs.
template <int T>
std::vector<float> warp_row_dot(const DeviceMatrix& m, int64_t r, const float* const (&xs)[T]) {
  std::vector<float> sum(T, 0.0f);
  for (int lane = 0; lane < lanes::kWarpSize; ++lane) {
    float acc[T];
    lanes::row_dot<T>(m, r, xs, lane, acc);
    for (int t = 0; t < T; ++t) sum[size_t(t)] += acc[t];
  }
  return sum;
}

class ExpertFfnLanes : public testing::TestWithParam<Case> {};

template <int T>
void check_rows(const Case& c, const HostMatrix& w, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  Aligned x_memory(size_t(T * c.cols) * 4);
  auto* x = static_cast<float*>(x_memory.p);
  for (int64_t i = 0; i < T * c.cols; ++i) x[i] = uniform(rng);
  const float* xs[T];
  for (int t = 0; t < T; ++t) xs[t] = x + t * c.cols;
  const double u = std::ldexp(1.0, -24);
  for (int64_t r = 0; r < c.rows; ++r) {
    const std::vector<float> got = warp_row_dot<T>(w.m, r, xs);
    for (int t = 0; t < T; ++t) {
      double exact = 0, sum_abs = 0;
      for (int64_t i = 0; i < c.cols; ++i) {
        const double term = double(w.values[size_t(r * c.cols + i)]) * xs[t][i];
        exact += term;
        sum_abs += std::fabs(double(w.magnitudes[size_t(r * c.cols + i)]) * xs[t][i]);
      }
      // Each lane sums its cols/32 (+32 within a chunk) terms, then 32 lane sums; one more
      // rounding per term for the scale applied per chunk (and for the offset's product).
      const double bound = 2 * (double(c.cols) / 32 + 32 + 32 + 3) * u * sum_abs;
      ASSERT_LE(std::fabs(got[size_t(t)] - exact), bound)
          << "row " << r << " input " << t << " of " << T << ": lanes " << got[size_t(t)]
          << " exact " << exact;
    }
  }
}

TEST_P(ExpertFfnLanes, WarpDotProductsMatchTheDequantisedRows) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.rows * 131 + c.cols));
  const HostMatrix w(c, rng);
  ASSERT_EQ(bool(w.m.wide), c.wide) << "the case does not test the path it names";
  check_rows<1>(c, w, rng);
  check_rows<2>(c, w, rng);
  check_rows<4>(c, w, rng);
  check_rows<8>(c, w, rng);
}

// gate and up in one loop (int4_row_dot2) computes bitwise what two row_dot calls do.
TEST(ExpertFfnLanes, FusedGateUpEqualsTwoRowDots) {
  for (const Case& c : {Case{WeightFormat::kInt4Grouped, 64, 3, 288, true},
                        Case{WeightFormat::kInt4Grouped, 128, 2, 6144, true},
                        Case{WeightFormat::kInt4Row, 0, 3, 2048, true},
                        Case{WeightFormat::kInt4Grouped, 32, 3, 320, true, true},
                        Case{WeightFormat::kInt4Row, 0, 2, 1024, true, true}}) {
    std::mt19937 rng(unsigned(c.rows * 17 + c.cols));
    const HostMatrix gate(c, rng), up(c, rng);
    ASSERT_TRUE(lanes::is_wide_int4(gate.m) && lanes::is_wide_int4(up.m));
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    constexpr int T = 4;
    Aligned x_memory(size_t(T * c.cols) * 4);
    auto* x = static_cast<float*>(x_memory.p);
    for (int64_t i = 0; i < T * c.cols; ++i) x[i] = uniform(rng);
    const float* xs[T] = {x, x + c.cols, x + 2 * c.cols, x + 3 * c.cols};
    for (int64_t r = 0; r < c.rows; ++r)
      for (int lane = 0; lane < lanes::kWarpSize; ++lane) {
        float a[T], b[T], a2[T], b2[T];
        if (c.zero_points)
          lanes::int4_row_dot2<T, true>(gate.m, up.m, r, xs, lane, a, b);
        else
          lanes::int4_row_dot2<T>(gate.m, up.m, r, xs, lane, a, b);
        lanes::row_dot<T>(gate.m, r, xs, lane, a2);
        lanes::row_dot<T>(up.m, r, xs, lane, b2);
        for (int t = 0; t < T; ++t) {
          ASSERT_EQ(a[t], a2[t]) << c << " row " << r << " lane " << lane;
          ASSERT_EQ(b[t], b2[t]) << c << " row " << r << " lane " << lane;
        }
      }
  }
}

// NVFP4's lanes decode every E2M1 code and every E4M3 byte exactly, and a weight as the CPU
// dequantizes it (kernels::dequantize_nvfp4), under every scale byte.
TEST(ExpertFfnLanes, Nvfp4DecodesEveryCodeAndScaleByteAsTheCpu) {
  for (uint32_t code = 0; code < 16; ++code) {
    std::vector<uint8_t> pairs(8, uint8_t(code | (code << 4)));
    const uint8_t one = 0x38;  // 1.0
    float want[16];
    kernels::dequantize_nvfp4({pairs.data(), &one, 1.0f, 1, 16}, want);
    EXPECT_EQ(lanes::e2m1_value(code | 0xF0u), want[0]) << "code " << code;
    EXPECT_EQ(std::signbit(lanes::e2m1_value(code)), std::signbit(want[1])) << "code " << code;
  }
  std::vector<uint8_t> codes(8), bytes(1);
  for (int c = 0; c < 16; c += 2) codes[size_t(c / 2)] = uint8_t(c | ((c + 1) << 4));
  float want[16];
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;  // NaN
    bytes[0] = uint8_t(b);
    const float global = 0.0371f;
    kernels::dequantize_nvfp4({codes.data(), bytes.data(), global, 1, 16}, want);
    const DeviceMatrix m =
        colibri::cuda::device_matrix_nvfp4(1, 16, codes.data(), bytes.data(), global, "byte");
    for (int c = 0; c < 16; ++c)
      ASSERT_EQ(lanes::nvfp4_weight(m, 0, c), want[c]) << "byte " << b << " code " << c;
  }
}

// The emulated byte permute is PTX prmt's default mode, as the dequantisation uses it.
TEST(ExpertFfnLanes, BytePermuteBuildsTheMagicFloats) {
  for (uint32_t b = 0; b < 256; ++b)
    for (int j = 0; j < 4; ++j) {
      const uint32_t v = b << (8 * j);
      EXPECT_EQ(lanes::lane_byte_perm(v, 0x4B000000u, 0x7440u | unsigned(j)), 0x4B000000u | b);
      EXPECT_EQ(lanes::lane_bits_to_float(0x4B000000u | b), 8388608.0f + float(b));
    }
  EXPECT_EQ(lanes::lane_byte_perm(0x33221100u, 0x77665544u, 0x7531u), 0x77553311u);
}

INSTANTIATE_TEST_SUITE_P(
    Table, ExpertFfnLanes,
    testing::Values(
        Case{WeightFormat::kInt4Grouped, 64, 5, 256, true},
        Case{WeightFormat::kInt4Grouped, 64, 3, 6144, true},
        Case{WeightFormat::kInt4Grouped, 64, 4, 288, true},  // short last group
        Case{WeightFormat::kInt4Grouped, 32, 3, 96, true},
        Case{WeightFormat::kInt4Grouped, 96, 3, 384, true},
        Case{WeightFormat::kInt4Grouped, 128, 2, 2048, true},
        Case{WeightFormat::kInt4Grouped, 192, 2, 416, true},  // 416 = 2 groups + 32
        Case{WeightFormat::kInt4Grouped, 256, 2, 512, true},
        Case{WeightFormat::kInt4Grouped, 16, 3, 160, false},
        Case{WeightFormat::kInt4Grouped, 48, 3, 200, false},
        Case{WeightFormat::kInt4Grouped, 64, 3, 100, false},
        Case{WeightFormat::kInt4Row, 0, 4, 2048, true},
        Case{WeightFormat::kInt4Row, 0, 3, 257, false},
        Case{WeightFormat::kInt8Row, 0, 4, 6144, true},
        Case{WeightFormat::kInt8Row, 0, 3, 16, true},
        Case{WeightFormat::kInt8Row, 0, 3, 300, false}, Case{WeightFormat::kF32, 0, 3, 1024, true},
        Case{WeightFormat::kF32, 0, 3, 35, false}, Case{WeightFormat::kBF16, 0, 3, 2048, true},
        Case{WeightFormat::kBF16, 0, 3, 264, true}, Case{WeightFormat::kBF16, 0, 3, 37, false},
        Case{WeightFormat::kNvfp4, 0, 3, 256, true}, Case{WeightFormat::kNvfp4, 0, 2, 6144, true},
        Case{WeightFormat::kNvfp4, 0, 4, 32, true}, Case{WeightFormat::kNvfp4, 0, 3, 48, false},
        Case{WeightFormat::kNvfp4, 0, 3, 16, false},
        // Zero points (compressed-tensors INT4 asymmetric): groups of 32 (Kimi's), 64, 128 and a
        // short last group, per row, and the per-element path (groups of 48, odd widths).
        Case{WeightFormat::kInt4Grouped, 32, 3, 96, true, true},
        Case{WeightFormat::kInt4Grouped, 64, 4, 288, true, true},
        Case{WeightFormat::kInt4Grouped, 128, 2, 2048, true, true},
        Case{WeightFormat::kInt4Row, 0, 3, 2048, true, true},
        Case{WeightFormat::kInt4Grouped, 48, 3, 200, false, true},
        Case{WeightFormat::kInt4Grouped, 32, 3, 101, false, true},
        Case{WeightFormat::kInt4Row, 0, 3, 257, false, true}),
    [](const testing::TestParamInfo<Case>& param_info) {
      std::ostringstream name;
      name << param_info.param;
      return name.str();
    });

}  // namespace
