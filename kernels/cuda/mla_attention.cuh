// MLA attention in the absorbed form over the compressed KV cache, on a CUDA device. Oracle:
// CpuAttention::attend (src/coordinator/cpu_attention.cpp). The caller computes q_abs = W_UK^T
// q_nope per head (a batched GEMM) before, and W_UV o_latent after. Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/kv_table.cuh"

namespace colibri::cuda {

// cache[slot[t] * width + j] = src[t * src_stride + j] for t < n, j < width: the rows' new keys.
void store_rows(const float* src, int64_t n, int64_t src_stride, int64_t width, const int* slot,
                float* cache, cudaStream_t stream);

// The largest kv_lora_rank mla_attend takes (a lane holds r / 32 accumulators).
inline constexpr int kMlaMaxLatent = 512;

struct MlaAttend {
  const float* q_abs = nullptr;   // [n, heads, r] queries in latent space
  const float* q = nullptr;       // [n, heads, dq]; the rotated rope part at offset dn
  const float* latent = nullptr;  // [slots, r] normalised latents
  const float* k_rope = nullptr;  // [slots, dr] rotated rope keys
  KvTable kv;
  // The indexer's choice: row t attends to selected[t * topk, + count) when count =
  // selected_count[t] > 0, else to positions 0..pos. Both null: every row sees 0..pos.
  const int* selected = nullptr;
  const int* selected_count = nullptr;
  int topk = 0;
  int64_t n = 0;
  int heads = 0, r = 0, dr = 0, dq = 0, dn = 0;
  float scale = 0;       // softmax scale (config.softmax_scale())
  float* out = nullptr;  // [n, heads, r] o_latent = sum_i p_i latent_i
};

// One block per (head, row): scores scale * (q_abs · latent + q_rope · k_rope) in fp32, an online
// softmax over the keys, and the probability-weighted sum of the latents. r <= kMlaMaxLatent.
void mla_attend(const MlaAttend& a, cudaStream_t stream);

}  // namespace colibri::cuda
