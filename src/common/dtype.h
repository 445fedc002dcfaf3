// Element types of safetensors files and their conversion to float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace colibri {

enum class Dtype : uint8_t {
  BOOL,
  U8,
  I8,
  I16,
  U16,
  I32,
  U32,
  I64,
  U64,
  F16,
  BF16,
  F32,
  F64,
  F8_E4M3,
  F8_E5M2
};

std::optional<Dtype> parse_dtype(std::string_view name);
std::string_view dtype_name(Dtype dtype);
size_t dtype_size(Dtype dtype);
bool is_float_dtype(Dtype dtype);

float bf16_to_f32(uint16_t bits);
float f16_to_f32(uint16_t bits);
float fp8_e4m3_to_f32(uint8_t bits);  // torch.float8_e4m3fn: no inf, NaN = S.1111.111, max 448
float fp8_e5m2_to_f32(uint8_t bits);

// Converts n little-endian elements of a float dtype to float32. `src` may be unaligned.
void convert_to_f32(Dtype dtype, const std::byte* src, size_t n, float* dst);

}  // namespace colibri
