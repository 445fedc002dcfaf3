// The CUDA expert backend: the routed experts a rank owns live in device slots of equal size, in
// the layout they have in memory (container bytes and f32 scales, with an int4 checkpoint's zero
// points as fp32 offsets; BF16 bits; fp32; NVFP4 codes and block scales: rank/expert_slot.h), so
// loading is a copy. When all owned experts fit the VRAM budget they are uploaded at start and
// every request runs on the device. When they do not, the slots are the VRAM tier over the
// rank's RAM and disk tiers (rank/vram_tier.h decides: LRU slots, and per missed expert, upload
// it or compute it on the CPU). One request then runs as
//   stream:      rows + index up -> kernels of the resident experts -> (wait for the uploads)
//                -> kernels of the uploaded experts -> CPU experts' rows up -> combine -> down
//   copy stream: each uploaded expert, pinned staging -> its slot (overlapping the first kernels)
//   host:        the experts computed on the CPU (overlapping both), into pinned memory
// and each row sums its experts in ascending order wherever they ran. Built only with CUDA
// (COLIBRI_HAVE_CUDA); the node creates it through make_gpu_expert_backend (node/devices.h).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "cuda/expert_group.h"
#include "rank/expert_backend.h"
#include "rank/expert_slot.h"
#include "rank/vram_tier.h"

namespace colibri {

struct CudaExpertStats {
  uint64_t requests = 0;
  uint64_t device_us = 0;     // CUDA-event time of rows up, launches, partial down; summed
  uint64_t upload_us = 0;     // CUDA-event time of the copy stream's expert uploads; summed
  uint64_t upload_bytes = 0;  // expert bytes uploaded at start
};

class CudaExpertBackend final : public ExpertBackend {
 public:
  // An expert rank: `owned` (layer, expert) pairs read through `store`. vram_bytes > 0 is the
  // budget for expert slots (more than the device has free is an Error naming both numbers);
  // 0 = the device's free memory less a margin for the request buffers.
  CudaExpertBackend(const ModelConfig& config, ExpertStore& store,
                    std::span<const std::pair<int, int>> owned, int device, uint64_t vram_bytes,
                    VramCostModel cost = {});
  // A single process: every routed expert in `weights`.
  CudaExpertBackend(const ModelConfig& config, const ModelWeights& weights, int device,
                    uint64_t vram_bytes, VramCostModel cost = {});
  ~CudaExpertBackend() override;

  // Queues store reads of the experts that are not in VRAM.
  void prefetch(int layer, std::span<const int> experts) override;
  void compute(const ExpertRequest& request, float* partial) override;

  int device() const { return device_; }
  uint64_t device_bytes() const { return device_bytes_; }
  int slots() const { return tier_ ? tier_->cache().slots() : 0; }
  bool all_resident() const { return all_resident_; }
  const CudaExpertStats& stats() const { return stats_; }
  const VramTierStats& tier_stats() const { return tier_->stats(); }
  DeviceCounters device_stats() const override;

 private:
  void init(const std::vector<std::pair<int, int>>& owned, uint64_t vram_bytes,
            const VramCostModel& cost);
  // Packs expert (layer, expert) into pinned staging and enqueues its copy into `slot` on the
  // copy stream.
  void upload(int layer, int expert, int slot);

  const ModelConfig& config_;
  int device_;
  std::function<const MlpWeights&(int, int)> weights_of_;  // the store's acquire, or weights
  std::function<void()> done_with_;                        // the store's release
  ExpertStore* store_ = nullptr;
  ExpertSlotLayout layout_;  // of every slot: from the first owned expert
  uint64_t slot_bytes_ = 0;
  void* memory_ = nullptr;
  uint64_t device_bytes_ = 0;
  bool all_resident_ = true;
  std::vector<cuda::DeviceExpert> slot_experts_;  // [slots]
  std::unique_ptr<VramTier> tier_;
  cuda::ExpertGroupBuffers buffers_;
  cudaStream_t stream_ = nullptr, copy_stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr, upload_start_ = nullptr, uploaded_ = nullptr;
  static constexpr int kStaging = 4;  // pinned staging buffers for uploads in flight
  std::array<void*, kStaging> staging_{};
  std::array<cudaEvent_t, kStaging> staging_free_{};
  int next_staging_ = 0;
  std::vector<float> rows_f32_, cpu_rows_;
  std::vector<cuda::ExpertPair> pairs_;
  std::vector<cuda::DeviceExpert> descriptions_;
  std::vector<int> request_rows_;
  std::vector<int32_t> cpu_positions_;
  std::vector<int> not_resident_;
  CudaExpertStats stats_;
};

}  // namespace colibri
