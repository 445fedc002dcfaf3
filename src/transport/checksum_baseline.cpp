// The block sums in the build's own instruction set (SSE2 on x86-64).
#include "transport/checksum_lanes.h"

namespace colibri::wire::detail {

void sum_blocks_baseline(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks) {
  sum_blocks_plain(a, b, data, blocks);
}

}  // namespace colibri::wire::detail
