// The block-scaled FP4 MMA path's lane code (kernels/cuda/nvfp4_mma_lanes.cuh) on the host, no
// GPU or CUDA toolkit needed:
//   - the activation quantizer's rounding and recipe against kernels::quantize_nvfp4, bit for bit;
//   - the fragment loaders (rows, columns, tails past the last chunk of 64, the scale registers)
//     through an emulated mma.m16n8k64 against the product of the dequantized operands.
// The emulation is written from the same PTX layout the loaders assume, so this checks their
// indexing against that layout; the layout itself meets the hardware only in
// tests/gpu/nvfp4_mma_cuda_test.cpp (compute capability 12.x).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu/linear.h"
#include "cuda/nvfp4_mma_lanes.cuh"

namespace {

namespace fp4 = colibri::cuda::fp4;
namespace kernels = colibri::kernels;

// Every E4M3 value, the midpoints between neighbours (the ties) and their float neighbours,
// values past 448, zero and negatives: the device's rounding is the CPU's, byte for byte.
TEST(Nvfp4MmaLanes, E4m3RoundingIsTheCpuRecipes) {
  std::vector<float> xs = {0.0f, -0.0f, -1.0f, 448.0f, 449.0f, 464.0f, 1e9f, 1e-12f};
  for (uint32_t b = 0; b < 127; ++b) {
    const float v = fp4::e4m3_value(b);
    xs.push_back(v);
    if (b + 1 < 127) {
      const float mid = (v + fp4::e4m3_value(b + 1)) / 2;
      xs.push_back(mid);
      xs.push_back(std::nextafter(mid, 0.0f));
      xs.push_back(std::nextafter(mid, 1e9f));
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-12.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(exponent(rng)));
  int checked = 0;
  for (float x : xs) {
    ASSERT_EQ(fp4::nearest_e4m3(x), kernels::f32_to_e4m3(x)) << "x = " << x;
    ++checked;
  }
  EXPECT_GT(checked, 20000);
}

TEST(Nvfp4MmaLanes, E2m1RoundingIsTheCpuRecipes) {
  std::vector<float> xs = {0.0f, -0.0f, 6.0f, 7.0f, -100.0f, 0.25f, -0.25f, 0.75f, 5.0f, -5.0f};
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-8.0f, 8.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(uniform(rng));
  for (float m : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f})
    for (float s : {1.0f, -1.0f}) {
      xs.push_back(s * m);
      xs.push_back(s * std::nextafter(m, 0.0f));
      xs.push_back(s * std::nextafter(m, 10.0f));
    }
  for (float x : xs) ASSERT_EQ(fp4::nearest_e2m1(x), kernels::f32_to_e2m1(x)) << "x = " << x;
}

// quantize_block under global_scale(amax) over a whole matrix: kernels::quantize_nvfp4's codes,
// scales and global, with all-zero blocks, tiny blocks and an all-zero matrix.
TEST(Nvfp4MmaLanes, BlockQuantizerIsQuantizeNvfp4) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{37, 208}, {1, 16}, {5, 64}}) {
    std::mt19937 rng(unsigned(rows * 131 + cols));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        x[size_t(r * cols + c)] = normal(rng) * std::exp2(float(r % 9) - 4.0f);
    if (rows > 1) {
      for (int c = 0; c < 16; ++c) x[size_t(cols + c)] = 0.0f;         // a zero block
      for (int c = 16; c < 32; ++c) x[size_t(cols + c)] = 1e-30f * c;  // a tiny one
    }
    for (bool zero : {false, true}) {
      if (zero) std::fill(x.begin(), x.end(), 0.0f);
      std::vector<uint8_t> codes(size_t(rows * cols / 2)), scales(size_t(rows * cols / 16));
      const float global =
          kernels::quantize_nvfp4(x.data(), rows, cols, codes.data(), scales.data());
      float amax = 0.0f;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      const float got_global = fp4::global_scale(amax);
      ASSERT_EQ(got_global, global);
      for (int64_t b = 0; b < rows * cols / 16; ++b) {
        uint8_t out[8];
        const uint32_t scale = fp4::quantize_block(x.data() + b * 16, got_global, out);
        ASSERT_EQ(scale, scales[size_t(b)]) << "block " << b;
        for (int j = 0; j < 8; ++j) ASSERT_EQ(out[j], codes[size_t(b * 8 + j)]) << "block " << b;
      }
    }
  }
}

