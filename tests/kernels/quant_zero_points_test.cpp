// Zero points of int4 matrices (quant.h): add_zero_point_terms against its scalar reference on
// every shape class, and every kernel that takes a matrix with offsets (quant_linear with fp32 and
// int8 activations, the expert FFNs, dequantize) against the symmetric product plus those terms.
//
// Bound of add_zero_point_terms against the reference (which sums in double): the group sums and
// the dot product over groups pass each term through at most group_size + groups + 1 roundings,
//   |y - y_ref| <= gamma(group_size + groups + 1) * sum_i |offset[o, g(i)]| |x[t, i]| + 2u |y|
// (the last rounding of the addition to y, and the reference's rounding to fp32).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpu/quant.h"
#include "quant_fixtures.h"

namespace colibri::kernels {
namespace {

using test::available_isas;
using test::FormatCase;
using test::normal;

// An int4 matrix with zero points: normal weights quantized by the container's rule, and offsets
// -zp * s for zero points zp drawn from [-8, 7], one per (row, group) as an asymmetric checkpoint
// holds them.
struct AsymMatrix {
  QuantFormat format;
  int64_t rows, cols;
  int group_size;
  std::vector<uint8_t> data;
  std::vector<float> scales, offsets;
  QuantMatrixView view(bool with_offsets = true) const {
    return {format,
            rows,
            cols,
            group_size,
            data.data(),
            scales.data(),
            QuantLayout::kRows,
            with_offsets ? offsets.data() : nullptr};
  }
};

AsymMatrix asym_matrix(const FormatCase& fc, int64_t rows, int64_t cols, uint32_t seed) {
  AsymMatrix m{fc.format, rows, cols, fc.group_size, {}, {}, {}};
  const std::vector<float> w = normal(rows * cols, seed, 0.05f);
  m.data.resize(size_t(packed_bytes(fc.format, rows, cols)));
  m.scales.resize(size_t(scale_count(fc.format, rows, cols, fc.group_size)));
  quantize(fc.format, fc.group_size, w.data(), rows, cols, m.data.data(), m.scales.data());
  const int64_t groups = offset_groups(m.view(false));
  std::mt19937 rng(seed + 1);
  std::uniform_int_distribution<int> zp(-8, 7);
  m.offsets.resize(size_t(rows * groups));
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t g = 0; g < groups; ++g)
      m.offsets[size_t(o * groups + g)] =
          -float(zp(rng)) *
          m.scales[size_t(fc.format == QuantFormat::kInt4Row ? o : o * groups + g)];
  return m;
}

double gamma_bound(int64_t k) {
  const double u = std::ldexp(1.0, -24);
  return double(k) * u / (1.0 - double(k) * u);
}

struct ShapeCase {
  FormatCase format;
  int64_t rows, cols;
};

// Odd rows, short last groups (tails), one group a row (per row, and a group wider than the row),
// a padding nibble, and a larger matrix.
const ShapeCase kShapes[] = {
    {{"int4-g32", QuantFormat::kInt4Grouped, 32}, 37, 70},
    {{"int4-g16", QuantFormat::kInt4Grouped, 16}, 5, 130},
    {{"int4-g48", QuantFormat::kInt4Grouped, 48}, 9, 101},
    {{"int4-row", QuantFormat::kInt4Row, 0}, 3, 1},
    {{"int4-row", QuantFormat::kInt4Row, 0}, 11, 77},
    {{"int4-g64", QuantFormat::kInt4Grouped, 64}, 7, 33},
    {{"int4-g64", QuantFormat::kInt4Grouped, 64}, 128, 384},
    {{"int4-g128", QuantFormat::kInt4Grouped, 128}, 64, 320},
};

std::string case_name(const ShapeCase& s, int64_t n) {
  return std::string(s.format.name) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
         " n=" + std::to_string(n);
}

TEST(ZeroPoints, TermsMatchTheScalarReference) {
  for (const ShapeCase& s : kShapes)
    for (int64_t n : {int64_t(1), int64_t(3), int64_t(11), int64_t(64)}) {
      SCOPED_TRACE(case_name(s, n));
      const AsymMatrix m = asym_matrix(s.format, s.rows, s.cols, 7);
      const std::vector<float> x = normal(n * s.cols, 8);
      const std::vector<float> base = normal(n * s.rows, 9);
      std::vector<float> y = base, y_ref = base;
      add_zero_point_terms(m.view(), x.data(), n, y.data());
      add_zero_point_terms_scalar(m.view(), x.data(), n, y_ref.data());
      const int64_t groups = offset_groups(m.view());
      const int64_t g = s.format.group_size ? s.format.group_size : s.cols;
      const double gamma = gamma_bound(g + groups + 1);
      size_t changed = 0;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t o = 0; o < s.rows; ++o) {
          double magnitude = 0;
          for (int64_t i = 0; i < s.cols; ++i)
            magnitude += std::fabs(double(m.offsets[size_t(o * groups + i / g)]) *
                                   double(x[size_t(t * s.cols + i)]));
          const size_t j = size_t(t * s.rows + o);
          const double bound =
              gamma * magnitude + std::ldexp(1.0, -23) * std::fabs(double(y_ref[j]));
          EXPECT_LE(std::fabs(double(y[j]) - double(y_ref[j])), bound) << "t " << t << " o " << o;
          changed += y_ref[j] != base[j];
        }
      EXPECT_GT(changed, size_t(0)) << "no zero point changed the product";
    }
}

