// Rotary position embedding (with YaRN's frequencies and attention factor) on a CUDA device.
// Oracle: Rope::apply (src/model/rope.cpp), whose inv_freq and attention_factor the caller
// uploads. Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

// For t < n, h < heads: rotates x + t * row_stride + h * head_stride, dims [0, dim), by position
// pos[t]: angle = pos * inv_freq[i], cos and sin times attention_factor; interleave pairs
// (2i, 2i+1), else (i, i + dim/2). inv_freq: device [dim / 2].
void rope(float* x, int64_t n, int heads, int64_t row_stride, int64_t head_stride, int dim,
          const int* pos, const float* inv_freq, float attention_factor, bool interleave,
          cudaStream_t stream);

}  // namespace colibri::cuda
