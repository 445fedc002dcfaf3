// The KV block table of a batch on the device (gpu_staging.h packs it on the host): key position
// p of batch row t lives in slot blocks[row_seq[t] * max_blocks + p / block_tokens] *
// block_tokens + p % block_tokens of each per-layer cache. Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

struct KvTable {
  const int* blocks = nullptr;   // [seqs, max_blocks]
  const int* row_seq = nullptr;  // [n] table row of each batch row
  const int* row_pos = nullptr;  // [n] position of each batch row
  int max_blocks = 0, block_tokens = 0;
};

#ifdef __CUDACC__
__device__ __forceinline__ int64_t key_slot(const KvTable& kv, int64_t t, int p) {
  const int block = kv.blocks[int64_t(kv.row_seq[t]) * kv.max_blocks + p / kv.block_tokens];
  return int64_t(block) * kv.block_tokens + p % kv.block_tokens;
}
#endif

}  // namespace colibri::cuda
