#include <cub/block/block_scan.cuh>

#include "cuda/check.h"
#include "cuda/dsa_indexer.cuh"

namespace colibri::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kTopkThreads = 512;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One warp per key.
__global__ void __launch_bounds__(32 * kWarps) scores_kernel(const IndexerScores a) {
  const int64_t t = blockIdx.y;
  const int pos = a.kv.row_pos[t];
  if (pos + 1 <= a.topk) return;
  const int s = int(blockIdx.x) * kWarps + int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (s > pos) return;
  const float* key = a.keys + key_slot(a.kv, t, s) * a.dim;
  float score = 0.0f;
  for (int h = 0; h < a.heads; ++h) {
    const float* q = a.q + (t * a.heads + h) * a.dim;
    float dot = 0.0f;
    for (int j = lane; j < a.dim; j += 32) dot = fmaf(q[j], key[j], dot);
    const float weight = a.w[t * a.heads + h] * a.head_scale;
    score += weight * fmaxf(warp_sum(dot) * a.score_scale, 0.0f);
  }
  if (lane == 0) a.scores[t * a.max_keys + s] = score;
}

// Larger float -> larger key; -0 and +0 are one key (the CPU compares them equal).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kTopkThreads)
    topk_kernel(const float* scores, int max_keys, const int* row_pos, int topk, int* selected,
                int* count) {
  using Scan = cub::BlockScan<int, kTopkThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int histogram[256];
  __shared__ int digit_shared, remaining_shared;
  const int64_t t = blockIdx.x;
  const int tid = int(threadIdx.x), visible = row_pos[t] + 1;
  if (visible <= topk) {
    if (tid == 0) count[t] = 0;
    return;
  }
  const float* s = scores + t * max_keys;
  // The topk-th largest key, a byte at a time from the top; `remaining`: how many keys equal to
  // it are taken.
  uint32_t prefix = 0, mask = 0;
  int remaining = topk;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kTopkThreads) histogram[i] = 0;
    __syncthreads();
    for (int p = tid; p < visible; p += kTopkThreads) {
      const uint32_t u = order_key(s[p]);
      if ((u & mask) == prefix) atomicAdd(&histogram[(u >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0;
      for (int d = 255; d >= 0; --d) {
        if (above + histogram[d] >= remaining) {
          digit_shared = d;
          remaining_shared = remaining - above;
          break;
        }
        above += histogram[d];
      }
    }
    __syncthreads();
    prefix |= uint32_t(digit_shared) << shift;
    mask |= 255u << shift;
    remaining = remaining_shared;
    __syncthreads();
  }
  // Keys above the threshold, and the first `remaining` equal to it, in position order.
  int taken = 0, equal_seen = 0;
  for (int chunk = 0; chunk < visible; chunk += kTopkThreads) {
    const int p = chunk + tid;
    const uint32_t u = p < visible ? order_key(s[p]) : 0;
    const int equal = p < visible && u == prefix ? 1 : 0;
    int equal_before, equal_total;
    Scan(scan_storage).ExclusiveSum(equal, equal_before, equal_total);
    __syncthreads();
    const int take =
        p < visible && (u > prefix || (equal && equal_seen + equal_before < remaining)) ? 1 : 0;
    int before, total;
    Scan(scan_storage).ExclusiveSum(take, before, total);
    __syncthreads();
    if (take) selected[t * topk + taken + before] = p;
    taken += total;
    equal_seen += equal_total;
  }
  if (tid == 0) count[t] = topk;
}

}  // namespace

void indexer_scores(const IndexerScores& a, cudaStream_t stream) {
  if (a.n <= 0 || a.max_keys <= a.topk) return;
  const unsigned key_blocks = unsigned((a.max_keys + kWarps - 1) / kWarps);
  scores_kernel<<<dim3(key_blocks, unsigned(a.n)), 32 * kWarps, 0, stream>>>(a);
  CHECK_CUDA_LAUNCH();
}

void indexer_topk(const float* scores, int64_t n, int max_keys, const int* row_pos, int topk,
                  int* selected, int* count, cudaStream_t stream) {
  if (n <= 0) return;
  topk_kernel<<<unsigned(n), kTopkThreads, 0, stream>>>(scores, max_keys, row_pos, topk, selected,
                                                        count);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
