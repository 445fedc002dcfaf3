#include "cuda/check.h"
#include "cuda/router.cuh"

namespace colibri::cuda {
namespace {

__global__ void route_kernel(const RouterArgs a) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.n) return;
  const int experts = a.experts, k = a.top_k;
  const float* logits = a.logits + t * experts;
  float* score = a.scratch + t * 2 * experts;
  float* choice = score + experts;
  for (int e = 0; e < experts; ++e) {
    score[e] = 1.0f / (1.0f + expf(-logits[e]));
    choice[e] = score[e] + a.bias[e];
  }
  if (a.groups > 1) {
    // Group score = sum of the two best biased scores; keep the topk_group best groups.
    const int per_group = experts / a.groups;
    float group_score[kRouterMaxGroups];
    bool kept[kRouterMaxGroups];
    for (int g = 0; g < a.groups; ++g) {
      float best = -INFINITY, second = -INFINITY;
      for (int i = 0; i < per_group; ++i) {
        const float v = choice[g * per_group + i];
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      }
      group_score[g] = best + second;
      kept[g] = false;
    }
    for (int i = 0; i < a.topk_group; ++i) {
      int best = -1;
      for (int g = 0; g < a.groups; ++g)
        if (!kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
      kept[best] = true;
    }
    for (int e = 0; e < experts; ++e)
      if (!kept[e / per_group]) choice[e] = -INFINITY;
  }
  int chosen[kRouterMaxTopK];
  for (int i = 0; i < k; ++i) {
    int best = -1;
    for (int e = 0; e < experts; ++e) {
      bool taken = false;
      for (int j = 0; j < i; ++j) taken |= chosen[j] == e;
      if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
    }
    chosen[i] = best;
  }
  for (int i = 1; i < k; ++i)  // ascending expert ids
    for (int j = i; j > 0 && chosen[j - 1] > chosen[j]; --j) {
      const int swap = chosen[j];
      chosen[j] = chosen[j - 1];
      chosen[j - 1] = swap;
    }
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum += score[chosen[i]];
  const float denominator = a.norm_topk_prob ? sum + 1e-20f : 1.0f;
  for (int i = 0; i < k; ++i) {
    a.expert[t * k + i] = chosen[i];
    a.weight[t * k + i] = score[chosen[i]] / denominator * a.routed_scaling_factor;
  }
}

}  // namespace

void route(const RouterArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return;
  if (a.top_k > kRouterMaxTopK || a.groups > kRouterMaxGroups)
    fatal(__FILE__, __LINE__, "route: top_k or n_group above the kernel's limits");
  route_kernel<<<unsigned((a.n + 63) / 64), 64, 0, stream>>>(a);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
