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
  // Blocks of 4096 with a branch-free OR inside, so the common all-finite case vectorises; the
  // block holding the first bad value is searched again element by element.
  constexpr size_t kBlock = 4096;
  for (size_t begin = 0; begin < values.size(); begin += kBlock) {
    const size_t end = std::min(values.size(), begin + kBlock);
    uint32_t bad = 0;
    for (size_t i = begin; i < end; ++i)
      bad |= uint32_t((std::bit_cast<uint32_t>(values[i]) & kExponentMask) == kExponentMask);
    if (!bad) continue;
    for (size_t i = begin; i < end; ++i)
      if (non_finite(values[i])) return i;
  }
  return std::nullopt;
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
