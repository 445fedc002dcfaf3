// The CUDA check macros. A failed CUDA call is not recoverable inside a rank: the handler prints
// one line naming the process, the call and the source location, then ends it. The MPI program
// installs a handler that names rank@host and ends the whole job with MPI_Abort
// (set_fatal_handler); without one (tests, benchmarks: no MPI) the line names the host and pid
// and the process ends with std::abort.
#pragma once

#include <cuda_runtime_api.h>

namespace colibri::cuda {

// Called with the formatted "<file>:<line>: <message>"; must not return.
using FatalHandler = void (*)(const char* what);
// Replaces the handler; nullptr restores the default. Not thread-safe: call it at start-up.
void set_fatal_handler(FatalHandler handler);

// Passes "<file>:<line>: <message>" to the handler and ends the process.
[[noreturn]] void fatal(const char* file, int line, const char* message);

// Formats a failed CUDA status and the expression that returned it, then calls fatal().
[[noreturn]] void fatal_cuda(cudaError_t status, const char* expr, const char* file, int line);

// The same for a failed NCCL status (its number and ncclGetErrorString's text).
[[noreturn]] void fatal_nccl(int status, const char* text, const char* expr, const char* file,
                             int line);

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

// CHECK_NCCL(ncclSend(...));  with nccl.h included: aborts the job unless the call returns
// ncclSuccess or ncclInProgress (a non-blocking communicator's call still running: the caller
// polls ncclCommGetAsyncError).
#define CHECK_NCCL(expr)                                                                     \
  do {                                                                                       \
    const ncclResult_t colibri_nccl_status_ = (expr);                                        \
    if (colibri_nccl_status_ != ncclSuccess && colibri_nccl_status_ != ncclInProgress)       \
      ::colibri::cuda::fatal_nccl(int(colibri_nccl_status_),                                 \
                                  ncclGetErrorString(colibri_nccl_status_), #expr, __FILE__, \
                                  __LINE__);                                                 \
  } while (0)
