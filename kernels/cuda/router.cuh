// DeepSeek-V3 / GLM-5 routing on a CUDA device: sigmoid scores, e_score_correction_bias for the
// choice only, group-limited top-k, optional renormalisation and routed_scaling_factor. Oracle:
// route_tokens (src/moe/router.cpp), whose tie order (lower index first) it keeps.
// Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

inline constexpr int kRouterMaxTopK = 32;
inline constexpr int kRouterMaxGroups = 64;

struct RouterArgs {
  const float* logits = nullptr;  // [n, experts] router logits
  const float* bias = nullptr;    // [experts] e_score_correction_bias
  int64_t n = 0;
  int experts = 0, groups = 1, topk_group = 1, top_k = 0;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  float* scratch = nullptr;  // [n, 2 * experts]
  int* expert = nullptr;     // [n, top_k] ascending per row
  float* weight = nullptr;   // [n, top_k]
};

// One thread per row. top_k <= kRouterMaxTopK, groups <= kRouterMaxGroups.
void route(const RouterArgs& a, cudaStream_t stream);

}  // namespace colibri::cuda
