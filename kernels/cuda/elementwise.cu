#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/check.h"
#include "cuda/elementwise.cuh"

namespace colibri::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t count) {
  return unsigned(std::min<int64_t>((count + kThreads - 1) / kThreads, 1 << 20));
}

#define COLIBRI_GRID_STRIDE(i, count)                                           \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (count); \
       i += int64_t(gridDim.x) * blockDim.x)

__global__ void embed_kernel(const int* tokens, int64_t n, const uint16_t* table_bf16,
                             const float* table_f32, int64_t hidden, float* h) {
  COLIBRI_GRID_STRIDE(i, n * hidden) {
    const int64_t at = int64_t(tokens[i / hidden]) * hidden + i % hidden;
    h[i] = table_bf16 ? __uint_as_float(uint32_t(table_bf16[at]) << 16) : table_f32[at];
  }
}

__global__ void add_kernel(float* y, const float* x, int64_t count) {
  COLIBRI_GRID_STRIDE(i, count) y[i] += x[i];
}

__global__ void add_sum_kernel(float* y, const float* a, const float* b, int64_t count) {
  COLIBRI_GRID_STRIDE(i, count) y[i] += a[i] + b[i];
}

__global__ void silu_mul_kernel(float* gate, const float* up, int64_t count) {
  COLIBRI_GRID_STRIDE(i, count) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

__global__ void split_bf16_kernel(const float* x, int64_t count, uint16_t* hi, uint16_t* lo) {
  COLIBRI_GRID_STRIDE(i, count) {
    const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
    hi[i] = __bfloat16_as_ushort(h);
    lo[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i] - __bfloat162float(h)));
  }
}

__global__ void add_halves_kernel(const float* wide, int64_t count, float* y) {
  COLIBRI_GRID_STRIDE(i, count) y[i] = wide[i] + wide[count + i];
}

__global__ void flag_kernel(const float* x, int64_t count, int* flag) {
  COLIBRI_GRID_STRIDE(i, count) if (!isfinite(x[i]))* flag = 1;
}

}  // namespace

void embed(const int* tokens, int64_t n, const uint16_t* table_bf16, const float* table_f32,
           int64_t hidden, float* h, cudaStream_t stream) {
  if (n <= 0) return;
  embed_kernel<<<blocks_for(n * hidden), kThreads, 0, stream>>>(tokens, n, table_bf16, table_f32,
                                                                hidden, h);
  CHECK_CUDA_LAUNCH();
}

void add(float* y, const float* x, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  add_kernel<<<blocks_for(count), kThreads, 0, stream>>>(y, x, count);
  CHECK_CUDA_LAUNCH();
}

void add_sum(float* y, const float* a, const float* b, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  add_sum_kernel<<<blocks_for(count), kThreads, 0, stream>>>(y, a, b, count);
  CHECK_CUDA_LAUNCH();
}

void silu_mul(float* gate, const float* up, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  silu_mul_kernel<<<blocks_for(count), kThreads, 0, stream>>>(gate, up, count);
  CHECK_CUDA_LAUNCH();
}

void split_bf16(const float* x, int64_t count, uint16_t* hi, uint16_t* lo, cudaStream_t stream) {
  if (count <= 0) return;
  split_bf16_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, count, hi, lo);
  CHECK_CUDA_LAUNCH();
}

void add_halves(const float* wide, int64_t count, float* y, cudaStream_t stream) {
  if (count <= 0) return;
  add_halves_kernel<<<blocks_for(count), kThreads, 0, stream>>>(wide, count, y);
  CHECK_CUDA_LAUNCH();
}

void flag_non_finite(const float* x, int64_t count, int* flag, cudaStream_t stream) {
  if (count <= 0) return;
  flag_kernel<<<blocks_for(count), kThreads, 0, stream>>>(x, count, flag);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
