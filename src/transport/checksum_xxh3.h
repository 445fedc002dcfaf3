// XXH3-64 of the data folded to 32 bits, inlined into the file that includes it (compiled with
// that file's instruction set; XXH_VECTOR may be set before). Include once per file.
#pragma once

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace colibri::wire::detail {
namespace {

uint32_t xxh3_folded(const std::byte* data, size_t bytes) {
  const uint64_t h = XXH3_64bits(data, bytes);
  return uint32_t(h) ^ uint32_t(h >> 32);
}

}  // namespace
}  // namespace colibri::wire::detail