TEST(ZeroPoints, NoOffsetsAddNothing) {
  const AsymMatrix m = asym_matrix(kShapes[0].format, kShapes[0].rows, kShapes[0].cols, 3);
  const std::vector<float> x = normal(2 * m.cols, 4);
  const std::vector<float> base = normal(2 * m.rows, 5);
  std::vector<float> y = base;
  add_zero_point_terms(m.view(false), x.data(), 2, y.data());
  EXPECT_EQ(y, base);
}

TEST(ZeroPoints, Int8MatricesTakeNone) {
  const std::vector<uint8_t> data(4, 1);
  const std::vector<float> scales(2, 1.0f), offsets(2, 1.0f);
  const QuantMatrixView w{
      QuantFormat::kInt8Row, 2, 2, 0, data.data(), scales.data(), QuantLayout::kRows,
      offsets.data()};
  EXPECT_THROW(check_view(w), std::invalid_argument);
}

// dequantize adds each element's offset to (q - 8) * s.
TEST(ZeroPoints, DequantizeAddsTheOffsets) {
  for (const ShapeCase& s : kShapes) {
    SCOPED_TRACE(case_name(s, 0));
    const AsymMatrix m = asym_matrix(s.format, s.rows, s.cols, 11);
    std::vector<float> sym(size_t(s.rows * s.cols)), asym(sym.size());
    dequantize(m.view(false), sym.data());
    dequantize(m.view(), asym.data());
    const int64_t groups = offset_groups(m.view());
    const int64_t g = s.format.group_size ? s.format.group_size : s.cols;
    for (int64_t o = 0; o < s.rows; ++o)
      for (int64_t i = 0; i < s.cols; ++i)
        ASSERT_EQ(asym[size_t(o * s.cols + i)],
                  sym[size_t(o * s.cols + i)] + m.offsets[size_t(o * groups + i / g)])
            << o << ", " << i;
  }
}

