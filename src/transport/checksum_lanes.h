// The block sums of transport/checksum.h in plain C++, inlined into the file that includes it
// (compiled with that file's instruction set).
#pragma once

#include <bit>
#include <cstring>

#include "transport/checksum.h"

namespace colibri::wire::detail {
namespace {

static_assert(std::endian::native == std::endian::little, "the lanes are little-endian words");

// The 16 lanes' sums a and b, copied in from and back out to the caller's arrays.
struct PlainLanes {
  uint32_t* a;
  uint32_t* b;
  uint32_t sa[kLanes], sb[kLanes];

  PlainLanes(uint32_t* a_out, uint32_t* b_out) : a(a_out), b(b_out) {
    std::memcpy(sa, a, sizeof(sa));
    std::memcpy(sb, b, sizeof(sb));
  }
  ~PlainLanes() {
    std::memcpy(a, sa, sizeof(sa));
    std::memcpy(b, sb, sizeof(sb));
  }
  void add(const std::byte* block) {
    uint32_t w[kLanes];
    std::memcpy(w, block, kBlockBytes);
    for (size_t l = 0; l < kLanes; ++l) {
      sa[l] += w[l];
      sb[l] += sa[l];
    }
  }
};

inline void sum_blocks_plain(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks) {
  PlainLanes lanes(a, b);
  for (size_t k = 0; k < blocks; ++k, data += kBlockBytes) lanes.add(data);
}

inline void copy_sum_blocks_plain(uint32_t* a, uint32_t* b, std::byte* dst, const std::byte* src,
                                  size_t blocks) {
  PlainLanes lanes(a, b);
  for (size_t k = 0; k < blocks; ++k, src += kBlockBytes, dst += kBlockBytes) {
    std::memcpy(dst, src, kBlockBytes);
    lanes.add(src);
  }
}

inline void add_sum_blocks_plain(uint32_t* a, uint32_t* b, float* dst, const std::byte* src,
                                 size_t blocks, bool first) {
  PlainLanes lanes(a, b);
  for (size_t k = 0; k < blocks; ++k, src += kBlockBytes, dst += kLanes) {
    float v[kLanes];
    std::memcpy(v, src, kBlockBytes);
    for (size_t l = 0; l < kLanes; ++l) dst[l] = (first ? 0.0f : dst[l]) + v[l];
    lanes.add(src);
  }
}

}  // namespace
}  // namespace colibri::wire::detail
