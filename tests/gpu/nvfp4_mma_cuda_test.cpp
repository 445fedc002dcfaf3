// The block-scaled FP4 tensor-core path (cuda/nvfp4_mma.cuh) against the CPU oracle:
//   - on any GPU: the device's activation quantizer against kernels::quantize_nvfp4, bit for bit,
//     and, where the MMA cannot run (not compute capability 12.x), COLIBRI_FP4_MMA=1 leaving
//     matrix_linear on the FP4-widening kernels;
//   - on compute capability 12.x only (the instruction exists there alone): the product against
//     kernels::dequantize_nvfp4 of the weights times the activations dequantized after the same
//     quantization (so the only difference is the fp32 accumulation order), the switch in
//     matrix_linear, and the grouped expert FFN stage by stage.
// On compute capability 9.0 (H100, H200) the 12.x tests skip, saying so.
// COLIBRI_FP4_MMA=1 is set for this process before anything reads it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/expert_ffn.cuh"
#include "cuda/expert_group.h"
#include "cuda/nvfp4_mma.cuh"
#include "device_memory.h"

namespace {

namespace cuda = colibri::cuda;
namespace kernels = colibri::kernels;
using colibri::testing::download;
using colibri::testing::upload;

const bool kSwitchOn = [] { return setenv("COLIBRI_FP4_MMA", "1", 1) == 0; }();

// The products of E2M1 codes and E4M3 scales are exact in fp32; what remains is the tensor core's
// accumulation, whose internal precision PTX does not specify. 2^-16 of the sum of |terms| is
// loose for fp32 sums (cols / 64 roundings of 2^-24) and still far below what a layout error
// gives (a wrong code, scale byte, row or column moves a result by the size of its terms).
const double kMmaRelative = std::ldexp(1.0, -16);

class Nvfp4MmaAnyGpu : public testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kSwitchOn);
    std::string why_none;
    if (cuda::device_count(&why_none) == 0) GTEST_SKIP() << "no CUDA device: " << why_none;
  }
};

// Skips off compute capability 12.x; fails there when this build has the sm_120a/sm_120f code
// and the device did not load it.
class Nvfp4MmaBlackwell : public Nvfp4MmaAnyGpu {
 protected:
  void SetUp() override {
    Nvfp4MmaAnyGpu::SetUp();
    if (IsSkipped()) return;
    int device = 0;
    CHECK_CUDA(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
    if (prop.major != 12)
      GTEST_SKIP() << "needs compute capability 12.x (sm_120/sm_121: RTX 50 series, RTX PRO "
                      "Blackwell, DGX Spark) for the block-scaled FP4 MMA; this device, "
                   << prop.name << ", is " << prop.major << "." << prop.minor
                   << " (H100 and H200 are 9.0)";
#ifdef COLIBRI_FP4_MMA_ARCH
    ASSERT_TRUE(cuda::nvfp4_mma_supported(device))
        << prop.name << " (" << prop.major << "." << prop.minor
        << "): built with sm_" COLIBRI_FP4_MMA_ARCH " code, but the device did not load it";
#else
    if (!cuda::nvfp4_mma_supported(device))
      GTEST_SKIP() << "this build's nvcc had no sm_120a/sm_120f target";
#endif
  }
};

// x [n, cols] with rows of different magnitudes (2^-4 .. 2^4), a zero block and a tiny one.
std::vector<float> activations(int64_t n, int64_t cols, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(n * cols));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < cols; ++c)
      x[size_t(t * cols + c)] = normal(rng) * std::exp2(float(t % 9) - 4.0f);
  if (n > 1 && cols >= 32) {
    for (int c = 0; c < 16; ++c) x[size_t(cols + c)] = 0.0f;
    for (int c = 16; c < 32; ++c) x[size_t(cols + c)] = 1e-20f * float(c);
  }
  return x;
}

// NVFP4 weights with every E2M1 code (random bytes) and E4M3 scale bytes spread from a subnormal
// (0x01) through 2^-6 .. 2^6 to 448 (0x7E).
struct HostNvfp4 {
  std::vector<uint8_t> codes, scales;
  float global;
  int64_t rows, cols;
  kernels::Nvfp4Weights view() const { return {codes.data(), scales.data(), global, rows, cols}; }
  std::vector<float> dequantized() const {
    std::vector<float> w(size_t(rows * cols));
    kernels::dequantize_nvfp4(view(), w.data());
    return w;
  }
};

