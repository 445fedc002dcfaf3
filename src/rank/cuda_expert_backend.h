// The CUDA expert backend: the routed experts a rank owns live in one device allocation, in the
// layout they have in memory (container bytes and f32 scales, or fp32), uploaded once at start,
// so loading is a copy. compute() sends the request's rows, slot index and expert descriptions
// up in one copy from a pinned staging area, runs the grouped FFN (cuda/expert_ffn.cuh: three
// launches per request) and copies the partial back. Built only with CUDA (COLIBRI_HAVE_CUDA);
// the node creates it through make_gpu_expert_backend (node/devices.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/expert_group.h"
#include "rank/expert_backend.h"

namespace colibri {

struct CudaExpertStats {
  uint64_t requests = 0;
  uint64_t device_us = 0;     // CUDA-event time of rows up, launches, partial down; summed
  uint64_t upload_bytes = 0;  // expert bytes uploaded at start
};

class CudaExpertBackend final : public ExpertBackend {
 public:
  // An expert rank: `owned` (layer, expert) pairs read through `store` once and uploaded to
  // `device`. vram_bytes > 0 caps the upload; more owned bytes than that, or than the device
  // has free, is an Error naming both numbers.
  CudaExpertBackend(const ModelConfig& config, ExpertStore& store,
                    std::span<const std::pair<int, int>> owned, int device, uint64_t vram_bytes);
  // A single process: every routed expert in `weights`.
  CudaExpertBackend(const ModelConfig& config, const ModelWeights& weights, int device,
                    uint64_t vram_bytes);
  ~CudaExpertBackend() override;

  void prefetch(int layer, std::span<const int> experts) override {}
  void compute(const ExpertRequest& request, float* partial) override;

  int device() const { return device_; }
  uint64_t device_bytes() const { return device_bytes_; }
  const CudaExpertStats& stats() const { return stats_; }
  ExpertDeviceStats device_stats() const override {
    return {device_bytes_, stats_.requests, stats_.device_us};
  }

 private:
  void upload(const std::vector<std::pair<int, int>>& owned,
              const std::function<const MlpWeights&(int, int)>& weights_of,
              const std::function<void()>& done_with, uint64_t vram_bytes);

  const ModelConfig& config_;
  int device_;
  void* memory_ = nullptr;
  uint64_t device_bytes_ = 0;
  std::unordered_map<uint64_t, cuda::DeviceExpert> experts_;  // key: layer << 32 | expert
  cuda::ExpertGroupBuffers buffers_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  std::vector<float> rows_f32_;
  std::vector<cuda::ExpertPair> pairs_;
  std::vector<cuda::DeviceExpert> request_experts_;
  CudaExpertStats stats_;
};

}  // namespace colibri
