#include "common/dtype.h"

#include <bit>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>

namespace colibri {
namespace {

struct DtypeInfo {
  Dtype dtype;
  std::string_view name;
  size_t size;
  bool is_float;
};

constexpr DtypeInfo kDtypes[] = {
    {Dtype::BOOL, "BOOL", 1, false},      {Dtype::U8, "U8", 1, false},
    {Dtype::I8, "I8", 1, false},          {Dtype::I16, "I16", 2, false},
    {Dtype::U16, "U16", 2, false},        {Dtype::I32, "I32", 4, false},
    {Dtype::U32, "U32", 4, false},        {Dtype::I64, "I64", 8, false},
    {Dtype::U64, "U64", 8, false},        {Dtype::F16, "F16", 2, true},
    {Dtype::BF16, "BF16", 2, true},       {Dtype::F32, "F32", 4, true},
    {Dtype::F64, "F64", 8, true},         {Dtype::F8_E4M3, "F8_E4M3", 1, true},
    {Dtype::F8_E5M2, "F8_E5M2", 1, true},
};

const DtypeInfo& info(Dtype dtype) {
  for (const auto& entry : kDtypes)
    if (entry.dtype == dtype) return entry;
  assert(false && "every Dtype has an entry");
  return kDtypes[0];
}

template <typename T>
T load_le(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;  // x86-64 and aarch64 Linux are little-endian, like the format.
}

}  // namespace

std::optional<Dtype> parse_dtype(std::string_view name) {
  for (const auto& entry : kDtypes)
    if (entry.name == name) return entry.dtype;
  return std::nullopt;
}

std::string_view dtype_name(Dtype dtype) {
  return info(dtype).name;
}
size_t dtype_size(Dtype dtype) {
  return info(dtype).size;
}
bool is_float_dtype(Dtype dtype) {
  return info(dtype).is_float;
}

float bf16_to_f32(uint16_t bits) {
  return std::bit_cast<float>(uint32_t(bits) << 16);
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = uint32_t(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  const uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

float fp8_e4m3_to_f32(uint8_t bits) {
  const bool negative = bits & 0x80;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -9);  // subnormal: m/8 * 2^-6
  } else {
    magnitude = std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
  }
  return negative ? -magnitude : magnitude;
}

float fp8_e5m2_to_f32(uint8_t bits) {
  return f16_to_f32(uint16_t(bits) << 8);
}

void convert_to_f32(Dtype dtype, const std::byte* src, size_t n, float* dst) {
  switch (dtype) {
    case Dtype::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case Dtype::F64:
      for (size_t i = 0; i < n; ++i) dst[i] = float(load_le<double>(src + 8 * i));
      return;
    case Dtype::BF16:
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_le<uint16_t>(src + 2 * i));
      return;
    case Dtype::F16:
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(load_le<uint16_t>(src + 2 * i));
      return;
    case Dtype::F8_E4M3:
      for (size_t i = 0; i < n; ++i) dst[i] = fp8_e4m3_to_f32(uint8_t(src[i]));
      return;
    case Dtype::F8_E5M2:
      for (size_t i = 0; i < n; ++i) dst[i] = fp8_e5m2_to_f32(uint8_t(src[i]));
      return;
    default:
      assert(false && "convert_to_f32 called on an integer dtype");
  }
}

}  // namespace colibri