HostNvfp4 random_weights(int64_t rows, int64_t cols, float global, unsigned seed) {
  std::mt19937 rng(seed);
  HostNvfp4 w{std::vector<uint8_t>(size_t(rows * cols / 2)),
              std::vector<uint8_t>(size_t(rows * cols / 16)), global, rows, cols};
  for (uint8_t& c : w.codes) c = uint8_t(rng());
  static constexpr uint8_t kRare[] = {0x01, 0x07, 0x7E, 0x70};
  for (size_t i = 0; i < w.scales.size(); ++i)
    w.scales[i] = i % 29 < 4 ? kRare[i % 29] : uint8_t(0x08 + rng() % 0x60);
  return w;
}

// x quantized and dequantized by the CPU recipe: the activations the MMA multiplies.
std::vector<float> fp4_activations(const std::vector<float>& x, int64_t n, int64_t cols) {
  std::vector<uint8_t> codes(size_t(n * cols / 2)), scales(size_t(n * cols / 16));
  const float global = kernels::quantize_nvfp4(x.data(), n, cols, codes.data(), scales.data());
  std::vector<float> out(x.size());
  kernels::dequantize_nvfp4({codes.data(), scales.data(), global, n, cols}, out.data());
  return out;
}

// y [n, rows] = a [n, cols] . b [rows, cols]^T in double, and the sums of |terms|.
void exact_product(const std::vector<float>& a, const std::vector<float>& b, int64_t n,
                   int64_t rows, int64_t cols, std::vector<double>& y, std::vector<double>& abs) {
  y.assign(size_t(n * rows), 0.0);
  abs.assign(size_t(n * rows), 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0, sum_abs = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double term = double(a[size_t(t * cols + c)]) * b[size_t(r * cols + c)];
        sum += term;
        sum_abs += std::fabs(term);
      }
      y[size_t(t * rows + r)] = sum;
      abs[size_t(t * rows + r)] = sum_abs;
    }
}

TEST_F(Nvfp4MmaAnyGpu, DeviceQuantizerIsQuantizeNvfp4BitForBit) {
  for (const auto& [n, cols] : {std::pair<int64_t, int64_t>{37, 208}, {1, 16}, {16, 4096}}) {
    for (bool zero : {false, true}) {
      std::vector<float> x = activations(n, cols, unsigned(n + cols));
      if (zero) std::fill(x.begin(), x.end(), 0.0f);
      std::vector<uint8_t> codes(size_t(n * cols / 2)), scales(size_t(n * cols / 16));
      const float global = kernels::quantize_nvfp4(x.data(), n, cols, codes.data(), scales.data());
      float* d_x = upload(x);
      uint8_t* d_codes = upload(std::vector<uint8_t>(codes.size()));
      uint8_t* d_scales = upload(std::vector<uint8_t>(scales.size()));
      float* d_global = upload(std::vector<float>{-1.0f});
      uint32_t* d_amax = upload(std::vector<uint32_t>{0});
      cuda::quantize_nvfp4_device(d_x, n, cols, d_codes, d_scales, d_global, d_amax, nullptr);
      EXPECT_EQ(download(d_global, 1)[0], global) << "n" << n << " cols" << cols;
      EXPECT_EQ(download(d_codes, codes.size()), codes) << "n" << n << " cols" << cols;
      EXPECT_EQ(download(d_scales, scales.size()), scales) << "n" << n << " cols" << cols;
      cudaFree(d_x);
      cudaFree(d_codes);
      cudaFree(d_scales);
      cudaFree(d_global);
      cudaFree(d_amax);
    }
  }
}

