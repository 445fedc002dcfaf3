// The accelerators this process can use: the one place that knows whether CUDA was built in.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "coordinator/coordinator_compute.h"
#include "rank/expert_backend.h"
#include "rank/vram_tier.h"

namespace colibri {

// CUDA devices visible to this process; 0 (with the reason in *why_none) on builds without CUDA,
// without a driver or without a device.
int local_gpu_count(std::string* why_none = nullptr);

// The device a gpu-expert rank uses for layout column `gpu`: that index when this process sees
// more devices than it, else device 0 when it sees exactly one (colibri-launch shows each GPU
// rank only its own GPU, as device 0). An Error naming `who` ("rank 1@host") when neither holds.
int choose_gpu(int layout_gpu, const std::string& who);

// The CUDA expert backend over an expert rank's store (cuda_expert_backend.h); an Error on builds
// without CUDA. Installs the CUDA fatal handler that names rank@host and ends the job with
// MPI_Abort.
std::unique_ptr<ExpertBackend> make_gpu_expert_backend(const ModelConfig& config,
                                                       ExpertStore& store,
                                                       std::span<const std::pair<int, int>> owned,
                                                       int device, uint64_t vram_bytes,
                                                       const VramCostModel& cost);

// The same over every routed expert in `weights` (a single process, --experts gpu).
std::unique_ptr<ExpertBackend> make_gpu_expert_backend(const ModelConfig& config,
                                                       const ModelWeights& weights, int device,
                                                       uint64_t vram_bytes,
                                                       const VramCostModel& cost);

// The coordinator's forward on CUDA device `device` (coordinator/cuda_compute.h) as the Engine's
// compute; an Error on builds without CUDA. Installs the CUDA fatal handler that names rank@host
// and ends the job with MPI_Abort.
ComputeFactory make_gpu_coordinator(int device);

}  // namespace colibri
