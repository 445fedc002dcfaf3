// The wire checksum in the build's own instruction set (SSE2 on x86-64).
#include "transport/checksum.h"
#include "transport/checksum_xxh3.h"

namespace colibri::wire::detail {

uint32_t checksum_baseline(const std::byte* data, size_t bytes) {
  return xxh3_folded(data, bytes);
}

}  // namespace colibri::wire::detail
