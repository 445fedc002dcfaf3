// What the CUDA benchmarks share: a command line of `--name value` pairs (no library beyond the
// CUDA runtime, so that they build on a bare GPU machine), the median, and the device-to-device
// copy bandwidth their throughputs are quoted against.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/check.h"

namespace colibri::bench {

// Prints "program: why" and the usage line "usage: program flags", and exits with code 2.
[[noreturn]] inline void usage_exit(const char* program, const char* flags,
                                    const std::string& why) {
  std::fprintf(stderr, "%s: %s\nusage: %s %s\n", program, why.c_str(), program, flags);
  std::exit(2);
}

// Calls set(name, value) for each `--name value` pair of argv; `set` returns false for a name it
// does not know. A name without a value, or one `set` does not know, goes to usage(why), which
// does not return.
template <class Set, class Usage>
void parse_flag_pairs(int argc, char** argv, Set&& set, Usage&& usage) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage("missing value after " + arg);
    const std::string value = argv[++i];
    if (!set(arg, value)) usage("unknown option " + arg);
  }
}

template <class T>
T median(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Device-to-device copy of `bytes` on `stream`, `reps` times after 3 warm-ups; returns the median
// bandwidth counting bytes read and written (2 * bytes / time), in GB/s.
inline double copy_bandwidth_gbs(size_t bytes, int reps, cudaStream_t stream) {
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&dst, bytes));
  CHECK_CUDA(cudaMemsetAsync(src, 0x5a, bytes, stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < reps + 3; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (i >= 3) ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  return 2.0 * double(bytes) / (double(median(ms)) * 1e-3) / 1e9;
}

}  // namespace colibri::bench
