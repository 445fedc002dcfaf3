// NVFP4 weights as stored (ModelOpt): every E2M1 code under every E4M3 scale byte decodes to
// code * scale * global, checked against an independent decoder; the dot and linear kernels on
// every ISA this machine has are bit for bit the fp32 kernels on the dequantized matrix; the
// int8-activation kernels (scalar, AVX2, AVX-512 with and without VNNI; a kernel this CPU lacks
// is skipped with the reason) are bit for bit their scalar reference on every code and scale byte
// and odd shapes, whatever the batch, and within the stated bound of the exact product; the
// ModelOpt recipe rounds to nearest (ties to even) and its error stays within half a step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "cpu/linear.h"
#include "quant_fixtures.h"

namespace colibri::kernels {
namespace {

using test::available_isas;

// One int8-activation kernel: an ISA, and on AVX-512 whether VNNI is on (off: the AVX2 kernel).
struct KernelCase {
  QuantIsa isa;
  bool vnni;
};

bool cpu_has_avx512vnni() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// E2M1 by its definition: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is
// subnormal (0 or 0.5).
double e2m1_by_definition(int code) {
  const int e = (code >> 1) & 3, m = code & 1;
  const double magnitude = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
  return (code & 8) ? -magnitude : magnitude;
}

TEST(Nvfp4, EveryCodeUnderEveryScaleByteDecodesToCodeTimesScaleTimesGlobal) {
  const float global = 0.0123f;
  std::vector<uint8_t> scale_bytes;
  for (int b = 0; b < 256; ++b)
    if ((b & 0x7F) != 0x7F) scale_bytes.push_back(uint8_t(b));  // not a NaN
  // One row per scale byte; its 16 columns are the 16 codes.
  const int64_t rows = int64_t(scale_bytes.size()), cols = 16;
  std::vector<uint8_t> codes(size_t(rows * cols / 2));
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 16; c += 2) codes[size_t(r * 8 + c / 2)] = uint8_t(c | ((c + 1) << 4));
  std::vector<float> out(size_t(rows * cols));
  dequantize_nvfp4({codes.data(), scale_bytes.data(), global, rows, cols}, out.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 16; ++c) {
      // (code * scale) is exact in fp32 (2 x 4 significant bits); times global rounds once.
      const float want =
          float(e2m1_by_definition(c) * double(fp8_e4m3_to_f32(scale_bytes[size_t(r)]))) * global;
      EXPECT_EQ(out[size_t(r * cols + c)], want)
          << "code " << c << " scale byte " << int(scale_bytes[size_t(r)]);
    }
}

TEST(Nvfp4, DotAndLinearEqualFp32OnTheDequantizedWeightsOnEveryIsa) {
  std::mt19937 rng(29);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto scale_byte = [&] {
    for (;;) {
      const auto b = uint8_t(rng() & 0x7F);  // positive, as the recipe writes them
      if (b != 0x7F) return b;
    }
  };
  int checked = 0;
  for (int64_t cols : {16, 32, 48, 64, 80, 272, 1024}) {
    const int64_t rows = 7;
    std::vector<uint8_t> codes(size_t(rows * cols / 2)), scales(size_t(rows * cols / 16));
    for (uint8_t& c : codes) c = uint8_t(rng());
    for (uint8_t& s : scales) s = scale_byte();
    const Nvfp4Weights w{codes.data(), scales.data(), 0.037f, rows, cols};
    std::vector<float> wide(static_cast<size_t>(rows * cols)), a(static_cast<size_t>(cols));
    dequantize_nvfp4(w, wide.data());
    for (float& v : a) v = normal(rng);
    for (QuantIsa isa : available_isas())
      for (int64_t r = 0; r < rows; ++r) {
        EXPECT_EQ(dot_nvfp4(isa, a.data(), w, r),
                  dot_f32(isa, a.data(), wide.data() + r * cols, cols))
            << quant_isa_name(isa) << " cols " << cols << " row " << r;
        ++checked;
      }
    EXPECT_EQ(dot_nvfp4_scalar(a.data(), w, 0), dot_f32_scalar(a.data(), wide.data(), cols));
    for (int64_t n : {1, 3, 8}) {
      std::vector<float> x(size_t(n * cols)), y(size_t(n * rows)), want(y.size());
      for (float& v : x) v = normal(rng);
      linear_nvfp4(x.data(), n, w, y.data());
      linear_f32(x.data(), n, wide.data(), rows, cols, want.data());
      EXPECT_EQ(y, want) << "cols " << cols << " n " << n;
      for (QuantIsa isa : available_isas()) {  // on an explicit ISA: its dot a row
        linear_nvfp4(isa, x.data(), n, w, y.data());
        for (int64_t t = 0; t < n; ++t)
          for (int64_t r = 0; r < rows; ++r)
            EXPECT_EQ(y[size_t(t * rows + r)], dot_nvfp4(isa, x.data() + t * cols, w, r));
      }
    }
  }
  EXPECT_GE(checked, 49);
  const Nvfp4Weights odd{nullptr, nullptr, 1.0f, 1, 24};
  EXPECT_THROW(dot_nvfp4_scalar(nullptr, odd, 0), std::invalid_argument);
  std::vector<float> y(1);
  EXPECT_THROW(linear_nvfp4(nullptr, 1, odd, y.data()), std::invalid_argument);
}

TEST(Nvfp4, RoundingIsToNearestWithTiesToEven) {
  EXPECT_EQ(f32_to_e2m1(0.25f), 0);      // tie between 0 and 0.5: 0 (even)
  EXPECT_EQ(f32_to_e2m1(0.75f), 2);      // tie between 0.5 and 1: 1 (even)
  EXPECT_EQ(f32_to_e2m1(1.25f), 2);      // tie between 1 and 1.5: 1
  EXPECT_EQ(f32_to_e2m1(2.5f), 4);       // tie between 2 and 3: 2
  EXPECT_EQ(f32_to_e2m1(5.0f), 6);       // tie between 4 and 6: 4
  EXPECT_EQ(f32_to_e2m1(5.01f), 7);      // 6
  EXPECT_EQ(f32_to_e2m1(100.0f), 7);     // saturates at 6
  EXPECT_EQ(f32_to_e2m1(-1.4f), 8 | 3);  // -1.5
  EXPECT_EQ(f32_to_e2m1(-0.1f), 8);      // to -0, as ModelOpt codes it
  EXPECT_EQ(f32_to_e2m1(-0.0f), 0);      // not negative
  for (int b = 0; b < 127; ++b)
    EXPECT_EQ(f32_to_e4m3(fp8_e4m3_to_f32(uint8_t(b))), b) << "an E4M3 value is its own byte";
  EXPECT_EQ(f32_to_e4m3(1000.0f), 0x7E);  // saturates at 448
  // Halfway between 1 (0x38) and 1.125 (0x39): the even byte.
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3A);
}

