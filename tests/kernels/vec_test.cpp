// fp32 vector primitives on every ISA this machine has, against the scalar references: exact on
// small integers (every partial sum is exact, whatever the order), within a rounding bound on
// random data, for lengths covering every tail of every vector width.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "cpu/linear.h"

namespace colibri::kernels {
namespace {

std::vector<QuantIsa> available_isas() {
  std::vector<QuantIsa> out;
  for (QuantIsa isa : {QuantIsa::kScalar, QuantIsa::kAvx2, QuantIsa::kAvx512})
    if (quant_isa_available(isa)) out.push_back(isa);
  return out;
}

TEST(Vec, DotAndAxpyMatchTheScalarReferenceOnEveryIsa) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-8, 8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int checked = 0;
  for (QuantIsa isa : available_isas()) {
    for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 192, 512, 1031}) {
      const size_t len = static_cast<size_t>(n);
      std::vector<float> a(len), b(len), y(len), y_ref(len);
      // Integers: the sum is exact in any order.
      for (int64_t i = 0; i < n; ++i) {
        a[size_t(i)] = float(small(rng));
        b[size_t(i)] = float(small(rng));
        y[size_t(i)] = y_ref[size_t(i)] = float(small(rng));
      }
      EXPECT_EQ(dot_f32(isa, a.data(), b.data(), n), dot_f32_scalar(a.data(), b.data(), n))
          << quant_isa_name(isa) << " n " << n;
      axpy_f32(isa, 3.0f, a.data(), y.data(), n);
      axpy_f32_scalar(3.0f, a.data(), y_ref.data(), n);
      EXPECT_EQ(y, y_ref) << quant_isa_name(isa) << " n " << n;
      // Random data: within n * eps of the sum of magnitudes (reassociation, FMA rounding).
      double magnitude = 0;
      for (int64_t i = 0; i < n; ++i) {
        a[size_t(i)] = normal(rng);
        b[size_t(i)] = normal(rng);
        magnitude += std::abs(double(a[size_t(i)]) * b[size_t(i)]);
      }
      const float got = dot_f32(isa, a.data(), b.data(), n);
      const float want = dot_f32_scalar(a.data(), b.data(), n);
      EXPECT_LE(std::abs(double(got) - want), double(n + 1) * 1.2e-7 * magnitude + 1e-30)
          << quant_isa_name(isa) << " n " << n;
      ++checked;
    }
  }
  EXPECT_GE(checked, 18);  // at least the scalar ISA ran every length
}

// Several rows of a against one b: each result is that ISA's dot_f32, bit for bit, for every
// row count (groups of three and the remainders) and length (every tail).
TEST(Vec, DotRowsEqualsOneDotPerRow) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (QuantIsa isa : available_isas())
    for (int64_t n : {0, 1, 7, 8, 31, 32, 33, 64, 65, 512, 576, 1031})
      for (int64_t count : {0, 1, 2, 3, 4, 5, 7, 8}) {
        std::vector<std::vector<float>> rows(static_cast<size_t>(count),
                                             std::vector<float>(static_cast<size_t>(n)));
        std::vector<const float*> a;
        for (auto& row : rows) {
          for (float& v : row) v = normal(rng);
          a.push_back(row.data());
        }
        std::vector<float> b(static_cast<size_t>(n)),
            out(static_cast<size_t>(count), std::nanf(""));
        for (float& v : b) v = normal(rng);
        dot_f32_rows(isa, a.data(), count, b.data(), n, out.data());
        for (int64_t j = 0; j < count; ++j)
          EXPECT_EQ(out[size_t(j)], dot_f32(isa, a[size_t(j)], b.data(), n))
              << quant_isa_name(isa) << " n " << n << " rows " << count << " row " << j;
        if (isa == quant_isa_selected()) {
          std::vector<float> selected(size_t(count), std::nanf(""));
          dot_f32_rows(a.data(), count, b.data(), n, selected.data());
          EXPECT_EQ(selected, out) << "n " << n << " rows " << count;
        }
      }
}

TEST(Vec, LinearIsOneDotPerOutput) {
  const int64_t n = 3, rows = 5, cols = 37;
  std::vector<float> x(size_t(n * cols)), w(size_t(rows * cols)), y(size_t(n * rows));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 7) - 3);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(int(i % 5) - 2);
  linear_f32(x.data(), n, w.data(), rows, cols, y.data());
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < rows; ++r)
      EXPECT_EQ(y[size_t(t * rows + r)], dot_f32(x.data() + t * cols, w.data() + r * cols, cols));
}

