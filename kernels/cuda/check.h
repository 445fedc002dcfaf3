// The CUDA check macros. A failed CUDA call is not recoverable inside a rank: the handler prints
// one line naming rank@host, the call and the source location, then ends the whole job with
// MPI_Abort (std::abort when MPI is not running, e.g. in a single-process test).
#pragma once

#include <cuda_runtime_api.h>

namespace colibri::cuda {

// Prints "[rank r@host] error: <file>:<line>: <message>" to stderr and ends the job.
[[noreturn]] void fatal(const char* file, int line, const char* message);

// Formats a failed CUDA status and the expression that returned it, then calls fatal().
[[noreturn]] void fatal_cuda(cudaError_t status, const char* expr, const char* file, int line);

}  // namespace colibri::cuda

// CHECK_CUDA(cudaMemcpyAsync(...));  aborts the job unless the call returns cudaSuccess.
#define CHECK_CUDA(expr)                                                            \
  do {                                                                              \
    const cudaError_t colibri_cuda_status_ = (expr);                                \
    if (colibri_cuda_status_ != cudaSuccess)                                        \
      ::colibri::cuda::fatal_cuda(colibri_cuda_status_, #expr, __FILE__, __LINE__); \
  } while (0)

// CHECK_CUDA_LAUNCH();  after a <<<...>>> launch: catches bad configurations at the launch site.
#define CHECK_CUDA_LAUNCH() CHECK_CUDA(cudaGetLastError())
