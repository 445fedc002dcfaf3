#include "cuda/check.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace colibri::cuda {
namespace {

FatalHandler g_handler = nullptr;

}  // namespace

void set_fatal_handler(FatalHandler handler) {
  g_handler = handler;
}

void fatal(const char* file, int line, const char* message) {
  char what[1280];
  std::snprintf(what, sizeof(what), "%s:%d: %s", file, line, message);
  if (g_handler) g_handler(what);
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  std::fprintf(stderr, "[pid %d@%s] error: %s\n", int(getpid()), host, what);
  std::fflush(stderr);
  std::abort();
}

void fatal_cuda(cudaError_t status, const char* expr, const char* file, int line) {
  char message[1024];
  std::snprintf(message, sizeof(message), "CUDA error %s (%s) from %s", cudaGetErrorName(status),
                cudaGetErrorString(status), expr);
  fatal(file, line, message);
}

void fatal_nccl(int status, const char* text, const char* expr, const char* file, int line) {
  char message[1024];
  std::snprintf(message, sizeof(message), "NCCL error %d (%s) from %s", status, text, expr);
  fatal(file, line, message);
}

}  // namespace colibri::cuda