// Random NVFP4 operands with every E2M1 code and E4M3 scale bytes from 2^-9 (subnormal) to 448.
struct Operand {
  std::vector<uint8_t> codes, scales;
  int64_t rows, cols;
  fp4::Fp4Rows view() const { return {codes.data(), scales.data(), rows, cols}; }
  double value(int64_t r, int64_t c) const {
    const uint8_t byte = codes[size_t(r * cols / 2 + c / 2)];
    return double(fp4::e2m1_value(c % 2 ? byte >> 4 : byte & 15)) *
           fp4::e4m3_value(scales[size_t(r * cols / 16 + c / 16)]);
  }
};

Operand random_operand(int64_t rows, int64_t cols, std::mt19937& rng) {
  Operand m{std::vector<uint8_t>(size_t(rows * cols / 2)),
            std::vector<uint8_t>(size_t(rows * cols / 16)), rows, cols};
  for (uint8_t& c : m.codes) c = uint8_t(rng());
  for (uint8_t& s : m.scales) s = uint8_t(1 + rng() % 126);
  return m;
}

// y [n, rows] through the loaders, the emulated instruction and the accumulator map, one 16 x 8
// tile and chunk of 64 columns at a time, as the kernel walks them; unwritten outputs stay NaN.
std::vector<float> emulated_product(const Operand& w, const Operand& x) {
  std::vector<float> y(size_t(x.rows * w.rows), NAN);
  for (int64_t r0 = 0; r0 < w.rows; r0 += fp4::kTileRows)
    for (int64_t n0 = 0; n0 < x.rows; n0 += fp4::kTileCols) {
      float d[fp4::kWarpSize][4] = {};
      for (int64_t k0 = 0; k0 < w.cols; k0 += fp4::kChunk) {
        uint32_t a[fp4::kWarpSize][4], b[fp4::kWarpSize][2];
        uint32_t scale_a[fp4::kWarpSize], scale_b[fp4::kWarpSize];
        for (int lane = 0; lane < fp4::kWarpSize; ++lane) {
          fp4::load_a(w.view(), r0, k0, lane, a[lane], scale_a[lane]);
          fp4::load_b(x.view(), n0, k0, lane, b[lane], scale_b[lane]);
        }
        fp4::mma_m16n8k64_warp(a, b, scale_a, scale_b, d);
      }
      for (int lane = 0; lane < fp4::kWarpSize; ++lane)
        for (int i = 0; i < 4; ++i) {
          const int64_t r = r0 + fp4::acc_row(lane, i), t = n0 + fp4::acc_col(lane, i);
          if (r < w.rows && t < x.rows) {
            EXPECT_TRUE(std::isnan(y[size_t(t * w.rows + r)])) << "written twice";
            y[size_t(t * w.rows + r)] = d[lane][i];
          }
        }
    }
  return y;
}

// Every output against the exact sum (double) of the dequantized products: within the fp32
// additions of one partial sum a chunk (cols / 64 + 1 roundings), for odd row counts and widths
// with a partial last chunk (16, 32 or 48 columns).
TEST(Nvfp4MmaLanes, FragmentsThroughEmulatedMmaGiveTheDequantizedProduct) {
  for (const auto& [n, rows, cols] : {std::tuple<int64_t, int64_t, int64_t>{17, 37, 208},
                                      {8, 16, 64},
                                      {5, 23, 96},
                                      {3, 40, 48},
                                      {16, 16, 16},
                                      {9, 33, 320}}) {
    std::mt19937 rng(unsigned(n * 1000 + rows * 10 + cols));
    const Operand w = random_operand(rows, cols, rng), x = random_operand(n, cols, rng);
    const std::vector<float> y = emulated_product(w, x);
    double sum_abs = 0;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = 0; r < rows; ++r) {
        double exact = 0, abs_terms = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const double term = w.value(r, c) * x.value(t, c);
          exact += term;
          abs_terms += std::fabs(term);
        }
        const float got = y[size_t(t * rows + r)];
        ASSERT_FALSE(std::isnan(got)) << "y[" << t << ", " << r << "] not written";
        const double bound = double(cols / 64 + 2) * std::ldexp(1.0, -24) * abs_terms;
        ASSERT_LE(std::fabs(got - exact), bound)
            << "n" << n << " rows" << rows << " cols" << cols << ": y[" << t << ", " << r << "]";
        sum_abs += std::fabs(got);
      }
    EXPECT_GT(sum_abs, 0.0) << "all-zero output: the comparison proved nothing";
  }
}

