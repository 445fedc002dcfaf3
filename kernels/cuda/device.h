// Which CUDA devices this process can see. No driver or no device is a normal state (CPU-only
// machines, CI): it is reported with a reason, never treated as an error.
#pragma once

#include <string>

namespace colibri::cuda {

// Number of visible CUDA devices. When it is 0 and why_none is given, *why_none says why
// (e.g. "cudaGetDeviceCount: cudaErrorNoDevice (no CUDA-capable device is detected)").
int device_count(std::string* why_none = nullptr);

}  // namespace colibri::cuda
