// Quantized CPU kernels: the int4/int8 container (packing, quantisation rule, decoding), every
// ISA's quant_linear against the scalar reference and an exact double reference, and the routed
// expert FFN against fp32 on the dequantized weights.
//
// Error bounds. The exact value of y[t, o] is sum_i W[o, i] x[t, i] (computed here in double from
// the container definition, independently of the kernels). A kernel sums the same terms in some
// order in fp32; every term passes through at most cols + 16 roundings (product, lane chain, group
// scale, running sums, lane reduction, tail, row scale), so whatever the order or FMA use,
//   |y - y_exact| <= gamma(cols + 16) * (|W| |x|)[t, o],   gamma(k) = k u / (1 - k u), u = 2^-24,
// and two kernels differ by at most twice that. BF16 pairs (one row on AVX-512 with BF16) carry
// each input within 2^-18 |x| and add 2^-18 (|W| |x|) to both. With integer activations (exact in
// BF16) and power-of-two scales every partial sum is exactly representable, so there the kernels
// must agree bit for bit.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/elementwise.h"
#include "cpu/linear.h"
#include "cpu/quant.h"
#include "quant_fixtures.h"

namespace colibri::kernels {
namespace {

using test::available_isas;
using test::FormatCase;
using test::normal;

// ---- fixtures ---------------------------------------------------------------------------------

// g16 and g48 take the AVX-512 kernel's 16-input blocks; the others its 32-input blocks.
const FormatCase kFormats[] = {
    {"int4-row", QuantFormat::kInt4Row, 0},      {"int4-g64", QuantFormat::kInt4Grouped, 64},
    {"int4-g32", QuantFormat::kInt4Grouped, 32}, {"int4-g16", QuantFormat::kInt4Grouped, 16},
    {"int4-g48", QuantFormat::kInt4Grouped, 48}, {"int8-row", QuantFormat::kInt8Row, 0},
};

struct Shape {
  int64_t rows, cols;
};

// GLM-5.2's expert projections (2048x6144 gate/up, 6144x2048 down) scaled down, and odd shapes
// whose cols are not multiples of any block or group (tails, a padding nibble).
const Shape kShapes[] = {{128, 384}, {384, 128}, {37, 70}, {5, 130}, {3, 1}, {2, 17}};

const int64_t kBatches[] = {1, 3, 8, 11, 64};

// An ISA's kernels, with or without BF16 pairs (quant.h) for one activation row.
struct Kernels {
  QuantIsa isa;
  bool bf16_pairs;
  std::string name() const {
    return std::string(quant_isa_name(isa)) + (bf16_pairs ? "+bf16-pairs" : "");
  }
};

// Every ISA without BF16 pairs, and AVX-512 with them where the CPU has AVX512_BF16.
std::vector<Kernels> available_kernels() {
  std::vector<Kernels> kernels;
  for (QuantIsa isa : available_isas()) kernels.push_back({isa, false});
  if (bf16_pairs_available()) kernels.push_back({QuantIsa::kAvx512, true});
  return kernels;
}

// Selects k's BF16 pairs setting for its lifetime.
class UseKernels {
 public:
  explicit UseKernels(const Kernels& k) : saved_(bf16_pairs_enabled()) {
    set_bf16_pairs(k.bf16_pairs);
  }
  ~UseKernels() { set_bf16_pairs(saved_); }

 private:
  bool saved_;
};

// Whether a product of n rows with w runs on BF16 pairs: hi + lo is within 2^-18 |x| of each
// input, which adds 2^-18 (|W| |x|) to the bound below.
double pairs_error(const Kernels& k, QuantFormat format, int group_size, int64_t n) {
  const bool taken = k.bf16_pairs && n == 1 &&
                     (format == QuantFormat::kInt4Row ||
                      (format == QuantFormat::kInt4Grouped && group_size % 64 == 0));
  return taken ? std::ldexp(1.0, -18) : 0.0;
}

// An owned quantized matrix.
struct QuantMatrix {
  QuantFormat format;
  int64_t rows, cols;
  int group_size;
  std::vector<uint8_t> data;
  std::vector<float> scales;