// quant_linear with offsets is the symmetric product plus add_zero_point_terms, bit for bit, on
// every ISA, with fp32 and (where the format takes them) int8 activations.
TEST(ZeroPoints, QuantLinearAddsTheTerms) {
  for (QuantIsa isa : available_isas())
    for (const ShapeCase& s : kShapes)
      for (int64_t n : {int64_t(1), int64_t(3), int64_t(64)})
        for (const bool int8 : {false, true}) {
          const AsymMatrix m = asym_matrix(s.format, s.rows, s.cols, 21);
          if (int8 && !int8_activations_supported(m.view())) continue;
          SCOPED_TRACE(std::string(quant_isa_name(isa)) + (int8 ? " int8 " : " f32 ") +
                       case_name(s, n));
          const std::vector<float> x = normal(n * s.cols, 22);
          std::vector<float> y(size_t(n * s.rows)), expected(y.size());
          const auto run = [&](const QuantMatrixView& w, float* out) {
            if (int8)
              quant_linear_int8(isa, w, x.data(), n, out);
            else
              quant_linear(isa, w, x.data(), n, out);
          };
          run(m.view(), y.data());
          run(m.view(false), expected.data());
          add_zero_point_terms(m.view(), x.data(), n, expected.data());
          EXPECT_EQ(y, expected);
        }
}

// The expert FFN with offsets on gate, up and down is the FFN composed of quant_linear products,
// each with its terms (gate and up before the activation), bit for bit, on every ISA, with fp32
// and int8 activations, at one thread and more; without the offsets it is another.
TEST(ZeroPoints, ExpertFfnAppliesThemBeforeTheActivation) {
  const FormatCase formats[] = {{"int4-row", QuantFormat::kInt4Row, 0},
                                {"int4-g32", QuantFormat::kInt4Grouped, 32},
                                {"int4-g64", QuantFormat::kInt4Grouped, 64}};
  const int64_t hidden = 192, inter = 72;  // 72 % 64 = 8: a short group in down
  const int threads = omp_get_max_threads();
  for (QuantIsa isa : available_isas())
    for (const FormatCase& fc : formats)
      for (int64_t n : {int64_t(1), int64_t(5)})
        for (const bool int8 : {false, true}) {
          const AsymMatrix gate = asym_matrix(fc, inter, hidden, 31);
          const AsymMatrix up = asym_matrix(fc, inter, hidden, 32);
          const AsymMatrix down = asym_matrix(fc, hidden, inter, 33);
          if (int8 && !int8_activations_supported(gate.view())) continue;
          SCOPED_TRACE(std::string(quant_isa_name(isa)) + (int8 ? " int8 " : " f32 ") + fc.name +
                       " n=" + std::to_string(n));
          const std::vector<float> x = normal(n * hidden, 34);
          const auto linear = [&](const QuantMatrixView& w, const float* in, float* out) {
            if (int8)
              quant_linear_int8(isa, w, in, n, out);
            else
              quant_linear(isa, w, in, n, out);
          };
          const auto ffn = [&](bool with_offsets, float* out) {
            if (int8)
              quant_expert_ffn_int8(isa, gate.view(with_offsets), up.view(with_offsets),
                                    down.view(with_offsets), x.data(), n, out);
            else
              quant_expert_ffn(isa, gate.view(with_offsets), up.view(with_offsets),
                               down.view(with_offsets), x.data(), n, out);
          };
          std::vector<float> g(size_t(n * inter)), u(g.size()), h(g.size());
          linear(gate.view(), x.data(), g.data());
          linear(up.view(), x.data(), u.data());
          for (size_t k = 0; k < h.size(); ++k) h[k] = g[k] / (1.0f + std::exp(-g[k])) * u[k];
          std::vector<float> want(size_t(n * hidden));
          linear(down.view(), h.data(), want.data());
          for (int nth : {1, std::max(2, threads)}) {
            omp_set_num_threads(nth);
            std::vector<float> y(want.size(), std::nanf(""));
            ffn(true, y.data());
            EXPECT_EQ(y, want) << nth << " threads";
          }
          omp_set_num_threads(threads);
          std::vector<float> y_sym(want.size());
          ffn(false, y_sym.data());
          EXPECT_NE(y_sym, want);
        }
}

}  // namespace
}  // namespace colibri::kernels
