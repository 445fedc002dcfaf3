#include "cuda/check.h"
#include "cuda/rope.cuh"

namespace colibri::cuda {
namespace {

__global__ void rope_kernel(float* x, int64_t n, int heads, int64_t row_stride, int64_t head_stride,
                            int dim, const int* pos, const float* inv_freq, float attention_factor,
                            bool interleave) {
  const int half = dim / 2;
  const int64_t total = n * heads * half;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int i = int(k % half);
    const int64_t head = (k / half) % heads, t = k / (int64_t(half) * heads);
    float* v = x + t * row_stride + head * head_stride;
    const float angle = float(pos[t]) * inv_freq[i];
    const float c = cosf(angle) * attention_factor, s = sinf(angle) * attention_factor;
    float& a = interleave ? v[2 * i] : v[i];
    float& b = interleave ? v[2 * i + 1] : v[i + half];
    const float a0 = a, b0 = b;
    a = a0 * c - b0 * s;
    b = b0 * c + a0 * s;
  }
}

}  // namespace

void rope(float* x, int64_t n, int heads, int64_t row_stride, int64_t head_stride, int dim,
          const int* pos, const float* inv_freq, float attention_factor, bool interleave,
          cudaStream_t stream) {
  const int64_t total = n * heads * (dim / 2);
  if (total <= 0) return;
  const unsigned blocks = unsigned((total + 255) / 256 < (1 << 20) ? (total + 255) / 256 : 1 << 20);
  rope_kernel<<<blocks, 256, 0, stream>>>(x, n, heads, row_stride, head_stride, dim, pos, inv_freq,
                                          attention_factor, interleave);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
