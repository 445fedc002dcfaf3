// Host <-> device copies for the CUDA tests: a vector uploaded to a new allocation (one element
// when empty, so that the pointer is valid), and count elements downloaded.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "cuda/check.h"

namespace colibri::testing {

template <typename T>
T* upload(const std::vector<T>& host) {
  T* p = nullptr;
  CHECK_CUDA(
      cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(host.size(), 1) * sizeof(T)));
  if (!host.empty())
    CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

template <typename T>
std::vector<T> download(const T* device, size_t count) {
  std::vector<T> host(count);
  CHECK_CUDA(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace colibri::testing
