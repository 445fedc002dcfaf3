// Dense fp32 linear layers on a CUDA device. Same contract as kernels/cpu/linear.h, which is the
// oracle for these kernels (tests/gpu/linear_cuda_test.cpp). Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

// y[n, rows] = x[n, cols] · w[rows, cols]^T, accumulated in fp32. All pointers are device
// memory, row-major and contiguous; y must not overlap x or w. Enqueued on `stream` and
// asynchronous with respect to the host. One warp per output row; launch errors abort via
// CHECK_CUDA.
void linear_f32(const float* x, int64_t n, const float* w, int64_t rows, int64_t cols, float* y,
                cudaStream_t stream);

}  // namespace colibri::cuda
