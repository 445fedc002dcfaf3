// The block sums without vector instructions: the reference the tests compare every build with.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-vectorize")
#endif
#include "transport/checksum_lanes.h"

namespace colibri::wire::detail {

void sum_blocks_scalar(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks) {
  sum_blocks_plain(a, b, data, blocks);
}

}  // namespace colibri::wire::detail
