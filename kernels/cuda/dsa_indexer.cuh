// The DSA lightning indexer's scores and top-k key selection on a CUDA device. Oracle:
// CpuAttention::select_keys (src/coordinator/cpu_attention.cpp). Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/kv_table.cuh"

namespace colibri::cuda {

struct IndexerScores {
  const float* q = nullptr;     // [n, heads, dim] rotated indexer queries
  const float* w = nullptr;     // [n, heads] head weights (weights_proj output, unscaled)
  const float* keys = nullptr;  // [slots, dim] the layer's indexer key cache
  KvTable kv;
  int64_t n = 0;
  int heads = 0, dim = 0, topk = 0;
  float score_scale = 0, head_scale = 0;  // dim^-0.5, heads^-0.5
  float* scores = nullptr;                // [n, max_keys]
  int max_keys = 0;
};

// scores[t, s] = sum_h (w[t, h] * head_scale) * max(score_scale * q[t, h] · key_s, 0) for
// s <= pos[t], on rows that see more than topk positions (others are left alone).
void indexer_scores(const IndexerScores& a, cudaStream_t stream);

// Per row t with pos[t] + 1 > topk: selected[t, 0..topk) = the topk positions of the largest
// scores[t, 0..pos] (ties to the lower position), ascending, and count[t] = topk; else count[t]
// = 0 (every visible position). One block per row: a radix select on the scores' order bits.
void indexer_topk(const float* scores, int64_t n, int max_keys, const int* row_pos, int topk,
                  int* selected, int* count, cudaStream_t stream);

}  // namespace colibri::cuda
