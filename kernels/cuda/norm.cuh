// Row normalisations of the coordinator's forward on a CUDA device. Oracles: kernels/cpu
// rms_norm and layer_norm (tests/gpu/coordinator_kernels_test.cpp). Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

// For r < n: y[r] = w * x[in] / sqrt(mean(x[in]^2) + eps) over d values, where row `in` is
// rows[r] when rows is given (a device array [n]), else r. Row r of x starts at x + r * x_stride,
// of y at y + r * y_stride; y may be x (in place). One block per row; sums in fp32.
void rms_norm(const float* x, int64_t x_stride, const int* rows, int64_t n, int64_t d,
              const float* w, float eps, float* y, int64_t y_stride, cudaStream_t stream);

// y[r] = (x[r] - mean) / sqrt(var + eps) * w + b over d values, rows contiguous; in place allowed.
void layer_norm(const float* x, int64_t n, int64_t d, const float* w, const float* b, float eps,
                float* y, cudaStream_t stream);

}  // namespace colibri::cuda