TEST(Nvfp4, TheRecipesErrorIsWithinHalfAStepOfEachBlock) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const int64_t rows = 33, cols = 96;
  std::vector<float> w(size_t(rows * cols)), back(w.size());
  for (float& v : w) v = normal(rng);
  for (int64_t c = 0; c < 16; ++c) w[size_t(5 * cols + c)] = 0.0f;  // a zero block
  std::vector<uint8_t> codes(size_t(rows * cols / 2)), scales(size_t(rows * cols / 16));
  const float global = quantize_nvfp4(w.data(), rows, cols, codes.data(), scales.data());
  float amax = 0;
  for (float v : w) amax = std::max(amax, std::abs(v));
  EXPECT_EQ(global, amax / (6.0f * 448.0f));
  dequantize_nvfp4({codes.data(), scales.data(), global, rows, cols}, back.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 16; ++b) {
      const float step = fp8_e4m3_to_f32(scales[size_t(r * cols / 16 + b)]) * global;
      for (int64_t k = 0; k < 16; ++k) {
        const size_t i = size_t(r * cols + b * 16 + k);
        // Half the widest gap between E2M1 values (2, at 4..6) times the step, and the scale's
        // own rounding (at most 1/16 relative) on the largest values.
        EXPECT_LE(std::abs(back[i] - w[i]), step * 1.0f + std::abs(w[i]) * 0.07f)
            << "row " << r << " column " << b * 16 + k;
      }
    }
  for (int64_t c = 0; c < 16; ++c) EXPECT_EQ(back[size_t(5 * cols + c)], 0.0f);
  EXPECT_EQ(scales[size_t(5 * cols / 16)], 0x38);  // ModelOpt: a zero block's scale is 1.0
  // Each block's scale byte is ModelOpt's: amax / (6 * global), one rounding of the division.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 16; ++b) {
      float block_amax = 0;
      for (int64_t k = 0; k < 16; ++k)
        block_amax = std::max(block_amax, std::abs(w[size_t(r * cols + b * 16 + k)]));
      if (block_amax == 0) continue;
      EXPECT_EQ(scales[size_t(r * cols / 16 + b)], f32_to_e4m3(block_amax / (6.0f * global)))
          << "row " << r << " block " << b;
    }
}

