// Quantized matrices held as kTiles (quant.h): the relayout is exact and reversible, and every
// kernel, on every ISA and with either activation precision, gives the kRows result bit for bit;
// so does a slice of whole tiles.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// A matrix that owns its bytes, in either layout.
struct Owned {
  QuantMatrixView view_of{};
  std::vector<uint8_t> data;
  std::vector<float> scales;

  Owned(const FormatCase& fc, int64_t rows, int64_t cols)
      : data(size_t(packed_bytes(fc.format, rows, cols))),
        scales(size_t(scale_count(fc.format, rows, cols, fc.group_size))) {
    view_of = {fc.format, rows, cols, fc.group_size, data.data(), scales.data()};
  }
  QuantMatrixView view() const { return view_of; }
  Owned in(QuantLayout layout) const {
    Owned out = *this;
    out.view_of.data = out.data.data();
    out.view_of.scales = out.scales.data();
    out.view_of.layout = layout;
    relayout(view_of, layout, out.data.data(), out.scales.data());
    return out;
  }
};

Owned quantized_normal(const FormatCase& fc, int64_t rows, int64_t cols, uint32_t seed) {
  Owned m(fc, rows, cols);
  const std::vector<float> w = normal(rows * cols, seed, 0.05f);
  quantize(fc.format, fc.group_size, w.data(), rows, cols, m.data.data(), m.scales.data());
  return m;
}

TEST(QuantTiles, SupportedShapes) {
  EXPECT_TRUE(tiles_supported(QuantFormat::kInt4Grouped, 16, 128, 64));
  EXPECT_TRUE(tiles_supported(QuantFormat::kInt4Row, 8, 64, 0));
  EXPECT_TRUE(tiles_supported(QuantFormat::kInt8Row, 2048, 1408, 0));
  EXPECT_FALSE(tiles_supported(QuantFormat::kInt4Grouped, 12, 128, 64));  // rows
  EXPECT_FALSE(tiles_supported(QuantFormat::kInt8Row, 16, 96, 0));        // cols
  EXPECT_FALSE(tiles_supported(QuantFormat::kInt4Grouped, 16, 128, 32));  // group
  const Owned m = quantized_normal(kFormats[1], 12, 128, 1);
  std::vector<uint8_t> data(m.data.size());
  std::vector<float> scales(m.scales.size());
  EXPECT_THROW(relayout(m.view(), QuantLayout::kTiles, data.data(), scales.data()),
               std::invalid_argument);
  QuantMatrixView tiled = m.view();
  tiled.layout = QuantLayout::kTiles;
  std::vector<float> y(12);
  EXPECT_THROW(quant_linear(QuantIsa::kScalar, tiled, normal(128, 2).data(), 1, y.data()),
               std::invalid_argument);
}

// Where row o's byte b and scale g land, from the definition in quant.h, and back.
TEST(QuantTiles, RelayoutPlacesEveryByteAndScaleAndIsReversible) {
  for (const FormatCase& fc : kFormats) {
    SCOPED_TRACE(fc.name);
    const int64_t rows = 24, cols = 384, rb = row_bytes(fc.format, cols);
    const int64_t ng = fc.format == QuantFormat::kInt4Grouped ? cols / fc.group_size : 1;
    const Owned m = quantized_normal(fc, rows, cols, 3);
    const Owned t = m.in(QuantLayout::kTiles);
    for (int64_t o = 0; o < rows; ++o) {
      for (int64_t b = 0; b < rb; ++b)
        ASSERT_EQ(
            t.data[size_t(o / 8 * 8 * rb + b / 32 * 256 + b % 32 / 4 * 32 + o % 8 * 4 + b % 4)],
            m.data[size_t(o * rb + b)])
            << "row " << o << " byte " << b;
      for (int64_t g = 0; g < ng; ++g) {
        const size_t at = fc.format == QuantFormat::kInt4Grouped
                              ? size_t((o / 8 * ng + g) * 8 + o % 8)
                              : size_t(o);
        ASSERT_EQ(t.scales[at],
                  m.scales[size_t(fc.format == QuantFormat::kInt4Grouped ? o * ng + g : o)]);
      }
    }
    const Owned back = t.in(QuantLayout::kRows);
    EXPECT_EQ(back.data, m.data);
    EXPECT_EQ(back.scales, m.scales);
    std::vector<float> want(size_t(rows * cols)), got(want.size());
    dequantize(m.view(), want.data());
    dequantize(t.view(), got.data());
    EXPECT_EQ(got, want);
  }
}