// The grouped FFN's gather (load_b_row: each lane's column is a slot's row of x, a row past x a
// zero column): a tile of slots naming rows out of order and repeated, the last tile partial.
TEST(Nvfp4MmaLanes, GatheredRowsGiveTheProductOfTheRowsNamed) {
  std::mt19937 rng(17);
  const int64_t rows = 16, cols = 80, n_x = 11, n_slots = 13;
  const Operand w = random_operand(rows, cols, rng), x = random_operand(n_x, cols, rng);
  std::vector<int64_t> slot_row(static_cast<size_t>(n_slots));
  for (int64_t& r : slot_row) r = int64_t(rng() % uint32_t(n_x));
  for (int64_t s0 = 0; s0 < n_slots; s0 += fp4::kTileCols) {
    float d[fp4::kWarpSize][4] = {};
    for (int64_t k0 = 0; k0 < cols; k0 += fp4::kChunk) {
      uint32_t a[fp4::kWarpSize][4], b[fp4::kWarpSize][2];
      uint32_t scale_a[fp4::kWarpSize], scale_b[fp4::kWarpSize];
      for (int lane = 0; lane < fp4::kWarpSize; ++lane) {
        const int64_t slot = s0 + lane / 4;
        fp4::load_a(w.view(), 0, k0, lane, a[lane], scale_a[lane]);
        fp4::load_b_row(x.view(), slot < n_slots ? slot_row[size_t(slot)] : x.rows, k0, lane,
                        b[lane], scale_b[lane]);
      }
      fp4::mma_m16n8k64_warp(a, b, scale_a, scale_b, d);
    }
    for (int lane = 0; lane < fp4::kWarpSize; ++lane)
      for (int i = 0; i < 4; ++i) {
        const int64_t r = fp4::acc_row(lane, i), slot = s0 + fp4::acc_col(lane, i);
        double exact = 0, abs_terms = 0;
        for (int64_t c = 0; c < cols && slot < n_slots; ++c) {
          const double term = w.value(r, c) * x.value(slot_row[size_t(slot)], c);
          exact += term;
          abs_terms += std::fabs(term);
        }
        if (slot >= n_slots) {
          ASSERT_EQ(d[lane][i], 0.0f) << "a slot past the tile's end read a row";
          continue;
        }
        ASSERT_GT(abs_terms, 0.0);
        ASSERT_LE(std::fabs(d[lane][i] - exact), 4 * std::ldexp(1.0, -24) * abs_terms)
            << "slot " << slot << " (row " << slot_row[size_t(slot)] << "), weight row " << r;
      }
  }
}

// A scale byte moved to the wrong register byte or lane changes the product: the check above
// can fail (one block's scale doubled, every output that reads it moves).
TEST(Nvfp4MmaLanes, AWrongScaleIsSeen) {
  std::mt19937 rng(3);
  Operand w = random_operand(16, 64, rng);
  const Operand x = random_operand(8, 64, rng);
  for (uint8_t& c : w.codes) c = 0x22;  // every weight 1.0 * scale
  w.scales[size_t(5 * 4 + 2)] = 0x30;   // row 5, block 2: 0.5
  const std::vector<float> before = emulated_product(w, x);
  w.scales[size_t(5 * 4 + 2)] = 0x38;  // 1.0
  const std::vector<float> after = emulated_product(w, x);
  int changed = 0;
  for (size_t i = 0; i < before.size(); ++i) changed += before[i] != after[i];
  EXPECT_GT(changed, 0);
  for (int64_t t = 0; t < 8; ++t)
    for (int64_t r = 0; r < 16; ++r) {
      if (r == 5) continue;
      EXPECT_EQ(before[size_t(t * 16 + r)], after[size_t(t * 16 + r)]) << "row " << r;
    }
}

}  // namespace