// Every int8-activation kernel in turn; skipped with the reason where this CPU or build lacks it.
class Nvfp4Int8 : public testing::TestWithParam<KernelCase> {
 protected:
  void SetUp() override {
    const KernelCase k = GetParam();
    if (!quant_isa_available(k.isa))
      GTEST_SKIP() << "this CPU or build lacks " << quant_isa_name(k.isa)
                   << " (avx2: AVX2 + FMA; avx512: AVX-512 F, BW, VL + FMA)";
    if (k.vnni && !cpu_has_avx512vnni()) GTEST_SKIP() << "this CPU lacks AVX-512 VNNI";
    saved_vnni_ = vnni_enabled() || !vnni_available();
    set_vnni(k.vnni);
    ASSERT_EQ(nvfp4_int8_vnni(k.isa), k.vnni) << "the case does not run the kernel it names";
  }
  void TearDown() override { set_vnni(saved_vnni_); }

  // The product on this kernel against the scalar reference, bit for bit, for the rows of x as
  // one batch and one at a time.
  void expect_reference(const Nvfp4Weights& w, const std::vector<float>& x, int64_t n,
                        const std::string& what) {
    const QuantIsa isa = GetParam().isa;
    std::vector<float> want(size_t(n * w.rows)), got(want.size(), std::nanf("")),
        one(size_t(w.rows));
    linear_nvfp4_int8(QuantIsa::kScalar, x.data(), n, w, want.data());
    double sum_abs = 0;
    for (float v : want) sum_abs += std::abs(v);
    EXPECT_GT(sum_abs, 0.0) << what << ": all-zero output proves nothing";
    linear_nvfp4_int8(isa, x.data(), n, w, got.data());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], want[i]) << what << " n " << n << " y[" << i / size_t(w.rows) << ", "
                                 << i % size_t(w.rows) << "]";
    for (int64_t t = 0; t < n; ++t) {  // one row alone: the same bits
      linear_nvfp4_int8(isa, x.data() + t * w.cols, 1, w, one.data());
      for (int64_t r = 0; r < w.rows; ++r)
        ASSERT_EQ(one[size_t(r)], want[size_t(t * w.rows + r)]) << what << " row " << t << " alone";
    }
  }

 private:
  bool saved_vnni_ = true;
};

TEST_P(Nvfp4Int8, IsTheReferenceOnEveryCodeUnderEveryScaleByte) {
  // Row r: block b's scale is the (r + b)-th non-NaN byte and column c's code is (c + r) % 16,
  // so that every byte (both signs, subnormals, 448) meets every code in every position of a
  // super-step of 16 blocks and in the padded last one (17 blocks).
  std::vector<uint8_t> bytes;
  for (int b = 0; b < 256; ++b)
    if ((b & 0x7F) != 0x7F) bytes.push_back(uint8_t(b));
  const int64_t rows = int64_t(bytes.size()), cols = 272, blocks = cols / 16;
  std::vector<uint8_t> codes(size_t(rows * cols / 2)), scales(size_t(rows * blocks));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 2)
      codes[size_t(r * cols / 2 + c / 2)] = uint8_t(((c + r) % 16) | (((c + 1 + r) % 16) << 4));
    for (int64_t b = 0; b < blocks; ++b)
      scales[size_t(r * blocks + b)] = bytes[size_t((r + b) % rows)];
  }
  const Nvfp4Weights w{codes.data(), scales.data(), 0.0173f, rows, cols};
  for (int64_t n : {1, 3, 8, 11})
    expect_reference(w, test::normal(n * cols, uint32_t(n)), n, "every byte");
}

// Odd shapes, rows and batches; and the bound of linear.h against the exact product of x with the
// weights (e2m1 * e4m3 * global in double).
TEST_P(Nvfp4Int8, OddShapesEqualTheReferenceAndStayWithinTheBound) {
  std::mt19937 rng(41);
  int checked = 0;
  for (int64_t cols : {16, 48, 240, 256, 272, 528, 1040, 2048, 2064})
    for (int64_t rows : {1, 7, 33}) {
      std::vector<uint8_t> codes(size_t(rows * cols / 2)), scales(size_t(rows * cols / 16));
      for (uint8_t& c : codes) c = uint8_t(rng());
      for (uint8_t& s : scales) s = uint8_t(0x20 + rng() % 0x40);  // 2^-3 .. 2^4, positive
      const Nvfp4Weights w{codes.data(), scales.data(), 0.0021f, rows, cols};
      std::vector<float> wide(size_t(rows * cols));
      dequantize_nvfp4(w, wide.data());
      for (int64_t n : {1, 2, 5, 9, 17}) {
        std::vector<float> x = test::normal(n * cols, uint32_t(cols * 7 + rows * 3 + n));
        x[0] = 40.0f;  // an outlier: its block's step is coarse
        const std::string what = std::to_string(rows) + "x" + std::to_string(cols);
        expect_reference(w, x, n, what);
        std::vector<float> y(size_t(n * rows));
        linear_nvfp4_int8(GetParam().isa, x.data(), n, w, y.data());
        const double u = std::ldexp(1.0, -24);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t r = 0; r < rows; ++r) {
            double exact = 0, rounding = 0, products = 0;
            for (int64_t c = 0; c < cols; ++c) {
              const float* block = x.data() + t * cols + c / 64 * 64;
              float amax = 0;
              for (int64_t k = 0; k < std::min<int64_t>(64, cols - c / 64 * 64); ++k)
                amax = std::max(amax, std::abs(block[k]));
              const double wc = wide[size_t(r * cols + c)], xc = x[size_t(t * cols + c)];
              exact += wc * xc;
              rounding += std::abs(wc) * amax / 254.0;
              products += std::abs(wc) * (std::abs(xc) + amax / 254.0);
            }
            // Each input within amax / 254; the fp32 sums (cols / 256 fma a partial sum, 4 levels
            // of the tree, the scale product, the weights' own rounding), twice for slack.
            const double bound =
                rounding * (1 + 1e-6) + 2 * (double(cols) / 256 + 8) * u * products;
            ASSERT_LE(std::abs(y[size_t(t * rows + r)] - exact), bound)
                << what << " n " << n << " y[" << t << ", " << r << "]";
            ++checked;
          }
      }
    }
  EXPECT_GT(checked, 1000);
}