// Where the MMA cannot run, COLIBRI_FP4_MMA=1 leaves matrix_linear on the fp32-activation kernels:
// their result within nvfp4_cuda_test's bound of the fp32 product.
TEST_F(Nvfp4MmaAnyGpu, SwitchKeepsTheWideningKernelsWhereTheMmaCannotRun) {
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  if (cuda::nvfp4_mma_supported(device))
    GTEST_SKIP() << "this device runs the MMA (Nvfp4MmaBlackwell covers the switch here)";
  EXPECT_FALSE(cuda::nvfp4_mma_selected());
  const int64_t n = 16, rows = 40, cols = 128;
  const HostNvfp4 w = random_weights(rows, cols, 0.0123f, 5);
  const std::vector<float> x = activations(n, cols, 6), wide = w.dequantized();
  std::vector<double> exact, abs;
  exact_product(x, wide, n, rows, cols, exact, abs);
  uint8_t* d_codes = upload(w.codes);
  uint8_t* d_scales = upload(w.scales);
  float* d_x = upload(x);
  float* d_y = upload(std::vector<float>(size_t(n * rows), NAN));
  cuda::matrix_linear(cuda::device_matrix_nvfp4(rows, cols, d_codes, d_scales, w.global, "w"), d_x,
                      n, d_y, nullptr);
  const std::vector<float> y = download(d_y, size_t(n * rows));
  const double u = std::ldexp(1.0, -24), terms = double(cols / 8 + 16 + cols / 32 + 39);
  for (size_t i = 0; i < y.size(); ++i)
    ASSERT_LE(std::fabs(y[i] - exact[i]), 2 * terms * u * abs[i]) << "y[" << i << "]";
  cudaFree(d_codes);
  cudaFree(d_scales);
  cudaFree(d_x);
  cudaFree(d_y);
}

struct Shape {
  int64_t n, rows, cols;
};
std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "n" << s.n << "_rows" << s.rows << "_cols" << s.cols;
}

class Nvfp4MmaProduct : public Nvfp4MmaBlackwell, public testing::WithParamInterface<Shape> {};

TEST_P(Nvfp4MmaProduct, MatchesTheDequantizedOperandsProduct) {
  const Shape s = GetParam();
  const HostNvfp4 w = random_weights(s.rows, s.cols, 0.0123f, unsigned(s.rows * 7 + s.cols));
  const std::vector<float> x = activations(s.n, s.cols, unsigned(s.n * 3 + s.cols));
  std::vector<double> exact, abs;
  exact_product(fp4_activations(x, s.n, s.cols), w.dequantized(), s.n, s.rows, s.cols, exact, abs);
  uint8_t* d_codes = upload(w.codes);
  uint8_t* d_scales = upload(w.scales);
  float* d_x = upload(x);
  float* d_y = upload(std::vector<float>(size_t(s.n * s.rows), NAN));
  cuda::nvfp4_mma_linear(
      cuda::device_matrix_nvfp4(s.rows, s.cols, d_codes, d_scales, w.global, "w"), d_x, s.n, d_y,
      nullptr);
  const std::vector<float> y = download(d_y, size_t(s.n * s.rows));
  double sum_abs = 0;
  for (int64_t t = 0; t < s.n; ++t)
    for (int64_t r = 0; r < s.rows; ++r) {
      const size_t i = size_t(t * s.rows + r);
      ASSERT_TRUE(std::isfinite(y[i])) << "y[" << t << ", " << r << "] not written";
      ASSERT_LE(std::fabs(y[i] - exact[i]), kMmaRelative * abs[i] + 1e-30)
          << "y[" << t << ", " << r << "]: gpu " << y[i] << " exact " << exact[i];
      sum_abs += std::fabs(y[i]);
    }
  EXPECT_GT(sum_abs, 0.0) << "all-zero output: the comparison proved nothing";
  cudaFree(d_codes);
  cudaFree(d_scales);
  cudaFree(d_x);
  cudaFree(d_y);
}

// Whole chunks of 64 and partial last ones (16, 32, 48 columns), odd row counts, one to several
// tiles of 16 weight rows and of 32 activation rows.
INSTANTIATE_TEST_SUITE_P(Shapes, Nvfp4MmaProduct,
                         testing::Values(Shape{16, 16, 64}, Shape{17, 37, 208}, Shape{45, 130, 128},
                                         Shape{33, 64, 80}, Shape{19, 24, 96}, Shape{1, 5, 16},
                                         Shape{64, 256, 2048}, Shape{23, 48, 6144}),
                         [](const testing::TestParamInfo<Shape>& shape_info) {
                           std::ostringstream name;
                           name << shape_info.param;
                           return name.str();
                         });

