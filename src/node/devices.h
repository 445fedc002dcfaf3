// The accelerators this process can use: the one place that knows whether CUDA was built in.
#pragma once

#include <string>

namespace colibri {

// CUDA devices visible to this process; 0 (with the reason in *why_none) on builds without CUDA,
// without a driver or without a device.
int local_gpu_count(std::string* why_none = nullptr);

}  // namespace colibri
