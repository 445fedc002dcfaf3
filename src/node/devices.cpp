#include "node/devices.h"

#include <mpi.h>

#include <cstdio>

#include "common/error.h"
#include "transport/mpi_check.h"

#ifdef COLIBRI_HAVE_CUDA
#include "coordinator/cuda_compute.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "rank/cuda_expert_backend.h"
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

int choose_gpu(int layout_gpu, const std::string& who) {
  std::string why_none;
  const int count = local_gpu_count(&why_none);
  if (count == 0) fail("{} sees no CUDA device: {}", who, why_none);
  if (layout_gpu >= 0 && layout_gpu < count) return layout_gpu;
  if (count == 1) return 0;
  fail("{} is to use GPU {}, but sees only {} devices (0..{})", who, layout_gpu, count, count - 1);
}

#ifdef COLIBRI_HAVE_CUDA
namespace {

[[noreturn]] void abort_job(const char* what) {
  std::fprintf(stderr, "[%s] error: %s\n", rank_identity().name_of(rank_identity().rank).c_str(),
               what);
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

}  // namespace
#endif

std::unique_ptr<ExpertBackend> make_gpu_expert_backend(const ModelConfig& config,
                                                       ExpertStore& store,
                                                       std::span<const std::pair<int, int>> owned,
                                                       int device, uint64_t vram_bytes,
                                                       const VramCostModel& cost) {
#ifdef COLIBRI_HAVE_CUDA
  cuda::set_fatal_handler(abort_job);
  return std::make_unique<CudaExpertBackend>(config, store, owned, device, vram_bytes, cost);
#else
  fail("this build has no CUDA expert backend (built without CUDA: COLIBRI_CUDA=OFF or no nvcc)");
#endif
}

std::unique_ptr<ExpertBackend> make_gpu_expert_backend(const ModelConfig& config,
                                                       const ModelWeights& weights, int device,
                                                       uint64_t vram_bytes,
                                                       const VramCostModel& cost) {
#ifdef COLIBRI_HAVE_CUDA
  cuda::set_fatal_handler(abort_job);
  return std::make_unique<CudaExpertBackend>(config, weights, device, vram_bytes, cost);
#else
  fail("this build has no CUDA expert backend (built without CUDA: COLIBRI_CUDA=OFF or no nvcc)");
#endif
}

ComputeFactory make_gpu_coordinator(int device) {
#ifdef COLIBRI_HAVE_CUDA
  cuda::set_fatal_handler(abort_job);
  return [device](const ModelConfig& config, const ModelWeights& weights, KvManager& kv,
                  int max_rows, Profiler* profiler) -> std::unique_ptr<CoordinatorCompute> {
    return std::make_unique<CudaCompute>(config, weights, kv, max_rows, device, profiler);
  };
#else
  (void)device;
  fail("this build has no CUDA coordinator (built without CUDA: COLIBRI_CUDA=OFF or no nvcc)");
#endif
}

}  // namespace colibri