// With the switch on: 16 rows take the MMA (nvfp4_mma_linear's bits), 15 the widening kernels.
TEST_F(Nvfp4MmaBlackwell, MatrixLinearTakesTheMmaFrom16Rows) {
  ASSERT_TRUE(cuda::nvfp4_mma_selected());
  const int64_t rows = 40, cols = 192;
  const HostNvfp4 w = random_weights(rows, cols, 0.02f, 9);
  const std::vector<float> x = activations(16, cols, 10);
  uint8_t* d_codes = upload(w.codes);
  uint8_t* d_scales = upload(w.scales);
  float* d_x = upload(x);
  float* d_y = upload(std::vector<float>(size_t(16 * rows)));
  float* d_mma = upload(std::vector<float>(size_t(16 * rows)));
  const cuda::DeviceMatrix dw =
      cuda::device_matrix_nvfp4(rows, cols, d_codes, d_scales, w.global, "w");
  cuda::nvfp4_mma_linear(dw, d_x, 16, d_mma, nullptr);
  cuda::matrix_linear(dw, d_x, 16, d_y, nullptr);
  EXPECT_EQ(download(d_y, size_t(16 * rows)), download(d_mma, size_t(16 * rows)));
  // 15 rows: the fp32-activation kernels, which do not round x to FP4.
  cuda::matrix_linear(dw, d_x, 15, d_y, nullptr);
  const std::vector<float> y15 = download(d_y, size_t(15 * rows));
  std::vector<double> exact, abs;
  exact_product(std::vector<float>(x.begin(), x.begin() + 15 * cols), w.dequantized(), 15, rows,
                cols, exact, abs);
  const double u = std::ldexp(1.0, -24), terms = double(cols / 8 + 16 + cols / 32 + 39);
  for (size_t i = 0; i < y15.size(); ++i)
    ASSERT_LE(std::fabs(y15[i] - exact[i]), 2 * terms * u * abs[i]) << "y[" << i << "]";
  cudaFree(d_codes);
  cudaFree(d_scales);
  cudaFree(d_x);
  cudaFree(d_y);
  cudaFree(d_mma);
}

