#include "cuda/check.h"

#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace colibri::cuda {

void fatal(const char* file, int line, const char* message) {
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  const bool mpi_running = initialized && !finalized;
  if (mpi_running) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank >= 0)
    std::fprintf(stderr, "[rank %d@%s] error: %s:%d: %s\n", rank, host, file, line, message);
  else
    std::fprintf(stderr, "[rank ?@%s] error: %s:%d: %s\n", host, file, line, message);
  std::fflush(stderr);
  if (mpi_running) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void fatal_cuda(cudaError_t status, const char* expr, const char* file, int line) {
  char message[1024];
  std::snprintf(message, sizeof(message), "CUDA error %s (%s) from %s", cudaGetErrorName(status),
                cudaGetErrorString(status), expr);
  fatal(file, line, message);
}

}  // namespace colibri::cuda
