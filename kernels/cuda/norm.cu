#include "cuda/norm.cuh"

#include "cuda/check.h"

namespace colibri::cuda {
namespace {

constexpr int kThreads = 256;

// Sum of `value` over the block; every thread gets it. `shared` holds kThreads / 32 floats.
__device__ float block_sum(float value, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total += shared[w];
  return total;
}

__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const float* x, int64_t x_stride, const int* rows, int64_t d, const float* w,
                    float eps, float* y, int64_t y_stride) {
  __shared__ float partial[kThreads / 32];
  const int64_t r = blockIdx.x;
  const float* in = x + (rows ? rows[r] : r) * x_stride;
  float* out = y + r * y_stride;
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) sum_sq = fmaf(in[i], in[i], sum_sq);
  const float inv = 1.0f / sqrtf(block_sum(sum_sq, partial) / float(d) + eps);
  for (int64_t i = threadIdx.x; i < d; i += kThreads) out[i] = w[i] * (in[i] * inv);
}

__global__ void __launch_bounds__(kThreads)
    layer_norm_kernel(const float* x, int64_t d, const float* w, const float* b, float eps,
                      float* y) {
  __shared__ float partial[kThreads / 32];
  const float* in = x + int64_t(blockIdx.x) * d;
  float* out = y + int64_t(blockIdx.x) * d;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) sum += in[i];
  const float mean = block_sum(sum, partial) / float(d);
  float var = 0.0f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) var += (in[i] - mean) * (in[i] - mean);
  const float inv = 1.0f / sqrtf(block_sum(var, partial) / float(d) + eps);
  for (int64_t i = threadIdx.x; i < d; i += kThreads) out[i] = (in[i] - mean) * inv * w[i] + b[i];
}

}  // namespace

void rms_norm(const float* x, int64_t x_stride, const int* rows, int64_t n, int64_t d,
              const float* w, float eps, float* y, int64_t y_stride, cudaStream_t stream) {
  if (n <= 0) return;
  rms_norm_kernel<<<unsigned(n), kThreads, 0, stream>>>(x, x_stride, rows, d, w, eps, y, y_stride);
  CHECK_CUDA_LAUNCH();
}

void layer_norm(const float* x, int64_t n, int64_t d, const float* w, const float* b, float eps,
                float* y, cudaStream_t stream) {
  if (n <= 0) return;
  layer_norm_kernel<<<unsigned(n), kThreads, 0, stream>>>(x, d, w, b, eps, y);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