// The grouped expert FFN through ExpertGroupBuffers (as the CUDA expert backend runs it), stage
// by stage: h against the oracle from the FP4 x; y_slots against the oracle from the device's h
// quantized by the CPU recipe (the device's quantizer is the CPU's bit for bit); out against the
// routing-weighted sum of the y oracle.
TEST_F(Nvfp4MmaBlackwell, GroupedExpertFfnMatchesTheOracleStageByStage) {
  const int64_t hidden = 128, inter = 80;
  const int n_rows = 40, n_experts = 4;
  std::vector<HostNvfp4> gate, up, down;
  std::vector<cuda::DeviceExpert> experts;
  for (int e = 0; e < n_experts; ++e) {
    gate.push_back(random_weights(inter, hidden, 0.004f, unsigned(100 + e)));
    up.push_back(random_weights(inter, hidden, 0.005f, unsigned(200 + e)));
    down.push_back(random_weights(hidden, inter, 0.003f, unsigned(300 + e)));
    cuda::DeviceExpert d;
    d.gate = cuda::device_matrix_nvfp4(inter, hidden, upload(gate[e].codes), upload(gate[e].scales),
                                       gate[e].global, "gate");
    d.up = cuda::device_matrix_nvfp4(inter, hidden, upload(up[e].codes), upload(up[e].scales),
                                     up[e].global, "up");
    d.down = cuda::device_matrix_nvfp4(hidden, inter, upload(down[e].codes), upload(down[e].scales),
                                       down[e].global, "down");
    experts.push_back(d);
  }
  ASSERT_TRUE(cuda::nvfp4_mma_fits(experts.data(), n_experts));
  // Expert 0 takes every row (40 slots: two tiles of 32 and a partial one), expert 1 every third,
  // expert 2 one row, expert 3 rows 0 .. 16 (17).
  std::vector<cuda::ExpertPair> pairs;
  for (int r = 0; r < n_rows; ++r) {
    pairs.push_back({r, 0, 0.5f + 0.01f * float(r)});
    if (r % 3 == 0) pairs.push_back({r, 1, 0.25f});
    if (r == 7) pairs.push_back({r, 2, 0.75f});
    if (r <= 16) pairs.push_back({r, 3, -0.5f});
  }
  const cuda::ExpertGroupIndex index = cuda::index_pairs(n_rows, pairs);
  ASSERT_GE(index.max_slots_per_expert, cuda::kNvfp4MmaMinRows);
  const std::vector<float> x = activations(n_rows, hidden, 21);
  std::vector<float> out(size_t(n_rows * hidden), NAN);
  cuda::ExpertGroupBuffers buffers;
  buffers.run(index, experts, x.data(), hidden, inter, out.data(), nullptr);
  CHECK_CUDA(cudaDeviceSynchronize());
  const int n_slots = int(index.slot_row.size());
  const std::vector<float> h = download(buffers.group().h, size_t(n_slots * inter));
  const std::vector<float> y = download(buffers.group().y_slots, size_t(n_slots * hidden));

  const std::vector<float> xq = fp4_activations(x, n_rows, hidden);
  const std::vector<float> hq = fp4_activations(h, n_slots, inter);
  std::vector<double> y_exact(size_t(n_slots * hidden)), y_bound(size_t(n_slots * hidden));
  for (int e = 0; e < n_experts; ++e) {
    const std::vector<float> wg = gate[e].dequantized(), wu = up[e].dequantized(),
                             wd = down[e].dequantized();
    for (int s = index.expert_begin[size_t(e)]; s < index.expert_begin[size_t(e) + 1]; ++s) {
      const float* xr = xq.data() + size_t(index.slot_row[size_t(s)]) * hidden;
      for (int64_t r = 0; r < inter; ++r) {
        double g = 0, g_abs = 0, u = 0, u_abs = 0;
        for (int64_t c = 0; c < hidden; ++c) {
          g += double(wg[size_t(r * hidden + c)]) * xr[c];
          g_abs += std::fabs(double(wg[size_t(r * hidden + c)]) * xr[c]);
          u += double(wu[size_t(r * hidden + c)]) * xr[c];
          u_abs += std::fabs(double(wu[size_t(r * hidden + c)]) * xr[c]);
        }
        const double silu = g / (1 + std::exp(-g)), want = silu * u;
        const double eg = kMmaRelative * g_abs, eu = kMmaRelative * u_abs;
        const double bound = 1.1 * eg * (std::fabs(u) + eu) + std::fabs(silu) * eu +
                             8 * std::ldexp(1.0, -24) * std::fabs(want) + 1e-30;
        ASSERT_LE(std::fabs(h[size_t(s) * inter + r] - want), bound)
            << "h[slot " << s << ", " << r << "] of expert " << e;
      }
      for (int64_t r = 0; r < hidden; ++r) {
        double sum = 0, sum_abs = 0;
        for (int64_t c = 0; c < inter; ++c) {
          const double term = double(wd[size_t(r * inter + c)]) * hq[size_t(s) * inter + c];
          sum += term;
          sum_abs += std::fabs(term);
        }
        const size_t i = size_t(s) * hidden + r;
        y_exact[i] = sum;
        y_bound[i] = kMmaRelative * sum_abs + 1e-30;
        ASSERT_LE(std::fabs(y[i] - sum), y_bound[i]) << "y[slot " << s << ", " << r << "]";
      }
    }
  }
  double sum_abs = 0;
  for (int row = 0; row < n_rows; ++row)
    for (int64_t c = 0; c < hidden; ++c) {
      double want = 0, bound = 0, magnitude = 0;
      for (int k = index.row_begin[size_t(row)]; k < index.row_begin[size_t(row) + 1]; ++k) {
        const size_t i = size_t(index.row_slots[size_t(k)]) * hidden + c;
        const double wgt = index.row_weights[size_t(k)];
        want += wgt * y_exact[i];
        bound += std::fabs(wgt) * y_bound[i];
        magnitude += std::fabs(wgt * y_exact[i]);
      }
      const float got = out[size_t(row) * hidden + c];
      ASSERT_LE(std::fabs(got - want), bound + 8 * std::ldexp(1.0, -24) * magnitude)
          << "out[" << row << ", " << c << "]";
      sum_abs += std::fabs(got);
    }
  EXPECT_GT(sum_abs, 0.0) << "all-zero output: the comparison proved nothing";
  for (const cuda::DeviceExpert& d : experts)
    for (const cuda::DeviceMatrix* m : {&d.gate, &d.up, &d.down}) {
      cudaFree(const_cast<void*>(m->data));
      cudaFree(const_cast<uint8_t*>(m->e4m3_scales));
    }
}

}  // namespace
