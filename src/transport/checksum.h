// The block sums of the wire checksum (transport/protocol.h: checksum), one build per instruction
// set. Each gives the same sums whatever vector width computes them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace colibri::wire::detail {

constexpr size_t kLanes = 16;
constexpr size_t kBlockBytes = kLanes * sizeof(uint32_t);

// For each of `blocks` blocks of kBlockBytes at `data` (any alignment) and each lane l, with w
// the block's l-th little-endian 32-bit word: a[l] += w, then b[l] += a[l] (mod 2^32).
using SumBlocks = void (*)(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks);

void sum_blocks_scalar(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks);
void sum_blocks_baseline(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks);
void sum_blocks_avx2(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks);    // x86-64
void sum_blocks_avx512(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks);  // x86-64

// The same sums while copying the blocks to dst (not overlapping src): memcpy and SumBlocks in one
// pass, each block loaded once.
using CopySumBlocks = void (*)(uint32_t* a, uint32_t* b, std::byte* dst, const std::byte* src,
                               size_t blocks);

void copy_sum_blocks_baseline(uint32_t* a, uint32_t* b, std::byte* dst, const std::byte* src,
                              size_t blocks);
void copy_sum_blocks_avx2(uint32_t* a, uint32_t* b, std::byte* dst, const std::byte* src,
                          size_t blocks);  // x86-64
void copy_sum_blocks_avx512(uint32_t* a, uint32_t* b, std::byte* dst, const std::byte* src,
                            size_t blocks);  // x86-64

// The same sums over blocks of fp32 values while adding them to dst: dst[i] = 0 + src[i] when
// `first`, else dst[i] += src[i], for the 16 values of each block (dst aligned to 4 bytes).
using AddSumBlocks = void (*)(uint32_t* a, uint32_t* b, float* dst, const std::byte* src,
                              size_t blocks, bool first);

void add_sum_blocks_baseline(uint32_t* a, uint32_t* b, float* dst, const std::byte* src,
                             size_t blocks, bool first);
void add_sum_blocks_avx2(uint32_t* a, uint32_t* b, float* dst, const std::byte* src, size_t blocks,
                         bool first);  // x86-64
void add_sum_blocks_avx512(uint32_t* a, uint32_t* b, float* dst, const std::byte* src,
                           size_t blocks, bool first);  // x86-64

// The wire checksum of `bytes` at `data` with the given build of the block sums.
uint32_t checksum_with(SumBlocks sum_blocks, const std::byte* data, size_t bytes);

}  // namespace colibri::wire::detail
