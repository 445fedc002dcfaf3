#include "cuda/gemm.h"

#include <string>

#include "cuda/check.h"

namespace colibri::cuda {
namespace {

void check_blas(cublasStatus_t status, const char* expr, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  const std::string what = std::string(expr) + ": " + cublasGetStatusName(status) + " (" +
                           cublasGetStatusString(status) + ")";
  fatal(file, line, what.c_str());
}

#define CHECK_CUBLAS(expr) check_blas((expr), #expr, __FILE__, __LINE__)

}  // namespace

Blas::Blas(cudaStream_t stream) {
  CHECK_CUBLAS(cublasCreate(&handle_));
  CHECK_CUBLAS(cublasSetStream(handle_, stream));
  // Default math: fp32 products stay fp32 (TF32 only when asked for, which gemm_f32 also
  // forbids by its compute type); BF16 operands run on tensor cores.
  CHECK_CUBLAS(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
}

Blas::~Blas() {
  if (handle_) cublasDestroy(handle_);
}

// cuBLAS is column-major: row-major Y[n, rows] = X[n, cols] W^T is column-major
// Y^T[rows, n] = W^T... with W read transposed (op T on the column-major [cols, rows] view of W).
void gemm_bf16(const Blas& blas, const uint16_t* x, int64_t n, const uint16_t* w, int64_t rows,
               int64_t cols, float* y) {
  if (n <= 0 || rows <= 0) return;
  const float one = 1.0f, zero = 0.0f;
  CHECK_CUBLAS(cublasGemmEx(blas.handle(), CUBLAS_OP_T, CUBLAS_OP_N, int(rows), int(n), int(cols),
                            &one, w, CUDA_R_16BF, int(cols), x, CUDA_R_16BF, int(cols), &zero, y,
                            CUDA_R_32F, int(rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void gemm_f32(const Blas& blas, const float* x, int64_t n, const float* w, int64_t rows,
              int64_t cols, float* y) {
  if (n <= 0 || rows <= 0) return;
  const float one = 1.0f, zero = 0.0f;
  CHECK_CUBLAS(cublasGemmEx(blas.handle(), CUBLAS_OP_T, CUBLAS_OP_N, int(rows), int(n), int(cols),
                            &one, w, CUDA_R_32F, int(cols), x, CUDA_R_32F, int(cols), &zero, y,
                            CUDA_R_32F, int(rows), CUBLAS_COMPUTE_32F_PEDANTIC,
                            CUBLAS_GEMM_DEFAULT));
}

// Column-major: Y_b^T[m, n] = op(W_b)^T[m, k] · X_b^T[k, n]. A row-major [k, m] W is the
// column-major [m, k] matrix (op N, ld ldw); a row-major [m, k] W is op T of column-major [k, m].
void gemm_batched(const Blas& blas, bool bf16, int64_t batch, int64_t n, int64_t m, int64_t k,
                  const void* x, int64_t ldx, int64_t stride_x, const void* w, int64_t ldw,
                  int64_t stride_w, bool transpose_w, float* y, int64_t ldy, int64_t stride_y) {
  if (batch <= 0 || n <= 0 || m <= 0) return;
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  CHECK_CUBLAS(cublasGemmStridedBatchedEx(
      blas.handle(), transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, int(m), int(n), int(k),
      &one, w, type, int(ldw), stride_w, x, type, int(ldx), stride_x, &zero, y, CUDA_R_32F,
      int(ldy), stride_y, int(batch), bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC,
      CUBLAS_GEMM_DEFAULT));
}

}  // namespace colibri::cuda