  QuantMatrix(QuantFormat f, int gs, int64_t r, int64_t c)
      : format(f),
        rows(r),
        cols(c),
        group_size(f == QuantFormat::kInt4Grouped ? gs : 0),
        data(size_t(packed_bytes(f, r, c))),
        scales(size_t(scale_count(f, r, c, group_size))) {}
  QuantMatrixView view() const {
    return {format, rows, cols, group_size, data.data(), scales.data()};
  }
  int64_t groups_per_row() const { return scales.size() / std::max<int64_t>(rows, 1); }
};

QuantMatrix quantized_normal(const FormatCase& fc, Shape s, uint32_t seed) {
  QuantMatrix m(fc.format, fc.group_size, s.rows, s.cols);
  const std::vector<float> w = normal(s.rows * s.cols, seed, 0.05f);
  quantize(fc.format, fc.group_size, w.data(), s.rows, s.cols, m.data.data(), m.scales.data());
  return m;
}

// Random codes (every nibble 0..15, including -8; int8 in [-127, 127]) and power-of-two scales
// 2^[-2, 2]: with integer activations in [-2, 2] every sum below is exact in fp32.
QuantMatrix exact_random(const FormatCase& fc, Shape s, uint32_t seed) {
  QuantMatrix m(fc.format, fc.group_size, s.rows, s.cols);
  std::mt19937 rng(seed);
  for (uint8_t& b : m.data)
    b = fc.format == QuantFormat::kInt8Row ? uint8_t(int8_t(int(rng() % 255) - 127))
                                           : uint8_t(rng() & 0xFF);
  for (float& sc : m.scales) sc = std::ldexp(1.0f, int(rng() % 5) - 2);
  return m;
}

std::vector<float> small_integers(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& e : v) e = float(int(rng() % 5) - 2);
  return v;
}

// W[o, i] straight from the container definition (not from the library's dequantize).
double weight_at(const QuantMatrix& m, int64_t o, int64_t i) {
  if (m.format == QuantFormat::kInt8Row)
    return double(int8_t(m.data[o * m.cols + i])) * m.scales[o];
  const uint8_t byte = m.data[o * ((m.cols + 1) / 2) + i / 2];
  const int q = int(i % 2 == 0 ? byte & 0x0F : byte >> 4) - 8;
  const double s = m.format == QuantFormat::kInt4Row
                       ? m.scales[o]
                       : m.scales[o * m.groups_per_row() + i / m.group_size];
  return q * s;
}

// Exact y [n, rows] in double and the bound scale (|W| |x|) [n, rows].
void exact_linear(const QuantMatrix& m, const std::vector<float>& x, int64_t n,
                  std::vector<double>& y, std::vector<double>& abs_sum) {
  y.assign(size_t(n * m.rows), 0.0);
  abs_sum.assign(size_t(n * m.rows), 0.0);
  for (int64_t o = 0; o < m.rows; ++o)
    for (int64_t i = 0; i < m.cols; ++i) {
      const double wv = weight_at(m, o, i);
      for (int64_t t = 0; t < n; ++t) {
        y[t * m.rows + o] += wv * x[t * m.cols + i];
        abs_sum[t * m.rows + o] += std::fabs(wv * x[t * m.cols + i]);
      }
    }
}

double gamma_bound(int64_t k) {
  const double u = std::ldexp(1.0, -24);
  return double(k) * u / (1.0 - double(k) * u);
}

std::vector<float> run_linear(QuantIsa isa, const QuantMatrix& m, const std::vector<float>& x,
                              int64_t n) {
  std::vector<float> y(size_t(n * m.rows), std::nanf(""));
  quant_linear(isa, m.view(), x.data(), n, y.data());
  return y;
}

std::vector<float> run_linear(const Kernels& k, const QuantMatrix& m, const std::vector<float>& x,
                              int64_t n) {
  const UseKernels use(k);
  return run_linear(k.isa, m, x, n);
}

// Not vacuous: at least half of the reference outputs are non-zero.
void expect_mostly_nonzero(const std::vector<double>& ref) {
  size_t nonzero = 0;
  for (double v : ref) nonzero += v != 0.0;
  EXPECT_GE(2 * nonzero, ref.size()) << "reference is mostly zero: the comparison proves little";
}

// ---- container ----------------------------------------------------------------------------------

TEST(QuantFormat, SizesFollowTheContainer) {
  EXPECT_EQ(row_bytes(QuantFormat::kInt4Row, 7), 4);
  EXPECT_EQ(packed_bytes(QuantFormat::kInt4Grouped, 2048, 6144), 2048 * 3072);
  EXPECT_EQ(packed_bytes(QuantFormat::kInt8Row, 3, 5), 15);
  EXPECT_EQ(scale_count(QuantFormat::kInt4Grouped, 2048, 6144, 64), 2048 * 96);
  EXPECT_EQ(scale_count(QuantFormat::kInt4Grouped, 4, 70, 64), 8);  // last group short
  EXPECT_EQ(scale_count(QuantFormat::kInt4Row, 4, 70, 0), 4);
  for (int gs : {16, 32, 48, 64, 96, 128, 192, 256}) EXPECT_TRUE(is_valid_group_size(gs));
  for (int gs : {0, 8, 24, 40, 512}) EXPECT_FALSE(is_valid_group_size(gs));
}

TEST(QuantFormat, PacksEvenLowOddHighWithRoundHalfEven) {
  // amax 7 -> scale 1; rint: 2.5 -> 2, -2.5 -> -2, 3.5 -> 4; stored q + 8; pad nibble 8.
  const float w4[] = {7.0f, -7.0f, 2.5f, -2.5f, 3.5f};
  uint8_t d4[3];
  float s4;
  quantize(QuantFormat::kInt4Row, 0, w4, 1, 5, d4, &s4);
  EXPECT_EQ(s4, 1.0f);
  EXPECT_EQ(d4[0], 0x1F);  // 15 | 1 << 4
  EXPECT_EQ(d4[1], 0x6A);  // 10 | 6 << 4
  EXPECT_EQ(d4[2], 0x8C);  // 12 | pad 8 << 4

  const float w8[] = {127.0f, -127.0f, 2.5f, -0.5f, 1.0f};
  uint8_t d8[5];
  float s8;
  quantize(QuantFormat::kInt8Row, 0, w8, 1, 5, d8, &s8);
  EXPECT_EQ(s8, 1.0f);
  const uint8_t want8[] = {0x7F, 0x81, 0x02, 0x00, 0x01};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(d8[i], want8[i]) << i;

  // Grouped: a scale per group of 16, the last one short; an all-zero group gets 1e-8 and code 8.
  std::vector<float> wg(40, 0.0f);
  wg[0] = 7.0f;     // group 0: scale 1
  wg[17] = -14.0f;  // group 1: scale 2, q = -7 at an odd index -> high nibble 1
  std::vector<uint8_t> dg(20);
  std::vector<float> sg(3);
  quantize(QuantFormat::kInt4Grouped, 16, wg.data(), 1, 40, dg.data(), sg.data());
  EXPECT_EQ(sg[0], 1.0f);
  EXPECT_EQ(sg[1], 2.0f);
  EXPECT_EQ(sg[2], 1e-8f);
  EXPECT_EQ(dg[0], 0x8F);
  EXPECT_EQ(dg[8], 0x18);
  EXPECT_EQ(dg[19], 0x88);
}

TEST(QuantFormat, RoundTripWithinHalfAScale) {
  for (const FormatCase& fc : kFormats)
    for (Shape s : kShapes) {
      SCOPED_TRACE(std::string(fc.name) + " " + std::to_string(s.rows) + "x" +
                   std::to_string(s.cols));
      const std::vector<float> w = normal(s.rows * s.cols, 7, 0.05f);
      QuantMatrix m(fc.format, fc.group_size, s.rows, s.cols);
      quantize(fc.format, fc.group_size, w.data(), s.rows, s.cols, m.data.data(), m.scales.data());
      std::vector<float> back(w.size());
      dequantize(m.view(), back.data());
      const float qmax = fc.format == QuantFormat::kInt8Row ? 127.0f : 7.0f;
      const int64_t span = fc.group_size > 0 ? fc.group_size : s.cols;
      for (int64_t o = 0; o < s.rows; ++o)
        for (int64_t i = 0; i < s.cols; ++i) {
          const int64_t g = i / span;
          float amax = 0.0f;
          for (int64_t k = g * span; k < std::min(s.cols, (g + 1) * span); ++k)
            amax = std::max(amax, std::fabs(w[o * s.cols + k]));
          const float scale = std::max(amax / qmax, 1e-8f);
          ASSERT_EQ(fc.group_size > 0 ? m.scales[o * m.groups_per_row() + g] : m.scales[o], scale);
          // Half a step, plus the rounding of w / s and of q * s (a few ulp of |w|).
          ASSERT_LE(std::fabs(back[o * s.cols + i] - w[o * s.cols + i]),
                    0.5f * scale + 4e-7f * std::fabs(w[o * s.cols + i]))
              << "row " << o << " col " << i;
          ASSERT_EQ(back[o * s.cols + i], float(weight_at(m, o, i)));  // f32 (q - 8) * s
        }
    }
}

TEST(QuantFormat, RefusesInconsistentViews) {
  const uint8_t byte = 0x88;
  const float scale = 1.0f;
  EXPECT_THROW(check_view({QuantFormat::kInt4Grouped, 1, 2, 24, &byte, &scale}),
               std::invalid_argument);
  EXPECT_THROW(check_view({QuantFormat::kInt4Grouped, 1, 2, 0, &byte, &scale}),
               std::invalid_argument);
  EXPECT_THROW(check_view({QuantFormat::kInt4Row, 1, 2, 64, &byte, &scale}), std::invalid_argument);
  EXPECT_THROW(check_view({QuantFormat::kInt8Row, 1, 1, 0, nullptr, &scale}),
               std::invalid_argument);
  EXPECT_THROW(check_view({QuantFormat::kInt8Row, -1, 1, 0, &byte, &scale}), std::invalid_argument);
  EXPECT_NO_THROW(check_view({QuantFormat::kInt4Grouped, 1, 2, 16, &byte, &scale}));
  const float nan_weight[] = {1.0f, std::nanf("")};
  uint8_t out;
  float out_scale;
  EXPECT_THROW(quantize(QuantFormat::kInt4Row, 0, nan_weight, 1, 2, &out, &out_scale),
               std::invalid_argument);
}

// ---- ISA selection ----------------------------------------------------------------------------

TEST(QuantIsa, ResolvesTheCap) {
  const QuantIsa best = quant_isa_resolve(nullptr);
  EXPECT_TRUE(quant_isa_available(best));
  EXPECT_EQ(quant_isa_resolve(""), best);
  EXPECT_EQ(quant_isa_resolve("scalar"), QuantIsa::kScalar);
  for (QuantIsa isa : available_isas()) EXPECT_EQ(quant_isa_resolve(quant_isa_name(isa)), isa);
  EXPECT_THROW(quant_isa_resolve("sse9"), std::invalid_argument);
  EXPECT_TRUE(quant_isa_available(quant_isa_selected()));
  EXPECT_STREQ(quant_isa(), quant_isa_name(quant_isa_selected()));
  std::printf("ISAs available: ");
  for (QuantIsa isa : available_isas()) std::printf("%s ", quant_isa_name(isa));
  std::printf("(dispatched: %s)\n", quant_isa());
}

// ---- quant_linear ------------------------------------------------------------------------------

// The reference against fp32 linear_f32 on the dequantized matrix: bit for bit on exactly
// representable data, within 2 gamma(cols + 16) (|W||x|) on random data.
TEST(QuantLinear, ScalarMatchesLinearF32OnDequantized) {
  for (const FormatCase& fc : kFormats)
    for (Shape s : kShapes)
      for (int64_t n : {int64_t(1), int64_t(8)}) {
        SCOPED_TRACE(std::string(fc.name) + " " + std::to_string(s.rows) + "x" +
                     std::to_string(s.cols) + " n=" + std::to_string(n));
        for (bool exact : {true, false}) {
          const QuantMatrix m = exact ? exact_random(fc, s, 11) : quantized_normal(fc, s, 11);
          const std::vector<float> x =
              exact ? small_integers(n * s.cols, 12) : normal(n * s.cols, 12);
          std::vector<float> dense(size_t(s.rows * s.cols));
          dequantize(m.view(), dense.data());
          std::vector<float> y_f32(size_t(n * s.rows));
          linear_f32(x.data(), n, dense.data(), s.rows, s.cols, y_f32.data());
          const std::vector<float> y = run_linear(QuantIsa::kScalar, m, x, n);
          std::vector<double> ref, abs_sum;
          exact_linear(m, x, n, ref, abs_sum);
          expect_mostly_nonzero(ref);
          for (size_t k = 0; k < y.size(); ++k) {
            if (exact) {
              ASSERT_EQ(y[k], y_f32[k]) << k;
              ASSERT_EQ(double(y[k]), ref[k]) << k;
            } else {
              ASSERT_LE(std::fabs(y[k] - y_f32[k]), 2 * gamma_bound(s.cols + 16) * abs_sum[k]) << k;
            }
          }
        }
      }
}

TEST(QuantLinear, EveryIsaMatchesTheScalarReference) {
  for (const Kernels& k : available_kernels())
    for (const FormatCase& fc : kFormats)
      for (Shape s : kShapes)
        for (int64_t n : kBatches) {
          SCOPED_TRACE(k.name() + " " + fc.name + " " + std::to_string(s.rows) + "x" +
                       std::to_string(s.cols) + " n=" + std::to_string(n));
          // Exact data: bit for bit.
          {
            const QuantMatrix m = exact_random(fc, s, 21);
            const std::vector<float> x = small_integers(n * s.cols, 22);
            const std::vector<float> y = run_linear(k, m, x, n);
            const std::vector<float> y_ref = run_linear(QuantIsa::kScalar, m, x, n);
            for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], y_ref[i]) << i;
          }
          // Random data: |y - y_ref| <= (2 gamma(cols + 16) + pairs) (|W||x|).
          const QuantMatrix m = quantized_normal(fc, s, 23);
          const std::vector<float> x = normal(n * s.cols, 24);
          const std::vector<float> y = run_linear(k, m, x, n);
          const std::vector<float> y_ref = run_linear(QuantIsa::kScalar, m, x, n);
          std::vector<double> exact, abs_sum;
          exact_linear(m, x, n, exact, abs_sum);
          expect_mostly_nonzero(exact);
          const double pairs = pairs_error(k, fc.format, fc.group_size, n);
          for (size_t i = 0; i < y.size(); ++i) {
            ASSERT_LE(std::fabs(y[i] - y_ref[i]),
                      (2 * gamma_bound(s.cols + 16) + pairs) * abs_sum[i])
                << i;
            ASSERT_LE(std::fabs(y[i] - exact[i]), (gamma_bound(s.cols + 16) + pairs) * abs_sum[i])
                << i;
          }
        }
}