// BF16 weights widened in registers: bit for bit the fp32 kernels on the widened values, on every
// ISA and length (blocks of 64, 16 and 8, masked and scalar tails).
TEST(Vec, Bf16DotAndLinearEqualFp32OnTheWidenedWeights) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto widen = [](uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
  };
  for (QuantIsa isa : available_isas())
    for (int64_t n : {1, 7, 8, 15, 16, 17, 31, 64, 65, 100, 129, 1000}) {
      std::vector<float> a(static_cast<size_t>(n)), wide(static_cast<size_t>(n));
      std::vector<uint16_t> b(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        a[size_t(i)] = normal(rng);
        uint32_t bits;
        const float v = normal(rng);
        std::memcpy(&bits, &v, 4);
        b[size_t(i)] = uint16_t(bits >> 16);
        wide[size_t(i)] = widen(b[size_t(i)]);
      }
      EXPECT_EQ(dot_bf16(isa, a.data(), b.data(), n), dot_f32(isa, a.data(), wide.data(), n))
          << quant_isa_name(isa) << " n " << n;
    }
  const int64_t n = 3, rows = 9, cols = 130;
  std::vector<float> x(size_t(n * cols)), wide(size_t(rows * cols)), y(size_t(n * rows)),
      want(y.size());
  std::vector<uint16_t> w(size_t(rows * cols));
  for (float& v : x) v = normal(rng);
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = uint16_t(0x3C00 + (rng() % 0x0800)) ^ uint16_t(rng() % 2 ? 0x8000 : 0);
    wide[i] = widen(w[i]);
  }
  linear_bf16(x.data(), n, w.data(), rows, cols, y.data());
  linear_f32(x.data(), n, wide.data(), rows, cols, want.data());
  EXPECT_EQ(y, want);
}

// FP8 E4M3 weights with 128-column block scales, widened and scaled in registers: bit for bit the
// fp32 kernels on the loader's dequantization (common/dtype's decoder times the scale), on every
// ISA and length, for every finite byte (subnormals, both zeros, the largest 448) and scales that
// change at every block.
TEST(Vec, Fp8DotAndLinearEqualFp32OnTheDequantizedWeights) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto random_byte = [&] {
    for (;;) {
      const auto b = uint8_t(rng());
      if ((b & 0x7F) != 0x7F) return b;  // not a NaN
    }
  };
  int checked = 0;
  for (QuantIsa isa : available_isas())
    for (int64_t n : {1, 15, 16, 17, 64, 100, 128, 129, 255, 256, 1000}) {
      const int64_t block = n % 3 == 0 ? 48 : n > 200 ? 64 : 128;  // 48: not a power of two
      const auto len = static_cast<size_t>(n);
      std::vector<float> a(len), wide(len), scales(static_cast<size_t>((n + block - 1) / block));
      std::vector<uint8_t> b(len);
      for (float& s : scales) s = std::abs(normal(rng)) * 1e-2f + 1e-4f;
      for (int64_t i = 0; i < n; ++i) {
        a[size_t(i)] = normal(rng);
        b[size_t(i)] = i < 256 ? uint8_t(i ^ 0x55) : random_byte();
        if ((b[size_t(i)] & 0x7F) == 0x7F) b[size_t(i)] = 0x00;
        wide[size_t(i)] = fp8_e4m3_to_f32(b[size_t(i)]) * scales[size_t(i / block)];
      }
      EXPECT_EQ(dot_fp8(isa, a.data(), b.data(), scales.data(), block, n),
                dot_f32(isa, a.data(), wide.data(), n))
          << quant_isa_name(isa) << " n " << n;
      ++checked;
    }
  EXPECT_GE(checked, 11);
  EXPECT_THROW(dot_fp8(QuantIsa::kScalar, nullptr, nullptr, nullptr, 24, 0), std::invalid_argument);

  // Blocks of 128 x 128, partial ones at the edges.
  const int64_t n = 3, rows = 130, cols = 272, br = 128, bc = 128;
  const int64_t scale_cols = (cols + bc - 1) / bc;
  std::vector<float> x(size_t(n * cols)), wide(size_t(rows * cols)), y(size_t(n * rows)),
      want(y.size()), scales(size_t(((rows + br - 1) / br) * scale_cols));
  std::vector<uint8_t> w(size_t(rows * cols));
  for (float& v : x) v = normal(rng);
  for (float& s : scales) s = std::abs(normal(rng)) + 0.25f;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const size_t k = size_t(i * cols + j);
      w[k] = random_byte();
      wide[k] = fp8_e4m3_to_f32(w[k]) * scales[size_t((i / br) * scale_cols + j / bc)];
    }
  linear_fp8(x.data(), n, {w.data(), scales.data(), rows, cols, br, bc}, y.data());
  linear_f32(x.data(), n, wide.data(), rows, cols, want.data());
  EXPECT_EQ(y, want);
}

