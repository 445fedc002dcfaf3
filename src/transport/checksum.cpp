// The wire checksum in the build's own instruction set, and without vectors (the reference the
// tests compare every build with).
#define XXH_VECTOR XXH_SCALAR
#include "transport/checksum.h"

#include "transport/checksum_xxh3.h"

namespace colibri::wire::detail {

uint32_t checksum_scalar(const std::byte* data, size_t bytes) {
  return xxh3_folded(data, bytes);
}

}  // namespace colibri::wire::detail