TEST(QuantLinear, EveryGroupSize) {
  const Shape s{9, 1000};  // 1000: a short last group and a tail for every group size
  for (const Kernels& k : available_kernels())
    for (int gs : {16, 32, 48, 64, 96, 128, 192, 256})
      for (int64_t n : {int64_t(1), int64_t(5)}) {
        SCOPED_TRACE(k.name() + " g" + std::to_string(gs) + " n=" + std::to_string(n));
        const QuantMatrix m = exact_random({"g", QuantFormat::kInt4Grouped, gs}, s, 31);
        const std::vector<float> x = small_integers(n * s.cols, 32);
        const std::vector<float> y = run_linear(k, m, x, n);
        std::vector<double> ref, abs_sum;
        exact_linear(m, x, n, ref, abs_sum);
        expect_mostly_nonzero(ref);
        for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(double(y[i]), ref[i]) << i;
      }
}

// A kernel that drops the high nibble, swaps the nibbles, or reads one scale per row instead of
// one per group fails here: only odd (resp. even) inputs carry weight, and the group scales span
// 2^-2..2^2.
TEST(QuantLinear, ReadsBothNibblesAndEveryGroupScale) {
  const Shape s{16, 200};
  for (const Kernels& k : available_kernels())
    for (const FormatCase& fc : kFormats)
      for (int64_t n : {int64_t(1), int64_t(2)})
        for (int parity : {0, 1}) {
          if (fc.format == QuantFormat::kInt8Row) continue;
          SCOPED_TRACE(k.name() + " " + fc.name + " n=" + std::to_string(n) +
                       (parity ? " odd inputs only" : " even inputs only"));
          QuantMatrix m = exact_random(fc, s, 41 + parity);
          for (uint8_t& b : m.data)
            b = parity ? uint8_t((b & 0xF0) | 8) : uint8_t((b & 0x0F) | 0x80);
          const std::vector<float> x = small_integers(n * s.cols, 43);
          const std::vector<float> y = run_linear(k, m, x, n);
          std::vector<double> ref, abs_sum;
          exact_linear(m, x, n, ref, abs_sum);
          expect_mostly_nonzero(ref);
          for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(double(y[i]), ref[i]) << i;
          if (fc.format == QuantFormat::kInt4Grouped) {
            // Guard: with every group's scale replaced by the first, the answer would change.
            QuantMatrix first_scale = m;
            for (int64_t o = 0; o < s.rows; ++o)
              for (int64_t g = 0; g < m.groups_per_row(); ++g)
                first_scale.scales[o * m.groups_per_row() + g] = m.scales[o * m.groups_per_row()];
            std::vector<double> wrong, unused;
            exact_linear(first_scale, x, n, wrong, unused);
            EXPECT_NE(wrong, ref) << "the group scales do not matter for this data";
          }
        }
}

