// The block sums in the build's own instruction set (SSE2 on x86-64).
#include "transport/checksum_lanes.h"

namespace colibri::wire::detail {

void sum_blocks_baseline(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks) {
  sum_blocks_plain(a, b, data, blocks);
}

void add_sum_blocks_baseline(uint32_t* a, uint32_t* b, float* dst, const std::byte* src,
                             size_t blocks, bool first) {
  add_sum_blocks_plain(a, b, dst, src, blocks, first);
}

void copy_sum_blocks_baseline(uint32_t* a, uint32_t* b, std::byte* dst, const std::byte* src,
                              size_t blocks) {
  copy_sum_blocks_plain(a, b, dst, src, blocks);
}

}  // namespace colibri::wire::detail
