// Element-type conversions to float32: hand-checked values, exhaustive comparison with an
// independent formula, and golden values computed by torch (tests/data/dtypes/).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <vector>

#include "common/dtype.h"

namespace colibri {
namespace {

// Bit-exact equality (tells +0 from -0); any NaN matches any NaN.
::testing::AssertionResult same_float(float expected, float actual) {
  if (std::isnan(expected) && std::isnan(actual)) return ::testing::AssertionSuccess();
  if (std::bit_cast<uint32_t>(expected) == std::bit_cast<uint32_t>(actual))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "expected " << expected << " (0x" << std::hex << std::bit_cast<uint32_t>(expected)
         << "), got " << actual << " (0x" << std::bit_cast<uint32_t>(actual) << ")";
}

// Sign, exponent and mantissa fields evaluated with ldexp: an implementation independent of the
// bit tricks in dtype.cpp. `has_inf`: an all-ones exponent is inf/NaN (IEEE); otherwise only
// the all-ones pattern is NaN (float8_e4m3fn).
float decode_formula(uint32_t bits, int exponent_bits, int mantissa_bits, bool has_inf) {
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const bool negative = (bits >> (exponent_bits + mantissa_bits)) & 1;
  const int exponent = int((bits >> mantissa_bits) & ((1u << exponent_bits) - 1));
  const uint32_t mantissa = bits & ((1u << mantissa_bits) - 1);
  const int max_exponent = (1 << exponent_bits) - 1;
  float magnitude;
  if (has_inf && exponent == max_exponent) {
    magnitude =
        mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else if (!has_inf && exponent == max_exponent && mantissa == (1u << mantissa_bits) - 1) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = float(std::ldexp(double(mantissa), 1 - bias - mantissa_bits));
  } else {
    magnitude = float(
        std::ldexp(double(mantissa + (1u << mantissa_bits)), exponent - bias - mantissa_bits));
  }
  return negative ? -magnitude : magnitude;
}

TEST(Dtype, Fp8E4m3HandChecked) {
  EXPECT_TRUE(same_float(0.0f, fp8_e4m3_to_f32(0x00)));
  EXPECT_TRUE(same_float(-0.0f, fp8_e4m3_to_f32(0x80)));
  EXPECT_TRUE(same_float(0x1p-9f, fp8_e4m3_to_f32(0x01)));  // smallest subnormal
  EXPECT_TRUE(same_float(0x7p-9f, fp8_e4m3_to_f32(0x07)));  // largest subnormal
  EXPECT_TRUE(same_float(0x1p-6f, fp8_e4m3_to_f32(0x08)));  // smallest normal
  EXPECT_TRUE(same_float(1.0f, fp8_e4m3_to_f32(0x38)));
  EXPECT_TRUE(same_float(1.125f, fp8_e4m3_to_f32(0x39)));
  EXPECT_TRUE(same_float(-2.0f, fp8_e4m3_to_f32(0xc0)));
  EXPECT_TRUE(same_float(256.0f, fp8_e4m3_to_f32(0x78)));  // e4m3fn has no inf
  EXPECT_TRUE(same_float(448.0f, fp8_e4m3_to_f32(0x7e)));  // max
  EXPECT_TRUE(same_float(-448.0f, fp8_e4m3_to_f32(0xfe)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xff)));
}

TEST(Dtype, F16HandChecked) {
  EXPECT_TRUE(same_float(0.0f, f16_to_f32(0x0000)));
  EXPECT_TRUE(same_float(-0.0f, f16_to_f32(0x8000)));
  EXPECT_TRUE(same_float(0x1p-24f, f16_to_f32(0x0001)));
  EXPECT_TRUE(same_float(0x3ffp-24f, f16_to_f32(0x03ff)));
  EXPECT_TRUE(same_float(0x1p-14f, f16_to_f32(0x0400)));
  EXPECT_TRUE(same_float(1.0f, f16_to_f32(0x3c00)));
  EXPECT_TRUE(same_float(-2.0f, f16_to_f32(0xc000)));
  EXPECT_TRUE(same_float(65504.0f, f16_to_f32(0x7bff)));
  EXPECT_TRUE(same_float(std::numeric_limits<float>::infinity(), f16_to_f32(0x7c00)));
  EXPECT_TRUE(same_float(-std::numeric_limits<float>::infinity(), f16_to_f32(0xfc00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7c01)));  // signalling NaN stays NaN, not inf
}

TEST(Dtype, Bf16HandChecked) {
  EXPECT_TRUE(same_float(1.0f, bf16_to_f32(0x3f80)));
  EXPECT_TRUE(same_float(-1.0f, bf16_to_f32(0xbf80)));
  EXPECT_TRUE(same_float(-0.0f, bf16_to_f32(0x8000)));
  EXPECT_TRUE(same_float(3.140625f, bf16_to_f32(0x4049)));
  EXPECT_TRUE(same_float(0x1p-133f, bf16_to_f32(0x0001)));  // float subnormal
  EXPECT_TRUE(same_float(std::numeric_limits<float>::infinity(), bf16_to_f32(0x7f80)));
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7fc0)));
}

