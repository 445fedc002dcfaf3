// Matrix products of the coordinator's forward through cuBLAS, in the engine's row-major terms.
// BF16 weights and activations with fp32 accumulation and output; fp32 weights in fp32 with
// TF32 off (the router, for the same expert choice as the CPU). Includable from plain C++.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

// A cuBLAS handle bound to one stream (default math: no TF32).
class Blas {
 public:
  explicit Blas(cudaStream_t stream);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  cublasHandle_t handle() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// y[n, rows] = x[n, cols] · w[rows, cols]^T; x and w BF16 bits, y fp32.
void gemm_bf16(const Blas& blas, const uint16_t* x, int64_t n, const uint16_t* w, int64_t rows,
               int64_t cols, float* y);

// The same in fp32 (no TF32).
void gemm_f32(const Blas& blas, const float* x, int64_t n, const float* w, int64_t rows,
              int64_t cols, float* y);

// For b < batch: Y_b[n, m] (row stride ldy, base y + b * stride_y) = X_b[n, k] (row stride ldx,
// base x + b * stride_x) · op(W_b), where W_b is row-major at w + b * stride_w with row stride
// ldw: [k, m] when !transpose_w, [m, k] when transpose_w. X and W both BF16 (bf16 true) or both
// fp32 (no TF32); Y fp32. The per-head products of MLA's absorbed form.
void gemm_batched(const Blas& blas, bool bf16, int64_t batch, int64_t n, int64_t m, int64_t k,
                  const void* x, int64_t ldx, int64_t stride_x, const void* w, int64_t ldw,
                  int64_t stride_w, bool transpose_w, float* y, int64_t ldy, int64_t stride_y);

}  // namespace colibri::cuda
