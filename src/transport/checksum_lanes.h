// The block sums of transport/checksum.h in plain C++, inlined into the file that includes it
// (compiled with that file's instruction set).
#pragma once

#include <bit>
#include <cstring>

#include "transport/checksum.h"

namespace colibri::wire::detail {
namespace {

static_assert(std::endian::native == std::endian::little, "the lanes are little-endian words");

inline void sum_blocks_plain(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks) {
  uint32_t sa[kLanes], sb[kLanes];
  std::memcpy(sa, a, sizeof(sa));
  std::memcpy(sb, b, sizeof(sb));
  for (size_t k = 0; k < blocks; ++k, data += kBlockBytes) {
    uint32_t w[kLanes];
    std::memcpy(w, data, kBlockBytes);
    for (size_t l = 0; l < kLanes; ++l) {
      sa[l] += w[l];
      sb[l] += sa[l];
    }
  }
  std::memcpy(a, sa, sizeof(sa));
  std::memcpy(b, sb, sizeof(sb));
}

inline void copy_sum_blocks_plain(uint32_t* a, uint32_t* b, std::byte* dst, const std::byte* src,
                                  size_t blocks) {
  uint32_t sa[kLanes], sb[kLanes];
  std::memcpy(sa, a, sizeof(sa));
  std::memcpy(sb, b, sizeof(sb));
  for (size_t k = 0; k < blocks; ++k, src += kBlockBytes, dst += kBlockBytes) {
    uint32_t w[kLanes];
    std::memcpy(w, src, kBlockBytes);
    std::memcpy(dst, w, kBlockBytes);
    for (size_t l = 0; l < kLanes; ++l) {
      sa[l] += w[l];
      sb[l] += sa[l];
    }
  }
  std::memcpy(a, sa, sizeof(sa));
  std::memcpy(b, sb, sizeof(sb));
}

inline void add_sum_blocks_plain(uint32_t* a, uint32_t* b, float* dst, const std::byte* src,
                                 size_t blocks, bool first) {
  uint32_t sa[kLanes], sb[kLanes];
  std::memcpy(sa, a, sizeof(sa));
  std::memcpy(sb, b, sizeof(sb));
  for (size_t k = 0; k < blocks; ++k, src += kBlockBytes, dst += kLanes) {
    uint32_t w[kLanes];
    float v[kLanes];
    std::memcpy(w, src, kBlockBytes);
    std::memcpy(v, src, kBlockBytes);
    for (size_t l = 0; l < kLanes; ++l) {
      sa[l] += w[l];
      sb[l] += sa[l];
      dst[l] = (first ? 0.0f : dst[l]) + v[l];
    }
  }
  std::memcpy(a, sa, sizeof(sa));
  std::memcpy(b, sb, sizeof(sb));
}

}  // namespace
}  // namespace colibri::wire::detail