TEST(Dtype, Fp8E5m2HandChecked) {
  EXPECT_TRUE(same_float(1.0f, fp8_e5m2_to_f32(0x3c)));
  EXPECT_TRUE(same_float(57344.0f, fp8_e5m2_to_f32(0x7b)));
  EXPECT_TRUE(same_float(0x1p-16f, fp8_e5m2_to_f32(0x01)));
  EXPECT_TRUE(same_float(-std::numeric_limits<float>::infinity(), fp8_e5m2_to_f32(0xfc)));
  EXPECT_TRUE(std::isnan(fp8_e5m2_to_f32(0x7d)));
}

TEST(Dtype, EveryBitPatternMatchesFormula) {
  for (uint32_t b = 0; b < 256; ++b) {
    EXPECT_TRUE(same_float(decode_formula(b, 4, 3, false), fp8_e4m3_to_f32(uint8_t(b))))
        << "e4m3 " << b;
    EXPECT_TRUE(same_float(decode_formula(b, 5, 2, true), fp8_e5m2_to_f32(uint8_t(b))))
        << "e5m2 " << b;
  }
  int mismatches = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    mismatches += !same_float(decode_formula(b, 5, 10, true), f16_to_f32(uint16_t(b)));
    mismatches += !same_float(decode_formula(b, 8, 7, true), bf16_to_f32(uint16_t(b)));
  }
  EXPECT_EQ(mismatches, 0);
}

