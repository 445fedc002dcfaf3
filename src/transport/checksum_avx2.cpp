// The wire checksum with AVX2 (compiled with -mavx2; called only after CPUID).
#include "transport/checksum.h"
#include "transport/checksum_xxh3.h"

namespace colibri::wire::detail {

uint32_t checksum_avx2(const std::byte* data, size_t bytes) {
  return xxh3_folded(data, bytes);
}

}  // namespace colibri::wire::detail
