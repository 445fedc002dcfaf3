#include "cuda/device.h"

#include <cuda_runtime_api.h>

namespace colibri::cuda {

int device_count(std::string* why_none) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the error so later CUDA calls do not report it again
    if (why_none)
      *why_none = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(status) + " (" +
                  cudaGetErrorString(status) + ")";
    return 0;
  }
  if (count == 0 && why_none) *why_none = "cudaGetDeviceCount found no CUDA device";
  return count;
}

}  // namespace colibri::cuda