// Every ISA, both activation precisions, several batch sizes and thread counts: kTiles gives
// kRows's outputs bit for bit (the int8-activation kernels agree across ISAs too).
TEST(QuantTiles, EveryKernelGivesTheRowsResult) {
  const int threads = omp_get_max_threads();
  for (const FormatCase& fc : kFormats)
    for (const auto& [rows, cols] :
         {std::pair<int64_t, int64_t>{40, 384}, {8, 64}, {96, 2240 / 64 * 64}}) {
      const Owned m = quantized_normal(fc, rows, cols, 5);
      const Owned t = m.in(QuantLayout::kTiles);
      for (int64_t n : {int64_t(1), int64_t(3), int64_t(9)}) {
        const std::vector<float> x = normal(n * cols, 6);
        std::vector<float> want_f32(size_t(n * rows)), want_i8(want_f32.size());
        quant_linear(QuantIsa::kScalar, m.view(), x.data(), n, want_f32.data());
        quant_linear_int8(QuantIsa::kScalar, m.view(), x.data(), n, want_i8.data());
        test::for_each_int8_kernel([&](QuantIsa isa) {
          for (int nth : {1, std::max(2, threads)}) {
            SCOPED_TRACE(std::string(quant_isa_name(isa)) +
                         (int8_activations_vnni(isa) ? "+vnni " : " ") + fc.name + " " +
                         std::to_string(rows) + "x" + std::to_string(cols) +
                         " n=" + std::to_string(n) + " threads " + std::to_string(nth));
            omp_set_num_threads(nth);
            std::vector<float> rows_f32(want_f32.size()), tiles_f32(want_f32.size(), std::nanf(""));
            quant_linear(isa, m.view(), x.data(), n, rows_f32.data());
            quant_linear(isa, t.view(), x.data(), n, tiles_f32.data());
            EXPECT_EQ(tiles_f32, rows_f32);
            std::vector<float> tiles_i8(want_i8.size(), std::nanf(""));
            quant_linear_int8(isa, t.view(), x.data(), n, tiles_i8.data());
            EXPECT_EQ(tiles_i8, want_i8);
          }
        });
      }
    }
  omp_set_num_threads(threads);
}

// A view of rows [r0, r1) that start and end at tile boundaries computes the whole matrix's rows
// r0..r1-1 bit for bit, in either layout, with either activation precision: what a rank that holds
// a row slice of a weight gives back.
TEST(QuantTiles, ARowSliceGivesTheWholeMatrixsRows) {
  const int threads = omp_get_max_threads();
  const int64_t rows = 48, cols = 384;
  for (const FormatCase& fc : kFormats)
    for (QuantLayout layout : {QuantLayout::kRows, QuantLayout::kTiles}) {
      const Owned m = quantized_normal(fc, rows, cols, 7).in(layout);
      for (int64_t n : {int64_t(1), int64_t(3), int64_t(9)}) {
        const std::vector<float> x = normal(n * cols, 8);
        test::for_each_int8_kernel([&](QuantIsa isa) {
          for (bool int8 : {false, true})
            for (int nth : {1, std::max(2, threads)}) {
              omp_set_num_threads(nth);
              const auto product = [&](const QuantMatrixView& w) {
                std::vector<float> y(size_t(n * w.rows), std::nanf(""));
                if (int8)
                  quant_linear_int8(isa, w, x.data(), n, y.data());
                else
                  quant_linear(isa, w, x.data(), n, y.data());
                return y;
              };
              const std::vector<float> whole = product(m.view());
              for (const auto& [r0, r1] :
                   {std::pair<int64_t, int64_t>{0, 16}, {8, 40}, {24, 48}, {40, 48}}) {
                SCOPED_TRACE(std::string(quant_isa_name(isa)) +
                             (int8_activations_vnni(isa) ? "+vnni " : " ") + fc.name +
                             (layout == QuantLayout::kTiles ? " tiles" : " rows") +
                             (int8 ? " int8" : " f32") + " n=" + std::to_string(n) + " rows " +
                             std::to_string(r0) + ".." + std::to_string(r1) + " threads " +
                             std::to_string(nth));
                QuantMatrixView slice = m.view();
                slice.rows = r1 - r0;
                slice.data += r0 * row_bytes(fc.format, cols);
                slice.scales += scale_count(fc.format, r0, cols, fc.group_size);
                const std::vector<float> part = product(slice);
                std::vector<float> want;
                for (int64_t i = 0; i < n; ++i)
                  want.insert(want.end(), whole.begin() + i * rows + r0,
                              whole.begin() + i * rows + r1);
                EXPECT_EQ(part, want);
              }
            }
        });
      }
    }
  omp_set_num_threads(threads);
}

