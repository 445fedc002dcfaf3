// int8-activation kernels (quant.h): the activation quantization rule, every ISA's kernel against
// an exact double reference on the quantized operands, and the properties the engine relies on
// (a row's result independent of the batch and of the thread count, the dispatch, the fallback).
//
// Error bound. With x_k the block-k activations as quantized (q * s_x) and W the container's
// weights, a kernel computes each block's integer dot product exactly, then in fp32 multiplies
// it by s_x * s_w (two roundings) and adds the blocks (at most cols additions, in any order), so
//   |y - sum_i W[o, i] x[i]| <= gamma(cols + 16) * sum_i |W[o, i] x[i]|.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/quant.h"
#include "quant_fixtures.h"

namespace colibri::kernels {
namespace {

using test::FormatCase;
using test::normal;

const auto& kFormats = test::kInt8Formats;

struct Shape {
  int64_t rows, cols;
};

// Full pairs of blocks, an odd block count, short last blocks, an odd cols (padding nibble).
// {33, 2240}: more than 16 groups of 64 (the AVX-512 kernel transposes 16 group scales at a time,
// the AVX2 one 8).
const Shape kShapes[] = {{96, 384}, {40, 320}, {37, 70}, {5, 130},
                         {3, 1},    {2, 17},   {9, 200}, {33, 2240}};
const int64_t kBatches[] = {1, 3, 8, 11, 20};

std::string isa_label(QuantIsa isa) {
  return std::string(quant_isa_name(isa)) + (int8_activations_vnni(isa) ? "+vnni" : "") +
         (int8_activations_amx(isa, kAmxMinRows) ? "+amx" : "");
}

struct QuantMatrix {
  QuantFormat format;
  int64_t rows, cols;
  int group_size;
  std::vector<uint8_t> data;
  std::vector<float> scales;