TEST_P(Nvfp4Int8, NonFiniteInputsGiveNan) {
  const int64_t rows = 3, cols = 64;
  std::vector<uint8_t> codes(size_t(rows * cols / 2), 0x21), scales(size_t(rows * cols / 16), 0x38);
  const Nvfp4Weights w{codes.data(), scales.data(), 1.0f, rows, cols};
  std::vector<float> x(size_t(cols), 1.0f), y(static_cast<size_t>(rows));
  x[5] = std::numeric_limits<float>::infinity();
  linear_nvfp4_int8(GetParam().isa, x.data(), 1, w, y.data());
  for (float v : y) EXPECT_TRUE(std::isnan(v));
}

INSTANTIATE_TEST_SUITE_P(Kernels, Nvfp4Int8,
                         testing::Values(KernelCase{QuantIsa::kScalar, false},
                                         KernelCase{QuantIsa::kAvx2, false},
                                         KernelCase{QuantIsa::kAvx512, false},
                                         KernelCase{QuantIsa::kAvx512, true}),
                         [](const testing::TestParamInfo<KernelCase>& kernel_info) {
                           return std::string(quant_isa_name(kernel_info.param.isa)) +
                                  (kernel_info.param.vnni ? "_vnni" : "");
                         });

TEST(Nvfp4Int8Selection, BadShapesAreRefused) {
  std::vector<uint8_t> codes(16), scales(2);
  const Nvfp4Weights odd{codes.data(), scales.data(), 1.0f, 1, 24};
  std::vector<float> x(24), y(1);
  EXPECT_THROW(linear_nvfp4_int8(x.data(), 1, odd, y.data()), std::invalid_argument);
  EXPECT_THROW(linear_nvfp4_int8(QuantIsa::kScalar, x.data(), 1, odd, y.data()),
               std::invalid_argument);
}

TEST(Nvfp4Int8Selection, TheSelectedProductFollowsTheActivationsSwitch) {
  const int64_t rows = 9, cols = 320;
  std::mt19937 rng(3);
  std::vector<uint8_t> codes(size_t(rows * cols / 2)), scales(size_t(rows * cols / 16));
  for (uint8_t& c : codes) c = uint8_t(rng());
  for (uint8_t& s : scales) s = uint8_t(0x30 + rng() % 16);
  const Nvfp4Weights w{codes.data(), scales.data(), 0.01f, rows, cols};
  const std::vector<float> x = test::normal(2 * cols, 8);
  std::vector<float> f32(size_t(2 * rows)), int8(f32.size()), got(f32.size());
  linear_nvfp4(x.data(), 2, w, f32.data());
  linear_nvfp4_int8(x.data(), 2, w, int8.data());
  ASSERT_NE(f32, int8) << "the two precisions should differ on random data";
  const QuantActivations saved = quant_activations_selected();
  for (QuantActivations a :
       {QuantActivations::kF32, QuantActivations::kInt8, QuantActivations::kMixed}) {
    set_quant_activations(a);
    EXPECT_EQ(nvfp4_int8_activations(), a != QuantActivations::kF32);
    linear_nvfp4_selected(x.data(), 2, w, got.data());
    EXPECT_EQ(got, a == QuantActivations::kF32 ? f32 : int8) << quant_activations_name(a);
  }
  set_quant_activations(saved);
}

}  // namespace
}  // namespace colibri::kernels