// The padding nibble of an odd-width row (written as 8) is never read.
TEST(QuantLinear, IgnoresThePaddingNibble) {
  for (const Kernels& k : available_kernels())
    for (const FormatCase& fc : kFormats) {
      if (fc.format == QuantFormat::kInt8Row) continue;
      for (Shape s : {Shape{7, 33}, Shape{5, 131}, Shape{3, 1}}) {
        SCOPED_TRACE(k.name() + " " + fc.name + " cols " + std::to_string(s.cols));
        QuantMatrix m = exact_random(fc, s, 51);
        const std::vector<float> x = small_integers(s.cols, 52);
        const std::vector<float> before = run_linear(k, m, x, 1);
        const int64_t rb = (s.cols + 1) / 2;
        for (int64_t o = 0; o < s.rows; ++o) m.data[o * rb + rb - 1] |= 0xF0;
        EXPECT_EQ(run_linear(k, m, x, 1), before);
      }
    }
}

TEST(QuantLinear, IndependentOfTheThreadCount) {
  const Shape s{301, 515};
  const FormatCase fc = kFormats[1];
  const QuantMatrix m = quantized_normal(fc, s, 61);
  const std::vector<float> x = normal(3 * s.cols, 62);
  const int threads = omp_get_max_threads();
  for (const Kernels& k : available_kernels())
    for (int64_t n : {int64_t(1), int64_t(3)}) {
      omp_set_num_threads(1);
      const std::vector<float> one = run_linear(k, m, x, n);
      omp_set_num_threads(std::max(2, threads));
      EXPECT_EQ(run_linear(k, m, x, n), one) << k.name() << " n=" << n;
    }
  omp_set_num_threads(threads);
}

