// Row-wise normalisations and activations in fp32.
#pragma once

#include <cstdint>

namespace colibri::kernels {

// out[i] = weight[i] * x[i] / sqrt(mean(x^2) + eps), for each of n rows of width d. In place ok.
void rms_norm(const float* x, int64_t n, int64_t d, const float* weight, float eps, float* out);

// out[i] = (x[i] - mean) / sqrt(var + eps) * weight[i] + bias[i]  (torch.nn.LayerNorm).
void layer_norm(const float* x, int64_t n, int64_t d, const float* weight, const float* bias,
                float eps, float* out);

// gate[i] = silu(gate[i]) * up[i]
void silu_mul(float* gate, const float* up, int64_t n);

// In-place softmax of n values.
void softmax(float* x, int64_t n);

}  // namespace colibri::kernels
