#include "cuda/check.h"
#include "cuda/mla_attention.cuh"

namespace colibri::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kPerLane = kMlaMaxLatent / 32;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__global__ void store_rows_kernel(const float* src, int64_t n, int64_t src_stride, int64_t width,
                                  const int* slot, float* cache) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n * width;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / width, j = i % width;
    cache[int64_t(slot[t]) * width + j] = src[t * src_stride + j];
  }
}

// Each warp takes every kWarps-th key with its own running max m, sum l and accumulator (lane
// holds dims lane + 32 k); the warps' states are merged at the end.
__global__ void __launch_bounds__(kThreads) mla_attend_kernel(const MlaAttend a) {
  __shared__ float acc_shared[kWarps][kMlaMaxLatent];
  __shared__ float m_shared[kWarps], l_shared[kWarps];
  const int head = int(blockIdx.x);
  const int64_t t = blockIdx.y;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int r = a.r;
  const float* q_abs = a.q_abs + (t * a.heads + head) * r;
  const float* q_rope = a.q + (t * a.heads + head) * a.dq + a.dn;
  float q_lane[kPerLane], acc[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int j = lane + 32 * k;
    q_lane[k] = j < r ? q_abs[j] : 0.0f;
    acc[k] = 0.0f;
  }
  const int chosen = a.selected_count ? a.selected_count[t] : 0;
  const int* selected = chosen > 0 ? a.selected + t * a.topk : nullptr;
  const int count = chosen > 0 ? chosen : a.kv.row_pos[t] + 1;
  float m = -INFINITY, l = 0.0f;
  for (int i = warp; i < count; i += kWarps) {
    const int64_t slot = key_slot(a.kv, t, selected ? selected[i] : i);
    const float* latent = a.latent + slot * r;
    const float* k_rope = a.k_rope + slot * a.dr;
    float dot = 0.0f, dot_rope = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int j = lane + 32 * k;
      if (j < r) dot = fmaf(q_lane[k], latent[j], dot);
    }
    for (int j = lane; j < a.dr; j += 32) dot_rope = fmaf(q_rope[j], k_rope[j], dot_rope);
    const float score = a.scale * (warp_sum(dot) + warp_sum(dot_rope));
    const float m_new = fmaxf(m, score);
    const float correction = expf(m - m_new), p = expf(score - m_new);
    l = l * correction + p;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int j = lane + 32 * k;
      if (j < r) acc[k] = acc[k] * correction + p * latent[j];
    }
    m = m_new;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int j = lane + 32 * k;
    if (j < r) acc_shared[warp][j] = acc[k];
  }
  if (lane == 0) {
    m_shared[warp] = m;
    l_shared[warp] = l;
  }
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, m_shared[w]);
  float weight[kWarps], l_all = 0.0f;
  for (int w = 0; w < kWarps; ++w) {
    weight[w] = m_shared[w] == -INFINITY ? 0.0f : expf(m_shared[w] - m_all);
    l_all += l_shared[w] * weight[w];
  }
  float* out = a.out + (t * a.heads + head) * r;
  for (int j = int(threadIdx.x); j < r; j += kThreads) {
    float o = 0.0f;
    for (int w = 0; w < kWarps; ++w) o += acc_shared[w][j] * weight[w];
    out[j] = o / l_all;
  }
}

}  // namespace

void store_rows(const float* src, int64_t n, int64_t src_stride, int64_t width, const int* slot,
                float* cache, cudaStream_t stream) {
  const int64_t total = n * width;
  if (total <= 0) return;
  const int64_t blocks = (total + 255) / 256;
  store_rows_kernel<<<unsigned(blocks < (1 << 20) ? blocks : 1 << 20), 256, 0, stream>>>(
      src, n, src_stride, width, slot, cache);
  CHECK_CUDA_LAUNCH();
}

void mla_attend(const MlaAttend& a, cudaStream_t stream) {
  if (a.n <= 0) return;
  if (a.r > kMlaMaxLatent) {
    const char* what = "mla_attend: kv_lora_rank above kMlaMaxLatent (512)";
    fatal(__FILE__, __LINE__, what);
  }
  mla_attend_kernel<<<dim3(unsigned(a.heads), unsigned(a.n)), kThreads, 0, stream>>>(a);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