TEST(QuantLinear, DispatchedEntryPointsAgree) {
  const Shape s{40, 96};
  const QuantMatrix m = quantized_normal(kFormats[1], s, 71);
  const std::vector<float> x = normal(2 * s.cols, 72);
  std::vector<float> dispatched(size_t(2 * s.rows)), scalar(size_t(2 * s.rows));
  const QuantActivations saved = quant_activations_selected();
  set_quant_activations(QuantActivations::kF32);  // int8 activations: quant_int8_test.cpp
  quant_linear(m.view(), x.data(), 2, dispatched.data());
  set_quant_activations(saved);
  quant_linear_scalar(m.view(), x.data(), 2, scalar.data());
  EXPECT_EQ(dispatched, run_linear(quant_isa_selected(), m, x, 2));
  EXPECT_EQ(scalar, run_linear(QuantIsa::kScalar, m, x, 2));
}

// ---- quant_expert_ffn -------------------------------------------------------------------------

// Against fp32 on the dequantized weights: gate = x Wg^T, up = x Wu^T, h = silu(gate) * up
// (silu_mul), y = h Wd^T (linear_f32). Bound, propagated in double from the linear bounds:
//   e_g, e_u = (2 gamma(hidden + 16) + p) (|W||x|)    (kernel vs fp32, gate and up)
//   e_h      = 1.1 e_g (|u| + e_u) + |silu(g)| e_u + 8 u |h|   (silu' <= 1.1; exp and divide)
//   e_y      = (1 + gamma(inter + 16)) |Wd| e_h + (2 gamma(inter + 16) + p) (|Wd| |h|)
// with p = 2^-18 where BF16 pairs carry the activations (pairs_error), else 0.
TEST(QuantExpertFfn, MatchesFp32OnDequantizedWeights) {
  const int64_t hidden = 200, inter = 136;  // tails: 200 % 32 = 8, 136 % 64 = 8
  for (const Kernels& k : available_kernels())
    for (const FormatCase& fc : kFormats)
      for (int64_t n : {int64_t(1), int64_t(3), int64_t(8)}) {
        SCOPED_TRACE(k.name() + " " + fc.name + " n=" + std::to_string(n));
        const UseKernels use(k);
        const double pairs = pairs_error(k, fc.format, fc.group_size, n);
        const QuantMatrix gate = quantized_normal(fc, {inter, hidden}, 81);
        const QuantMatrix up = quantized_normal(fc, {inter, hidden}, 82);
        const QuantMatrix down = quantized_normal(fc, {hidden, inter}, 83);
        const std::vector<float> x = normal(n * hidden, 84);
        std::vector<float> y(size_t(n * hidden), std::nanf(""));
        quant_expert_ffn(k.isa, gate.view(), up.view(), down.view(), x.data(), n, y.data());

        std::vector<float> wg(size_t(inter * hidden)), wu(wg.size()), wd(wg.size());
        dequantize(gate.view(), wg.data());
        dequantize(up.view(), wu.data());
        dequantize(down.view(), wd.data());
        std::vector<float> g(size_t(n * inter)), u(g.size()), y_ref(y.size());
        linear_f32(x.data(), n, wg.data(), inter, hidden, g.data());
        linear_f32(x.data(), n, wu.data(), inter, hidden, u.data());
        std::vector<float> h = g;
        silu_mul(h.data(), u.data(), n * inter);
        linear_f32(h.data(), n, wd.data(), hidden, inter, y_ref.data());

        std::vector<double> unused, abs_g, abs_u;
        exact_linear(gate, x, n, unused, abs_g);
        exact_linear(up, x, n, unused, abs_u);
        const double uround = std::ldexp(1.0, -24);
        std::vector<double> e_h(h.size());
        for (size_t j = 0; j < h.size(); ++j) {
          const double e_g = (2 * gamma_bound(hidden + 16) + pairs) * abs_g[j];
          const double e_u = (2 * gamma_bound(hidden + 16) + pairs) * abs_u[j];
          const double silu_g = std::fabs(g[j] / (1.0 + std::exp(-double(g[j]))));
          e_h[j] =
              1.1 * e_g * (std::fabs(u[j]) + e_u) + silu_g * e_u + 8 * uround * std::fabs(h[j]);
        }
        size_t nonzero = 0;
        for (int64_t t = 0; t < n; ++t)
          for (int64_t o = 0; o < hidden; ++o) {
            double prop = 0, abs_dh = 0;
            for (int64_t i = 0; i < inter; ++i) {
              const double wv = std::fabs(wd[o * inter + i]);
              prop += wv * e_h[t * inter + i];
              abs_dh += wv * std::fabs(h[t * inter + i]);
            }
            const double bound = (1 + gamma_bound(inter + 16)) * prop +
                                 (2 * gamma_bound(inter + 16) + pairs) * abs_dh;
            const size_t at = size_t(t * hidden + o);
            ASSERT_LE(std::fabs(double(y[at]) - y_ref[at]), bound) << "t " << t << " o " << o;
            nonzero += y_ref[at] != 0.0f;
          }
        EXPECT_EQ(nonzero, y.size());
      }
}

TEST(QuantExpertFfn, RefusesMismatchedShapes) {
  const FormatCase fc = kFormats[1];
  const QuantMatrix gate = quantized_normal(fc, {64, 128}, 1);
  const QuantMatrix down_wrong = quantized_normal(fc, {128, 32}, 2);
  std::vector<float> x(128), y(128);
  EXPECT_THROW(quant_expert_ffn(gate.view(), gate.view(), down_wrong.view(), x.data(), 1, y.data()),
               std::invalid_argument);
}

}  // namespace
}  // namespace colibri::kernels