TEST(QuantTiles, ExpertFfnGivesTheRowsResult) {
  const int64_t hidden = 256, inter = 192;
  const int threads = omp_get_max_threads();
  for (const FormatCase& fc : kFormats) {
    const Owned gate = quantized_normal(fc, inter, hidden, 21);
    const Owned up = quantized_normal(fc, inter, hidden, 22);
    const Owned down = quantized_normal(fc, hidden, inter, 23);
    const Owned gate_t = gate.in(QuantLayout::kTiles), up_t = up.in(QuantLayout::kTiles),
                down_t = down.in(QuantLayout::kTiles);
    for (int64_t n : {int64_t(1), int64_t(5)}) {
      const std::vector<float> x = normal(n * hidden, 24);
      test::for_each_int8_kernel([&](QuantIsa isa) {
        for (int nth : {1, std::max(2, threads)}) {
          SCOPED_TRACE(std::string(quant_isa_name(isa)) +
                       (int8_activations_vnni(isa) ? "+vnni " : " ") + fc.name +
                       " n=" + std::to_string(n) + " threads " + std::to_string(nth));
          omp_set_num_threads(nth);
          std::vector<float> want(size_t(n * hidden)), got(want.size(), std::nanf(""));
          quant_expert_ffn(isa, gate.view(), up.view(), down.view(), x.data(), n, want.data());
          quant_expert_ffn(isa, gate_t.view(), up_t.view(), down_t.view(), x.data(), n, got.data());
          EXPECT_EQ(got, want) << "f32 activations";
          quant_expert_ffn_int8(isa, gate.view(), up.view(), down.view(), x.data(), n, want.data());
          std::fill(got.begin(), got.end(), std::nanf(""));
          quant_expert_ffn_int8(isa, gate_t.view(), up_t.view(), down_t.view(), x.data(), n,
                                got.data());
          EXPECT_EQ(got, want) << "int8 activations";
          // Mixed layouts within one FFN.
          std::fill(got.begin(), got.end(), std::nanf(""));
          quant_expert_ffn_int8(isa, gate_t.view(), up.view(), down_t.view(), x.data(), n,
                                got.data());
          EXPECT_EQ(got, want) << "int8 activations, up as rows";
        }
      });
    }
  }
  omp_set_num_threads(threads);
}

// The layout the loaders ask for: tiles exactly where the dispatched int8 kernel reads them as
// they are (the 8-row kernels of AVX2 and AVX-512, not the scalar one).
TEST(QuantTiles, PreferredOnlyWhereReadNatively) {
  const QuantActivations saved = quant_activations_selected();
  const Owned m = quantized_normal(kFormats[1], 16, 128, 7);
  const bool simd = quant_isa_selected() != QuantIsa::kScalar;
  set_quant_activations(QuantActivations::kInt8);
  EXPECT_EQ(tiles_preferred(m.view()), simd);
  set_quant_activations(QuantActivations::kF32);
  EXPECT_FALSE(tiles_preferred(m.view()));
  set_quant_activations(QuantActivations::kInt8);
  const Owned odd = quantized_normal(kFormats[1], 12, 128, 7);
  EXPECT_FALSE(tiles_preferred(odd.view()));
  set_quant_activations(saved);
}

}  // namespace
}  // namespace colibri::kernels
