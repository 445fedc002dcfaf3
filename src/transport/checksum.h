// The wire checksum's per-ISA builds (transport/protocol.h: checksum). XXH3-64 gives the same
// value whatever vector width computes it; each file here builds it for one width.
#pragma once

#include <cstddef>
#include <cstdint>

namespace colibri::wire::detail {

uint32_t checksum_scalar(const std::byte* data, size_t bytes);    // no vector instructions
uint32_t checksum_baseline(const std::byte* data, size_t bytes);  // the build's own flags
uint32_t checksum_avx2(const std::byte* data, size_t bytes);      // x86-64 only
uint32_t checksum_avx512(const std::byte* data, size_t bytes);    // x86-64 only

}  // namespace colibri::wire::detail
