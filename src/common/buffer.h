// Buffers that know where they live and what they hold: the element type a transport carries on
// the wire (fp32, or bf16 to halve the bytes) and the device (host memory today; CUDA device
// memory is the next device). Conversions between element types are explicit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace colibri {

enum class Device : uint8_t { kHost, kCuda };
enum class ElemType : uint8_t { kF32, kBF16 };

size_t elem_bytes(ElemType type);
const char* elem_type_name(ElemType type);
// "f32" or "bf16"; anything else is an Error naming `what`.
ElemType parse_elem_type(const std::string& name, const std::string& what);

// Round to nearest even, as torch does; NaN stays NaN.
uint16_t f32_to_bf16(float value);

// A non-owning view of `count` elements.
struct ConstView {
  const void* data = nullptr;
  ElemType type = ElemType::kF32;
  Device device = Device::kHost;
  size_t count = 0;
  size_t bytes() const { return count * elem_bytes(type); }
};

// A non-owning mutable view of `count` elements.
struct View {
  void* data = nullptr;
  ElemType type = ElemType::kF32;
  Device device = Device::kHost;
  size_t count = 0;
  size_t bytes() const { return count * elem_bytes(type); }
  operator ConstView() const { return {data, type, device, count}; }
};

inline ConstView host_f32(const float* data, size_t count) {
  return {data, ElemType::kF32, Device::kHost, count};
}
inline View host_f32(float* data, size_t count) {
  return {data, ElemType::kF32, Device::kHost, count};
}

// dst[count] = src converted to fp32. Host views only.
void to_f32(const ConstView& src, float* dst);
// dst (of element type `type`) = src[count]. Host only.
void from_f32(const float* src, size_t count, ElemType type, void* dst);

// An owning host allocation of `capacity` elements of one type; pages are touched on first use.
class Buffer {
 public:
  Buffer() = default;
  Buffer(ElemType type, size_t capacity, Device device = Device::kHost);

  void* data() { return storage_.get(); }
  const void* data() const { return storage_.get(); }
  ElemType type() const { return type_; }
  Device device() const { return device_; }
  size_t capacity() const { return capacity_; }
  size_t bytes() const { return capacity_ * elem_bytes(type_); }
  ConstView view(size_t offset, size_t count) const;

 private:
  std::unique_ptr<std::byte[]> storage_;
  ElemType type_ = ElemType::kF32;
  Device device_ = Device::kHost;
  size_t capacity_ = 0;
};

}  // namespace colibri