  QuantMatrix(const FormatCase& fc, Shape s)
      : format(fc.format),
        rows(s.rows),
        cols(s.cols),
        group_size(fc.group_size),
        data(size_t(packed_bytes(fc.format, s.rows, s.cols))),
        scales(size_t(scale_count(fc.format, s.rows, s.cols, fc.group_size))) {}
  QuantMatrixView view() const {
    return {format, rows, cols, group_size, data.data(), scales.data()};
  }
};

QuantMatrix quantized_normal(const FormatCase& fc, Shape s, uint32_t seed) {
  QuantMatrix m(fc, s);
  const std::vector<float> w = normal(s.rows * s.cols, seed, 0.05f);
  quantize(fc.format, fc.group_size, w.data(), s.rows, s.cols, m.data.data(), m.scales.data());
  return m;
}

// W[o, i] from the container definition.
double weight_at(const QuantMatrix& m, int64_t o, int64_t i) {
  if (m.format == QuantFormat::kInt8Row)
    return double(int8_t(m.data[o * m.cols + i])) * m.scales[o];
  const uint8_t byte = m.data[o * ((m.cols + 1) / 2) + i / 2];
  const int q = int(i % 2 == 0 ? byte & 0x0F : byte >> 4) - 8;
  if (m.format == QuantFormat::kInt4Row) return q * double(m.scales[o]);
  const int64_t ng = (m.cols + m.group_size - 1) / m.group_size;
  return q * double(m.scales[o * ng + i / m.group_size]);
}

// x as the kernels see it: each row quantized by quantize_activations_int8, in double.
std::vector<double> quantized_activations(const std::vector<float>& x, int64_t n, int64_t cols) {
  std::vector<double> out(x.size());
  std::vector<int8_t> q(static_cast<size_t>(cols));
  std::vector<float> s(size_t((cols + 63) / 64));
  for (int64_t t = 0; t < n; ++t) {
    quantize_activations_int8(x.data() + t * cols, cols, q.data(), s.data());
    for (int64_t i = 0; i < cols; ++i) out[t * cols + i] = double(q[i]) * s[i / 64];
  }
  return out;
}

double gamma_bound(int64_t k) {
  const double u = std::ldexp(1.0, -24);
  return double(k) * u / (1.0 - double(k) * u);
}

std::vector<float> run_int8(QuantIsa isa, const QuantMatrix& m, const std::vector<float>& x,
                            int64_t n) {
  std::vector<float> y(size_t(n * m.rows), std::nanf(""));
  quant_linear_int8(isa, m.view(), x.data(), n, y.data());
  return y;
}

// Checks y against the exact product of the quantized operands; returns the outputs compared.
void expect_exact_within_bound(const QuantMatrix& m, const std::vector<float>& x, int64_t n,
                               const std::vector<float>& y) {
  const std::vector<double> xq = quantized_activations(x, n, m.cols);
  size_t nonzero = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t o = 0; o < m.rows; ++o) {
      double exact = 0, abs_sum = 0;
      for (int64_t i = 0; i < m.cols; ++i) {
        const double term = weight_at(m, o, i) * xq[t * m.cols + i];
        exact += term;
        abs_sum += std::fabs(term);
      }
      const float got = y[t * m.rows + o];
      ASSERT_LE(std::fabs(got - exact), gamma_bound(m.cols + 16) * abs_sum)
          << "t " << t << " o " << o << " got " << got << " exact " << exact;
      nonzero += exact != 0.0;
    }
  EXPECT_GE(2 * nonzero, y.size()) << "reference mostly zero: the comparison proves little";
}

// ---- activation quantization ------------------------------------------------------------------

TEST(Int8Activations, QuantizeWithinHalfAStepPerBlock) {
  const int64_t cols = 200;  // blocks of 64, 64, 64, 8
  std::vector<float> x = normal(cols, 1);
  x[3] = 9.0f;                                      // block 0's amax
  for (int64_t i = 128; i < 192; ++i) x[i] = 0.0f;  // block 2 all zero
  std::vector<int8_t> q(static_cast<size_t>(cols));
  std::vector<float> s(4);
  quantize_activations_int8(x.data(), cols, q.data(), s.data());
  EXPECT_EQ(s[0], 9.0f / 127.0f);
  EXPECT_EQ(q[3], 127);
  EXPECT_EQ(s[2], 0.0f);
  for (int64_t i = 0; i < cols; ++i) {
    const float step = s[i / 64];
    EXPECT_LE(std::fabs(x[i] - q[i] * step), 0.5f * step * (1 + 1e-5f) + 1e-30f) << i;
    EXPECT_LE(std::abs(int(q[i])), 127);
  }
}

TEST(Int8Activations, NonFiniteInputPoisonsOnlyItsBlock) {
  std::vector<float> x = normal(128, 2);
  x[70] = std::nanf("");
  std::vector<int8_t> q(128);
  std::vector<float> s(2);
  quantize_activations_int8(x.data(), 128, q.data(), s.data());
  EXPECT_TRUE(std::isfinite(s[0]));
  EXPECT_TRUE(std::isnan(s[1]));

  const FormatCase fc = kFormats[1];
  const QuantMatrix m = quantized_normal(fc, {8, 128}, 3);
  test::for_each_int8_kernel([&](QuantIsa isa) {
    for (float bad : {std::nanf(""), INFINITY}) {
      x[70] = bad;
      const std::vector<float> y = run_int8(isa, m, x, 1);
      for (float v : y) EXPECT_TRUE(std::isnan(v)) << isa_label(isa);
    }
  });
}

// ---- quant_linear_int8 --------------------------------------------------------------------------

TEST(QuantLinearInt8, EveryIsaWithinTheBoundOfTheExactProduct) {
  test::for_each_int8_kernel([&](QuantIsa isa) {
    for (const FormatCase& fc : kFormats)
      for (const Shape& s : kShapes)
        for (int64_t n : kBatches) {
          SCOPED_TRACE(isa_label(isa) + " " + fc.name + " " + std::to_string(s.rows) + "x" +
                       std::to_string(s.cols) + " n=" + std::to_string(n));
          const QuantMatrix m = quantized_normal(fc, s, uint32_t(s.rows * 31 + s.cols));
          const std::vector<float> x = normal(n * s.cols, uint32_t(n + 7));
          expect_exact_within_bound(m, x, n, run_int8(isa, m, x, n));
        }
  });
}

// Every ISA performs the same fp32 operations in the same order (quant_int8_detail.h): bit for
// bit the scalar reference, for every format, shape (partial tiles and blocks) and batch.
TEST(QuantLinearInt8, EveryIsaEqualsTheScalarReferenceBitForBit) {
  test::for_each_int8_kernel([&](QuantIsa isa) {
    for (const FormatCase& fc : kFormats)
      for (const Shape& s : kShapes)
        for (int64_t n : kBatches) {
          SCOPED_TRACE(isa_label(isa) + " " + fc.name + " " + std::to_string(s.rows) + "x" +
                       std::to_string(s.cols) + " n=" + std::to_string(n));
          const QuantMatrix m = quantized_normal(fc, s, uint32_t(s.rows * 7 + s.cols));
          const std::vector<float> x = normal(n * s.cols, uint32_t(n + 3));
          ASSERT_EQ(run_int8(isa, m, x, n), run_int8(QuantIsa::kScalar, m, x, n));
        }
  });
}

// Activations at the edges of the quantization rule: values whose scaled product is a tie
// (k + 0.5, rounded to even), zeros of both signs, subnormals, the largest finite float, and a
// short last block. Every ISA's quantizer gives the scalar reference's codes, so the products
// agree bit for bit (int8 weights: each code meets its own weight).
TEST(QuantLinearInt8, EveryIsaQuantizesEdgeValuesAlike) {
  const Shape s{16, 200};
  const QuantMatrix m = quantized_normal(kFormats[4], s, 31);
  std::vector<float> x(size_t(3 * s.cols));
  for (int64_t i = 0; i < s.cols; ++i) {
    // Row 0: amax 127 in every block, so x * 127 / amax = x: ties at k + 0.5.
    x[size_t(i)] = i % 64 == 0 ? 127.0f : float(i % 50) - 24.5f;
    // Row 1: signed zeros and subnormals beside a normal value.
    x[size_t(s.cols + i)] = i % 3 == 0 ? -0.0f : (i % 3 == 1 ? 1e-40f : -3e-39f);
    // Row 2: the largest finite float and its neighbours.
    x[size_t(2 * s.cols + i)] = i % 5 == 0 ? 3.4028235e38f : float(i) * 1e36f;
  }
  x[size_t(s.cols + 70)] = 0.75f;
  // A block of subnormals counts as zero (127 / amax overflows); the block beside it does not.
  std::vector<int8_t> q(size_t(s.cols));
  std::vector<float> scales(4);
  quantize_activations_int8(x.data() + s.cols, s.cols, q.data(), scales.data());
  EXPECT_EQ(scales[0], 0.0f);
  EXPECT_TRUE(std::all_of(q.begin(), q.begin() + 64, [](int8_t v) { return v == 0; }));
  EXPECT_EQ(scales[1], 0.75f / 127.0f);
  EXPECT_EQ(q[70], 127);
  test::for_each_int8_kernel([&](QuantIsa isa) {
    SCOPED_TRACE(isa_label(isa));
    ASSERT_EQ(run_int8(isa, m, x, 3), run_int8(QuantIsa::kScalar, m, x, 3));
  });
}

// Codes at the ends of their ranges, where a 16-bit pair sum could saturate: int4 nibbles 0 and
// 15 against +-127, int8 weights -128 (never written by the quantizer, but readable) and 127.
TEST(QuantLinearInt8, ExtremeCodesDoNotSaturate) {
  const Shape s{4, 256};
  test::for_each_int8_kernel([&](QuantIsa isa) {
    for (const FormatCase& fc : {kFormats[1], kFormats[4]}) {
      SCOPED_TRACE(isa_label(isa) + " " + fc.name);
      QuantMatrix m(fc, s);
      for (size_t k = 0; k < m.data.size(); ++k)
        m.data[k] =
            fc.format == QuantFormat::kInt8Row ? (k % 3 ? 0x80 : 0x7F) : (k % 2 ? 0x00 : 0xFF);
      std::fill(m.scales.begin(), m.scales.end(), 0.5f);
      std::vector<float> x(size_t(2 * s.cols));
      for (size_t i = 0; i < x.size(); ++i) x[i] = (i / 3) % 2 ? -1.0f : 1.0f;
      expect_exact_within_bound(m, x, 2, run_int8(isa, m, x, 2));
    }
  });
}

// A row's result is the same alone or in a batch, and with any thread count: the engine's
// batched and single-sequence runs see the same numbers.
TEST(QuantLinearInt8, RowResultIndependentOfBatchAndThreads) {
  const Shape s{301, 640};
  const int64_t n = 13;
  const int threads = omp_get_max_threads();
  test::for_each_int8_kernel([&](QuantIsa isa) {
    for (const FormatCase& fc : kFormats) {
      SCOPED_TRACE(isa_label(isa) + " " + fc.name);
      const QuantMatrix m = quantized_normal(fc, s, 5);
      const std::vector<float> x = normal(n * s.cols, 6);
      omp_set_num_threads(1);
      const std::vector<float> batch = run_int8(isa, m, x, n);
      omp_set_num_threads(std::max(2, threads));
      EXPECT_EQ(run_int8(isa, m, x, n), batch);
      for (int64_t t : {int64_t(0), int64_t(7), n - 1}) {
        const std::vector<float> row(x.begin() + t * s.cols, x.begin() + (t + 1) * s.cols);
        const std::vector<float> alone = run_int8(isa, m, row, 1);
        EXPECT_TRUE(std::equal(alone.begin(), alone.end(), batch.begin() + t * s.rows)) << t;
      }
    }
  });
  omp_set_num_threads(threads);
}

// The int8 error against fp32 activations on random data: about 1/254 of a block's largest
// magnitude per input, so a relative RMS error of a fraction of a percent.
TEST(QuantLinearInt8, CloseToFp32Activations) {
  const Shape s{256, 1024};
  const int64_t n = 4;
  for (const FormatCase& fc : kFormats) {
    const QuantMatrix m = quantized_normal(fc, s, 9);
    const std::vector<float> x = normal(n * s.cols, 10);
    std::vector<float> f32(size_t(n * s.rows));
    quant_linear(quant_isa_selected(), m.view(), x.data(), n, f32.data());
    const std::vector<float> i8 = run_int8(quant_isa_selected(), m, x, n);
    double err = 0, ref = 0;
    for (size_t k = 0; k < f32.size(); ++k) {
      err += double(i8[k] - f32[k]) * (i8[k] - f32[k]);
      ref += double(f32[k]) * f32[k];
    }
    EXPECT_LT(std::sqrt(err / ref), 0.01) << fc.name;
    EXPECT_GT(std::sqrt(err / ref), 0.0) << fc.name << ": int8 path not taken";
  }
}

TEST(QuantLinearInt8, RefusesGroupsThatAreNotMultiplesOf64) {
  for (int gs : {16, 32, 48, 96}) {
    const FormatCase fc{"g", QuantFormat::kInt4Grouped, gs};
    const QuantMatrix m = quantized_normal(fc, {8, 192}, 11);
    EXPECT_FALSE(int8_activations_supported(m.view())) << gs;
    std::vector<float> x(192, 1.0f), y(8);
    EXPECT_THROW(quant_linear_int8(QuantIsa::kScalar, m.view(), x.data(), 1, y.data()),
                 std::invalid_argument);
  }
  for (const FormatCase& fc : kFormats)
    EXPECT_TRUE(int8_activations_supported(quantized_normal(fc, {2, 64}, 12).view()));
}

// quant_linear(w, ...) follows the selected activations and falls back to fp32 for formats the
// int8 path does not take.
TEST(QuantLinearInt8, DispatchFollowsTheSelection) {
  const QuantActivations saved = quant_activations_selected();
  const Shape s{40, 192};
  const std::vector<float> x = normal(2 * s.cols, 13);
  const FormatCase g32{"int4-g32", QuantFormat::kInt4Grouped, 32};
  for (const FormatCase& fc : {kFormats[1], kFormats[4], g32}) {
    const QuantMatrix m = quantized_normal(fc, s, 14);
    std::vector<float> f32(size_t(2 * s.rows)), i8(f32.size()), got(f32.size());
    quant_linear(quant_isa_selected(), m.view(), x.data(), 2, f32.data());
    if (int8_activations_supported(m.view()))
      quant_linear_int8(quant_isa_selected(), m.view(), x.data(), 2, i8.data());
    else
      i8 = f32;
    set_quant_activations(QuantActivations::kInt8);
    quant_linear(m.view(), x.data(), 2, got.data());
    EXPECT_EQ(got, i8) << fc.name;
    set_quant_activations(QuantActivations::kF32);
    quant_linear(m.view(), x.data(), 2, got.data());
    EXPECT_EQ(got, f32) << fc.name;
    // Mixed: int8 activations for int4 weights only.
    set_quant_activations(QuantActivations::kMixed);
    quant_linear(m.view(), x.data(), 2, got.data());
    EXPECT_EQ(got, fc.format == QuantFormat::kInt8Row ? f32 : i8) << fc.name;
  }
  set_quant_activations(saved);
}

TEST(QuantLinearInt8, ResolvesTheName) {
  EXPECT_EQ(quant_activations_resolve(nullptr), QuantActivations::kInt8);
  EXPECT_EQ(quant_activations_resolve(""), QuantActivations::kInt8);
  EXPECT_EQ(quant_activations_resolve("int8"), QuantActivations::kInt8);
  EXPECT_EQ(quant_activations_resolve("f32"), QuantActivations::kF32);
  EXPECT_EQ(quant_activations_resolve("mixed"), QuantActivations::kMixed);
  for (QuantActivations a :
       {QuantActivations::kF32, QuantActivations::kInt8, QuantActivations::kMixed})
    EXPECT_EQ(quant_activations_resolve(quant_activations_name(a)), a);
  EXPECT_THROW(quant_activations_resolve("fp16"), std::invalid_argument);
}

// ---- quant_expert_ffn_int8 ----------------------------------------------------------------------

// The fused FFN is the three int8 products with silu between them, bit for bit, for every
// ISA and thread count (the hidden activations are quantized per (row, pair) by one thread).
TEST(QuantExpertFfnInt8, EqualsTheComposedProducts) {
  const int64_t hidden = 200, inter = 136;
  const int threads = omp_get_max_threads();
  test::for_each_int8_kernel([&](QuantIsa isa) {
    for (const FormatCase& fc : kFormats)
      for (int64_t n : {int64_t(1), int64_t(3), int64_t(9), kAmxMinRows + 3}) {
        SCOPED_TRACE(isa_label(isa) + " " + fc.name + " n=" + std::to_string(n));
        const QuantMatrix gate = quantized_normal(fc, {inter, hidden}, 21);
        const QuantMatrix up = quantized_normal(fc, {inter, hidden}, 22);
        const QuantMatrix down = quantized_normal(fc, {hidden, inter}, 23);
        const std::vector<float> x = normal(n * hidden, 24);
        std::vector<float> g = run_int8(isa, gate, x, n), u = run_int8(isa, up, x, n);
        std::vector<float> h(g.size());
        for (size_t k = 0; k < h.size(); ++k) h[k] = g[k] / (1.0f + std::exp(-g[k])) * u[k];
        const std::vector<float> want = run_int8(isa, down, h, n);
        for (int nth : {1, std::max(2, threads)}) {
          omp_set_num_threads(nth);
          std::vector<float> y(size_t(n * hidden), std::nanf(""));
          quant_expert_ffn_int8(isa, gate.view(), up.view(), down.view(), x.data(), n, y.data());
          EXPECT_EQ(y, want) << nth << " threads";
        }
      }
  });
  omp_set_num_threads(threads);
}

// ---- AMX ----------------------------------------------------------------------------------------

constexpr const char* kNoAmx =
    "AMX not available here (needs x86-64 Linux, a CPU with AMX-TILE and AMX-INT8, and the "
    "kernel's "
    "permission for the tile state)";

// Sets the AMX switch for a scope and restores it.
struct ScopedAmx {
  bool saved = amx_enabled() || !amx_available();
  explicit ScopedAmx(bool on) { set_amx(on); }
  ~ScopedAmx() { set_amx(saved); }
};

// The AMX kernel (16 x 16 tiles of outputs, 64-input blocks) on every shape class: rows that are
// not a multiple of 16 (a last tile of 1..15 live rows, kTiles with an odd tile count), short last
// blocks and odd cols (kRows), activation rows that leave a partial last tile, in either layout:
// bit for bit the scalar reference, and so the VNNI kernel.
TEST(QuantLinearInt8Amx, EqualsTheScalarReferenceOnEveryShapeClass) {
  if (!amx_available()) GTEST_SKIP() << kNoAmx;
  const ScopedAmx on(true);
  const Shape shapes[] = {{96, 384}, {40, 320}, {37, 70},   {5, 130}, {3, 1},
                          {2, 17},   {9, 200},  {33, 2240}, {16, 64}, {17, 1088},
                          {8, 128},  {24, 192}, {200, 448}};
  const int64_t batches[] = {kAmxMinRows, kAmxMinRows + 1, kAmxMinRows + 15, kAmxMinRows + 24,
                             3 * kAmxMinRows + 5};
  for (const FormatCase& fc : kFormats)
    for (const Shape& s : shapes)
      for (QuantLayout layout : {QuantLayout::kRows, QuantLayout::kTiles}) {
        if (layout == QuantLayout::kTiles &&
            !tiles_supported(fc.format, s.rows, s.cols, fc.group_size))
          continue;
        QuantMatrix m = quantized_normal(fc, s, uint32_t(s.rows * 5 + s.cols));
        QuantMatrixView v = m.view();
        std::vector<uint8_t> tiled(m.data.size());
        std::vector<float> tiled_scales(m.scales.size());
        if (layout == QuantLayout::kTiles) {
          relayout(v, layout, tiled.data(), tiled_scales.data());
          v = {m.format, m.rows, m.cols, m.group_size, tiled.data(), tiled_scales.data(), layout};
        }
        for (int64_t n : batches) {
          SCOPED_TRACE(std::string(fc.name) + " " + std::to_string(s.rows) + "x" +
                       std::to_string(s.cols) + (layout == QuantLayout::kTiles ? " tiles" : "") +
                       " n=" + std::to_string(n));
          ASSERT_TRUE(int8_activations_amx(QuantIsa::kAvx512, n));
          const std::vector<float> x = normal(n * s.cols, uint32_t(n + 7));
          std::vector<float> got(size_t(n * s.rows), std::nanf(""));
          quant_linear_int8(QuantIsa::kAvx512, v, x.data(), n, got.data());
          ASSERT_EQ(got, run_int8(QuantIsa::kScalar, m, x, n));
        }
      }
}

// The extreme codes of ExtremeCodesDoNotSaturate at a batch AMX takes: exact int32 sums.
TEST(QuantLinearInt8Amx, ExtremeCodesAreExact) {
  if (!amx_available()) GTEST_SKIP() << kNoAmx;
  const ScopedAmx on(true);
  const Shape s{20, 256};
  const int64_t n = kAmxMinRows + 2;
  for (const FormatCase& fc : {kFormats[1], kFormats[4]}) {
    SCOPED_TRACE(fc.name);
    QuantMatrix m(fc, s);
    for (size_t k = 0; k < m.data.size(); ++k)
      m.data[k] =
          fc.format == QuantFormat::kInt8Row ? (k % 3 ? 0x80 : 0x7F) : (k % 2 ? 0x00 : 0xFF);
    std::fill(m.scales.begin(), m.scales.end(), 0.5f);
    std::vector<float> x(size_t(n * s.cols));
    for (size_t i = 0; i < x.size(); ++i) x[i] = (i / 3) % 2 ? -1.0f : 1.0f;
    const std::vector<float> y = run_int8(QuantIsa::kAvx512, m, x, n);
    expect_exact_within_bound(m, x, n, y);
    EXPECT_EQ(y, run_int8(QuantIsa::kScalar, m, x, n));
  }
}

// The fused FFN with AMX on and off: bit for bit, at batches on both sides of kAmxMinRows.
TEST(QuantLinearInt8Amx, ExpertFfnEqualsVnni) {
  if (!amx_available()) GTEST_SKIP() << kNoAmx;
  const int64_t hidden = 320, inter = 200;
  for (const FormatCase& fc : kFormats) {
    const QuantMatrix gate = quantized_normal(fc, {inter, hidden}, 31);
    const QuantMatrix up = quantized_normal(fc, {inter, hidden}, 32);
    const QuantMatrix down = quantized_normal(fc, {hidden, inter}, 33);
    for (int64_t n : {kAmxMinRows - 1, kAmxMinRows, kAmxMinRows + 29}) {
      SCOPED_TRACE(std::string(fc.name) + " n=" + std::to_string(n));
      const std::vector<float> x = normal(n * hidden, 34);
      std::vector<float> with(size_t(n * hidden)), without(with.size());
      {
        const ScopedAmx on(true);
        quant_expert_ffn_int8(QuantIsa::kAvx512, gate.view(), up.view(), down.view(), x.data(), n,
                              with.data());
      }
      {
        const ScopedAmx off(false);
        quant_expert_ffn_int8(QuantIsa::kAvx512, gate.view(), up.view(), down.view(), x.data(), n,
                              without.data());
      }
      EXPECT_EQ(with, without);
    }
  }
}

// set_amx turns it off and on; it serves only AVX-512 and batches of kAmxMinRows rows or more.
TEST(QuantLinearInt8Amx, SwitchAndThreshold) {
  {
    const ScopedAmx off(false);
    EXPECT_FALSE(amx_enabled());
    EXPECT_FALSE(int8_activations_amx(QuantIsa::kAvx512, 512));
  }
  const ScopedAmx on(true);
  EXPECT_EQ(amx_enabled(), amx_available());
  EXPECT_FALSE(int8_activations_amx(QuantIsa::kAvx512, kAmxMinRows - 1));
  EXPECT_FALSE(int8_activations_amx(QuantIsa::kAvx2, 512));
  EXPECT_FALSE(int8_activations_amx(QuantIsa::kScalar, 512));
  EXPECT_EQ(int8_activations_amx(QuantIsa::kAvx512, kAmxMinRows), amx_available());
  if (!amx_available()) GTEST_SKIP() << kNoAmx;
}

// COLIBRI_AMX=0 in the environment turns AMX off at start (ctest runs this test once more with it
// set: QuantLinearInt8Amx.EnvironmentTurnsItOff.COLIBRI_AMX=0).
TEST(QuantLinearInt8Amx, EnvironmentTurnsItOff) {
  const char* value = std::getenv("COLIBRI_AMX");
  if (value == nullptr || std::string(value) != "0")
    GTEST_SKIP() << "COLIBRI_AMX is not 0 here; the run with it set checks the switch";
  EXPECT_FALSE(amx_enabled());
  EXPECT_FALSE(int8_activations_amx(QuantIsa::kAvx512, 512));
}

}  // namespace
}  // namespace colibri::kernels
