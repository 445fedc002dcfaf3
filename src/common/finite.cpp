#include "common/finite.h"

#include <algorithm>
#include <bit>
#include <cstdint>

#include "common/error.h"

namespace colibri {
namespace {

constexpr uint32_t kExponentMask = 0x7f800000u;

bool non_finite(float value) {
  return (std::bit_cast<uint32_t>(value) & kExponentMask) == kExponentMask;
}

}  // namespace

std::optional<size_t> find_non_finite(std::span<const float> values) {
  // Whole blocks of a fixed length with a branch-free OR inside: GCC vectorises that at -O2 (its
  // very-cheap cost model leaves a loop of unknown length scalar, 4x slower). The block holding
  // the first bad value, and the tail, are searched element by element.
  constexpr size_t kBlock = 1024;
  const auto first_in = [&](size_t begin, size_t end) -> std::optional<size_t> {
    for (size_t i = begin; i < end; ++i)
      if (non_finite(values[i])) return i;
    return std::nullopt;
  };
  size_t begin = 0;
  for (; begin + kBlock <= values.size(); begin += kBlock) {
    const float* block = values.data() + begin;
    uint32_t bad = 0;
    for (size_t i = 0; i < kBlock; ++i)
      bad |= uint32_t((std::bit_cast<uint32_t>(block[i]) & kExponentMask) == kExponentMask);
    if (bad) return first_in(begin, begin + kBlock);
  }
  return first_in(begin, values.size());
}

void check_finite(std::span<const float> values, std::string_view what) {
  const std::optional<size_t> first = find_non_finite(values);
  if (!first) return;
  size_t count = 0;
  for (float v : values.subspan(*first)) count += non_finite(v);
  fail("{}: {} at index {} ({} of {} values are NaN or Inf)", what, values[*first], *first, count,
       values.size());
}

}  // namespace colibri
