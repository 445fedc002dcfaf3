// The coordinator's per-layer compute on one CUDA device: the residual stream, every dense
// weight and the KV blocks of every sequence live in VRAM. Product weights are NVFP4 as stored
// (E2M1 codes and E4M3 block scales), BF16 (BF16 as stored; FP8 and container int8/int4
// converted at upload), or fp32 where the loaded values are not all BF16 values (an fp32
// checkpoint); kv_b_proj (dequantized at load when NVFP4) and the embedding table are BF16 or
// fp32; norms and routers are fp32 (gpu_staging.h: device_weight_form). The block table of each
// call is packed on the host (gpu_staging.h) and uploaded with the rows' tokens and positions.
// NVFP4 products run in cuda::matrix_linear (kernels/cuda/expert_ffn.cuh: the codes widened in
// registers, each 16 columns' sum of x * e2m1 scaled by e4m3 * global, fp32 activations, as the
// CPU's --activations f32). The others go through cuBLAS with fp32 accumulation: BF16 weights
// take the fp32 activations as a BF16 hi + lo pair in one product (16 significant bits; the
// weights are read once), fp32 weights run in fp32 without TF32. The rest runs in kernels/cuda,
// in fp32.
// Once per MoE layer the normed rows are downloaded for the Dispatcher and
// the combined partial uploaded (host views: the NCCL transport will take the device rows,
// Device::kCuda, instead). Logits are downloaded; sampling stays on the host. Non-finite values
// in the residual stream are flagged on the device and reported, by layer, when the call ends.
//
// The KvManager keeps the bookkeeping (sequences, blocks); its host storage is never touched
// here (allocated without initialisation, it stays virtual).
// Only built with CUDA; created through make_gpu_coordinator (src/node/devices.h).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "coordinator/coordinator_compute.h"
#include "coordinator/gpu_staging.h"

namespace colibri {

class CudaCompute final : public CoordinatorCompute {
 public:
  CudaCompute(const ModelConfig& config, const ModelWeights& weights, KvManager& kv, int max_rows,
              int device, Profiler* profiler = nullptr);
  ~CudaCompute() override;
  CudaCompute(const CudaCompute&) = delete;
  CudaCompute& operator=(const CudaCompute&) = delete;

  void begin(const Batch& batch) override;
  void attention(int layer) override;
  Routing route(int layer) override;
  ConstView normed(Device where) override;
  void shared_expert(int layer) override;
  View routed(Device where) override;
  void add_moe(int layer) override;
  void dense_mlp(int layer) override;
  std::vector<float> logits(const Batch& batch) override;

  // Bytes of VRAM this compute allocated (weights, KV, scratch).
  uint64_t device_bytes() const { return device_bytes_; }
  // Of those, the weight matrices' (products and the embedding table) by the form they take on
  // the device (NVFP4: the stored codes and block scales).
  struct DeviceWeightBytes {
    uint64_t nvfp4 = 0, bf16 = 0, f32 = 0;
  };
  const DeviceWeightBytes& weight_bytes() const { return weight_bytes_; }

  struct Impl;  // device weights and scratch (cuda_compute.cpp)

 private:
  const ModelConfig& config_;
  KvManager& kv_;
  int max_rows_;
  int device_;
  cudaStream_t stream_ = nullptr;
  uint64_t device_bytes_ = 0;
  DeviceWeightBytes weight_bytes_;
  std::unique_ptr<Impl> impl_;
  const Batch* batch_ = nullptr;
  BlockTable table_;
  float* normed_host_ = nullptr;   // pinned [max_rows, hidden]
  float* routed_host_ = nullptr;   // pinned [max_rows, hidden]
  bool routed_on_device_ = false;  // this layer's combine writes the device's delta
};

}  // namespace colibri
