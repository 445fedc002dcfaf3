#include "node/devices.h"

#ifdef COLIBRI_HAVE_CUDA
#include "cuda/device.h"
#endif

namespace colibri {

int local_gpu_count(std::string* why_none) {
#ifdef COLIBRI_HAVE_CUDA
  return cuda::device_count(why_none);
#else
  if (why_none) *why_none = "built without CUDA (COLIBRI_CUDA=OFF or no nvcc)";
  return 0;
#endif
}

}  // namespace colibri