// kv_b_proj's rows as stored: BF16 and int8 operands converted exactly, then the fp32 kernels'
// operations, so bit for bit the fp32 kernels on the converted values.
TEST(Vec, Bf16AndInt8RowPrimitivesEqualFp32OnTheConvertedValues) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (QuantIsa isa : available_isas())
    for (int64_t n : {1, 7, 8, 15, 16, 17, 33, 64, 65, 130, 512}) {
      std::vector<float> y0(static_cast<size_t>(n)), b(y0.size()), wide_bf16(y0.size()),
          wide_i8(y0.size());
      std::vector<uint16_t> x_bf16(y0.size());
      std::vector<int8_t> x_i8(y0.size());
      for (size_t i = 0; i < y0.size(); ++i) {
        y0[i] = normal(rng);
        b[i] = normal(rng);
        const float v = normal(rng);
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        x_bf16[i] = uint16_t(bits >> 16);
        bits = uint32_t(x_bf16[i]) << 16;
        std::memcpy(&wide_bf16[i], &bits, 4);
        x_i8[i] = int8_t(int(rng() % 255) - 127);
        wide_i8[i] = float(x_i8[i]);
      }
      const float alpha = normal(rng);
      std::vector<float> got = y0, want = y0;
      axpy_bf16(isa, alpha, x_bf16.data(), got.data(), n);
      axpy_f32(isa, alpha, wide_bf16.data(), want.data(), n);
      EXPECT_EQ(got, want) << quant_isa_name(isa) << " axpy_bf16 n " << n;
      got = y0;
      want = y0;
      axpy_i8(isa, alpha, x_i8.data(), got.data(), n);
      axpy_f32(isa, alpha, wide_i8.data(), want.data(), n);
      EXPECT_EQ(got, want) << quant_isa_name(isa) << " axpy_i8 n " << n;
      EXPECT_EQ(dot_i8(isa, x_i8.data(), b.data(), n), dot_f32(isa, b.data(), wide_i8.data(), n))
          << quant_isa_name(isa) << " dot_i8 n " << n;
    }
}

// The DSA index scores (keys gathered out of order, K-key tiles and their tails, one or more
// 16-head groups and an 8-head rest) against the scalar reference: exact on small integers, within
// a rounding bound on random data.
TEST(Vec, IndexScoresMatchTheScalarReferenceOnEveryIsa) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> small(-4, 4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows_total = 40;
  for (QuantIsa isa : available_isas())
    for (int64_t heads : {8, 16, 24, 32})
      for (int64_t dim : {1, 7, 64, 128})
        for (int64_t count : {0, 1, 3, 4, 5, 9, 33})
          for (const bool integers : {true, false}) {
            const auto value = [&] { return integers ? float(small(rng)) : normal(rng); };
            std::vector<float> q_t(size_t(dim * heads)), weights(static_cast<size_t>(heads));
            std::vector<float> keys(size_t(rows_total * dim));
            for (float& v : q_t) v = value();
            for (float& v : weights) v = value();
            for (float& v : keys) v = value();
            std::vector<int32_t> rows(static_cast<size_t>(count));
            for (int64_t i = 0; i < count; ++i) rows[size_t(i)] = int32_t((7 * i + 5) % rows_total);
            const IndexQuery q{q_t.data(), weights.data(), heads, dim, 0.25f};
            std::vector<float> got(size_t(count) + 1, -1.0f), want(static_cast<size_t>(count));
            index_scores(isa, q, keys.data(), rows.data(), count, got.data());
            index_scores_scalar(q, keys.data(), rows.data(), count, want.data());
            EXPECT_EQ(got[size_t(count)], -1.0f) << "wrote past the last score";
            for (int64_t i = 0; i < count; ++i) {
              const std::string where = std::string(quant_isa_name(isa)) + " heads " +
                                        std::to_string(heads) + " dim " + std::to_string(dim) +
                                        " key " + std::to_string(i);
              if (integers) {  // every product and partial sum is exact, whatever the order
                EXPECT_EQ(got[size_t(i)], want[size_t(i)]) << where;
                continue;
              }
              double magnitude = 0;
              for (int64_t h = 0; h < heads; ++h)
                for (int64_t d = 0; d < dim; ++d)
                  magnitude +=
                      std::abs(double(weights[size_t(h)]) * 0.25 * q_t[size_t(d * heads + h)] *
                               keys[size_t(rows[size_t(i)] * dim + d)]);
              EXPECT_LE(std::abs(double(got[size_t(i)]) - want[size_t(i)]),
                        double(dim + heads + 2) * 1.2e-7 * magnitude + 1e-30)
                  << where;
            }
          }
  const std::vector<float> one(8, 1.0f);
  const IndexQuery odd{one.data(), one.data(), 7, 1, 1.0f};
  const int32_t row = 0;
  float out = 0;
  EXPECT_THROW(index_scores(QuantIsa::kScalar, odd, one.data(), &row, 1, &out),
               std::invalid_argument);
}

