// Elementwise steps of the coordinator's forward on a CUDA device: embedding gather, residual
// adds, SiLU·mul, fp32 -> BF16 and a non-finite flag. Oracles: kernels/cpu/elementwise and the
// engine's loops (tests/gpu/coordinator_kernels_test.cpp). All pointers are device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

// h[t, :] = widen(table[tokens[t], :]) for t < n; table BF16 [vocab, hidden].
void embed_bf16(const int* tokens, int64_t n, const uint16_t* table, int64_t hidden, float* h,
                cudaStream_t stream);
// y[i] += x[i].
void add(float* y, const float* x, int64_t count, cudaStream_t stream);
// y[i] += (a[i] + b[i]): the routed partial plus the shared expert, in the CPU's order.
void add_sum(float* y, const float* a, const float* b, int64_t count, cudaStream_t stream);
// gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
void silu_mul(float* gate, const float* up, int64_t count, cudaStream_t stream);
// y[i] = BF16 of x[i], rounded to nearest even.
void to_bf16(const float* x, int64_t count, uint16_t* y, cudaStream_t stream);
// *flag = 1 when some x[i] is NaN or Inf (otherwise *flag is left as it is).
void flag_non_finite(const float* x, int64_t count, int* flag, cudaStream_t stream);

}  // namespace colibri::cuda
