#include "common/buffer.h"

#include <cstring>

#include "common/dtype.h"
#include "common/error.h"

namespace colibri {

size_t elem_bytes(ElemType type) {
  return type == ElemType::kBF16 ? 2 : 4;
}

const char* elem_type_name(ElemType type) {
  return type == ElemType::kBF16 ? "bf16" : "f32";
}

ElemType parse_elem_type(const std::string& name, const std::string& what) {
  if (name == "f32") return ElemType::kF32;
  if (name == "bf16") return ElemType::kBF16;
  fail("{} '{}' must be f32 or bf16", what, name);
}

uint16_t f32_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu))
    return uint16_t((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

void to_f32(const ConstView& src, float* dst) {
  if (src.device != Device::kHost) fail("to_f32: only host buffers can be converted here");
  if (src.type == ElemType::kF32) {
    std::memcpy(dst, src.data, src.count * sizeof(float));
    return;
  }
  const auto* in = static_cast<const uint16_t*>(src.data);
  for (size_t i = 0; i < src.count; ++i) dst[i] = bf16_to_f32(in[i]);
}

void from_f32(const float* src, size_t count, ElemType type, void* dst) {
  if (type == ElemType::kF32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  auto* out = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < count; ++i) out[i] = f32_to_bf16(src[i]);
}

Buffer::Buffer(ElemType type, size_t capacity, Device device)
    : storage_(new std::byte[capacity * elem_bytes(type)]),
      type_(type),
      device_(device),
      capacity_(capacity) {
  if (device != Device::kHost) fail("Buffer: device memory needs the CUDA backend");
}

ConstView Buffer::view(size_t offset, size_t count) const {
  return {storage_.get() + offset * elem_bytes(type_), type_, device_, count};
}

}  // namespace colibri