// axpy_rows (the absorbed attention's W_UK product for a whole batch, and its value sums over
// gathered keys): bit for bit the same axpy calls one row of y at a time, for fp32, BF16 and int8
// rows, partial tiles and tails, rows of x in order or gathered out of order.
TEST(Vec, AxpyRowsEqualsOneAxpyCallPerRowAndTerm) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t n : {1, 3, 4, 5, 9})
    for (int64_t k : {1, 7, 64})
      for (int64_t m : {16, 50, 64, 130, 512}) {
        std::vector<float> alpha(static_cast<size_t>(n * (k + 3))),
            y0(static_cast<size_t>(n * (m + 5)));
        std::vector<float> x32(static_cast<size_t>(k * m)), scale(static_cast<size_t>(k));
        std::vector<uint16_t> x16(x32.size());
        std::vector<int8_t> x8(x32.size());
        for (float& v : alpha) v = normal(rng);
        for (float& v : y0) v = normal(rng);
        for (float& v : scale) v = 0.01f * (1.0f + std::abs(normal(rng)));
        for (size_t i = 0; i < x32.size(); ++i) {
          x32[i] = normal(rng);
          uint32_t bits;
          std::memcpy(&bits, &x32[i], 4);
          x16[i] = uint16_t(bits >> 16);
          x8[i] = int8_t(int(rng() % 255) - 127);
        }
        // Gathered: term j reads row (5 j + 3) mod k, every row once, out of order.
        std::vector<int32_t> rows(static_cast<size_t>(k));
        for (int64_t j = 0; j < k; ++j) rows[size_t(j)] = int32_t((5 * j + 3) % k);
        const auto check = [&](const char* what, const float* x_scale, auto run, auto one) {
          const int32_t* gathered = rows.data();
          for (const int32_t* x_rows : {static_cast<const int32_t*>(nullptr), gathered}) {
            std::vector<float> got = y0, want = y0;
            AxpyRows a{alpha.data(), k + 3, n, k, m, x_scale, got.data(), m + 5, x_rows};
            run(a);
            for (int64_t t = 0; t < n; ++t)
              for (int64_t j = 0; j < k; ++j) {
                const float al = x_scale ? alpha[size_t(t * (k + 3) + j)] * x_scale[j]
                                         : alpha[size_t(t * (k + 3) + j)];
                one(al, x_rows ? x_rows[j] : j, want.data() + t * (m + 5));
              }
            EXPECT_EQ(got, want) << what << " n " << n << " k " << k << " m " << m
                                 << (x_rows ? " gathered" : "");
          }
        };
        check(
            "f32", nullptr, [&](const AxpyRows& a) { axpy_rows_f32(a, x32.data()); },
            [&](float al, int64_t j, float* y) { axpy_f32(al, x32.data() + j * m, y, m); });
        check(
            "bf16", nullptr, [&](const AxpyRows& a) { axpy_rows_bf16(a, x16.data()); },
            [&](float al, int64_t j, float* y) { axpy_bf16(al, x16.data() + j * m, y, m); });
        check(
            "int8", scale.data(), [&](const AxpyRows& a) { axpy_rows_i8(a, x8.data()); },
            [&](float al, int64_t j, float* y) { axpy_i8(al, x8.data() + j * m, y, m); });
      }
}

}  // namespace
}  // namespace colibri::kernels
