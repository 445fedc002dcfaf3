#include "cuda/linear.cuh"

#include <algorithm>

#include "cuda/check.h"

namespace colibri::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;
// Tokens whose dot products share one pass over a weight row (the weight row is read from
// global memory once per pass, the token rows once each).
constexpr int kTokensPerPass = 4;

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// One warp per output row r (grid-stride over rows); each lane accumulates a strided slice of
// the columns for up to kTokensPerPass tokens, then a shuffle reduction gives y[t, r].
// kVec4: cols % 4 == 0 and x, w 16-byte aligned, so every row can be read as float4.
// Control flow depends only on the warp index, so every lane reaches the full-mask shuffles.
template <bool kVec4>
__global__ void __launch_bounds__(kThreadsPerBlock)
    linear_f32_kernel(const float* __restrict__ x, int64_t n, const float* __restrict__ w,
                      int64_t rows, int64_t cols, float* __restrict__ y) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t first_row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t row_stride = int64_t(gridDim.x) * blockDim.x / kWarpSize;

  for (int64_t r = first_row; r < rows; r += row_stride) {
    const float* w_row = w + r * cols;  // [cols]
    for (int64_t t0 = 0; t0 < n; t0 += kTokensPerPass) {
      const int tokens = n - t0 < kTokensPerPass ? int(n - t0) : kTokensPerPass;
      float acc[kTokensPerPass] = {};
      if constexpr (kVec4) {
        const int64_t cols4 = cols / 4;
        const float4* w4 = reinterpret_cast<const float4*>(w_row);
        for (int64_t c = lane; c < cols4; c += kWarpSize) {
          const float4 wv = w4[c];
#pragma unroll
          for (int k = 0; k < kTokensPerPass; ++k)
            if (k < tokens)
              acc[k] = dot4(reinterpret_cast<const float4*>(x + (t0 + k) * cols)[c], wv, acc[k]);
        }
      } else {
        for (int64_t c = lane; c < cols; c += kWarpSize) {
          const float wv = w_row[c];
#pragma unroll
          for (int k = 0; k < kTokensPerPass; ++k)
            if (k < tokens) acc[k] = fmaf(x[(t0 + k) * cols + c], wv, acc[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < kTokensPerPass; ++k) {
        const float sum = warp_sum(acc[k]);
        if (lane == 0 && k < tokens) y[(t0 + k) * rows + r] = sum;
      }
    }
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void linear_f32(const float* x, int64_t n, const float* w, int64_t rows, int64_t cols, float* y,
                cudaStream_t stream) {
  if (n <= 0 || rows <= 0) return;
  // Enough blocks for one warp per row up to the grid limit; beyond that warps stride over rows.
  const int64_t blocks = std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 1 << 30);
  if (cols % 4 == 0 && aligned16(x) && aligned16(w))
    linear_f32_kernel<true>
        <<<unsigned(blocks), kThreadsPerBlock, 0, stream>>>(x, n, w, rows, cols, y);
  else
    linear_f32_kernel<false>
        <<<unsigned(blocks), kThreadsPerBlock, 0, stream>>>(x, n, w, rows, cols, y);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