std::vector<char> read_golden(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

template <typename T>
std::vector<T> as_vector(const std::vector<char>& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

const std::filesystem::path kGoldenDir = std::filesystem::path(COLIBRI_TEST_DATA) / "dtypes";

TEST(DtypeGolden, Fp8E4m3AllBytesMatchTorch) {
  const auto path = kGoldenDir / "fp8_e4m3.f32";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "golden file " << path << " not generated";
  const auto expected = as_vector<float>(read_golden(path));
  ASSERT_EQ(expected.size(), 256u) << path;
  for (uint32_t b = 0; b < 256; ++b)
    EXPECT_TRUE(same_float(expected[b], fp8_e4m3_to_f32(uint8_t(b)))) << "byte 0x" << std::hex << b;
}

void check_16bit_golden(const char* stem, float (*convert)(uint16_t)) {
  const auto bits_path = kGoldenDir / (std::string(stem) + ".bin");
  const auto values_path = kGoldenDir / (std::string(stem) + ".f32");
  if (!std::filesystem::exists(bits_path) || !std::filesystem::exists(values_path))
    GTEST_SKIP() << "golden files " << bits_path << " / " << values_path << " not generated";
  const auto bits = as_vector<uint16_t>(read_golden(bits_path));
  const auto expected = as_vector<float>(read_golden(values_path));
  ASSERT_EQ(bits.size(), expected.size());
  ASSERT_GE(bits.size(), 16u) << "golden file too short to mean anything";
  for (size_t i = 0; i < bits.size(); ++i)
    EXPECT_TRUE(same_float(expected[i], convert(bits[i]))) << stem << " 0x" << std::hex << bits[i];
}

TEST(DtypeGolden, Bf16MatchesTorch) {
  check_16bit_golden("bf16", bf16_to_f32);
}
TEST(DtypeGolden, F16MatchesTorch) {
  check_16bit_golden("f16", f16_to_f32);
}

TEST(Dtype, ConvertToF32ReadsUnalignedLittleEndian) {
  // One byte of offset so that no multi-byte element is aligned.
  std::vector<std::byte> buffer(1 + 3 * 8);
  std::byte* src = buffer.data() + 1;
  float out[3];

  const uint16_t bf16[] = {0x3f80, 0xc000, 0x4049};
  std::memcpy(src, bf16, sizeof bf16);
  convert_to_f32(Dtype::BF16, src, 3, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], 3.140625f);

  const uint16_t f16[] = {0x3c00, 0x0001, 0xfc00};
  std::memcpy(src, f16, sizeof f16);
  convert_to_f32(Dtype::F16, src, 3, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 0x1p-24f);
  EXPECT_EQ(out[2], -std::numeric_limits<float>::infinity());

  const float f32[] = {0.5f, -7.25f, 1e30f};
  std::memcpy(src, f32, sizeof f32);
  convert_to_f32(Dtype::F32, src, 3, out);
  EXPECT_EQ(out[0], 0.5f);
  EXPECT_EQ(out[1], -7.25f);
  EXPECT_EQ(out[2], 1e30f);

  const double f64[] = {0.1, -3.0, 65536.5};
  std::memcpy(src, f64, sizeof f64);
  convert_to_f32(Dtype::F64, src, 3, out);
  EXPECT_EQ(out[0], 0.1f);
  EXPECT_EQ(out[1], -3.0f);
  EXPECT_EQ(out[2], 65536.5f);

  const uint8_t fp8[] = {0x7e, 0x01, 0xb8};
  std::memcpy(src, fp8, sizeof fp8);
  convert_to_f32(Dtype::F8_E4M3, src, 3, out);
  EXPECT_EQ(out[0], 448.0f);
  EXPECT_EQ(out[1], 0x1p-9f);
  EXPECT_EQ(out[2], -1.0f);
}

TEST(Dtype, NamesAndSizes) {
  struct Case {
    const char* name;
    Dtype dtype;
    size_t size;
    bool is_float;
  };
  const Case cases[] = {{"BOOL", Dtype::BOOL, 1, false},      {"U8", Dtype::U8, 1, false},
                        {"I32", Dtype::I32, 4, false},        {"I64", Dtype::I64, 8, false},
                        {"F16", Dtype::F16, 2, true},         {"BF16", Dtype::BF16, 2, true},
                        {"F32", Dtype::F32, 4, true},         {"F64", Dtype::F64, 8, true},
                        {"F8_E4M3", Dtype::F8_E4M3, 1, true}, {"F8_E5M2", Dtype::F8_E5M2, 1, true}};
  for (const Case& c : cases) {
    ASSERT_EQ(parse_dtype(c.name), c.dtype) << c.name;
    EXPECT_EQ(dtype_name(c.dtype), c.name);
    EXPECT_EQ(dtype_size(c.dtype), c.size) << c.name;
    EXPECT_EQ(is_float_dtype(c.dtype), c.is_float) << c.name;
  }
  EXPECT_FALSE(parse_dtype("f32"));  // names are case-sensitive, as in the format
  EXPECT_FALSE(parse_dtype("F8_E4M3FN"));
  EXPECT_FALSE(parse_dtype(""));
}

}  // namespace
}  // namespace colibri
