// Elementwise steps of the coordinator's forward on a CUDA device: embedding gather, residual
// adds, SiLU·mul, fp32 -> BF16 and a non-finite flag. Oracles: kernels/cpu/elementwise and the
// engine's loops (tests/gpu/coordinator_kernels_test.cpp). All pointers are device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

// h[t, :] = table[tokens[t], :] for t < n; the table [vocab, hidden] is BF16 (widened) when
// table_bf16 is given, else fp32.
void embed(const int* tokens, int64_t n, const uint16_t* table_bf16, const float* table_f32,
           int64_t hidden, float* h, cudaStream_t stream);
// y[i] += x[i].
void add(float* y, const float* x, int64_t count, cudaStream_t stream);
// y[i] += (a[i] + b[i]): the routed partial plus the shared expert, in the CPU's order.
void add_sum(float* y, const float* a, const float* b, int64_t count, cudaStream_t stream);
// gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
void silu_mul(float* gate, const float* up, int64_t count, cudaStream_t stream);
// hi[i] = BF16 of x[i] (nearest even), lo[i] = BF16 of x[i] - hi[i]: hi + lo keeps 16
// significant bits of x (relative error at most 2^-17), so a product over BF16 weights can take
// fp32 activations as two BF16 rows.
void split_bf16(const float* x, int64_t count, uint16_t* hi, uint16_t* lo, cudaStream_t stream);
// y[i] = wide[i] + wide[count + i]: the hi and lo halves of a split product summed.
void add_halves(const float* wide, int64_t count, float* y, cudaStream_t stream);
// *flag = 1 when some x[i] is NaN or Inf (otherwise *flag is left as it is).
void flag_non_finite(const float* x, int64_t count, int* flag, cudaStream_t stream);

}  // namespace colibri::cuda
