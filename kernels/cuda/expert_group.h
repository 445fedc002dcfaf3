// The host side of one grouped expert FFN (cuda/expert_ffn.cuh): the slot index of a request's
// (row, expert, weight) pairs, and the device buffers it runs in. Plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "cuda/expert_ffn.cuh"

namespace colibri::cuda {

struct ExpertPair {
  int32_t row = 0, expert = 0;  // expert: any id; slots are grouped by ascending id
  float weight = 0;
};

// Slots grouped by ascending expert id (pairs of one expert in their given order) and, per row,
// its slots in ascending expert id: the order in which run_expert_pairs sums them.
struct ExpertGroupIndex {
  int n_rows = 0;
  int max_slots_per_expert = 0;
  std::vector<int32_t> experts;       // [n_experts] distinct ids, ascending
  std::vector<int32_t> expert_begin;  // [n_experts + 1]
  std::vector<int32_t> slot_row;      // [n_slots]
  std::vector<int32_t> row_begin;     // [n_rows + 1]
  std::vector<int32_t> row_slots;     // [n_slots]
  std::vector<float> row_weights;     // [n_slots]
};

// Throws std::invalid_argument when a row is outside [0, n_rows) or a row names an expert twice.
ExpertGroupIndex index_pairs(int n_rows, std::span<const ExpertPair> pairs);

// Device buffers for requests up to a capacity, grown on demand (never shrunk), with a pinned
// host staging area so that the index, the experts' descriptions and the rows go up in one copy.
class ExpertGroupBuffers {
 public:
  ExpertGroupBuffers() = default;
  ~ExpertGroupBuffers();
  ExpertGroupBuffers(const ExpertGroupBuffers&) = delete;
  ExpertGroupBuffers& operator=(const ExpertGroupBuffers&) = delete;

  // Enqueues on `stream`: the upload of index, experts[index.experts.size()] and x [n_rows,
  // hidden], the three launches, and the copy of out [n_rows, hidden] into `out_host` (pinned
  // or pageable host memory). Asynchronous: the caller synchronises `stream` before reading
  // out_host, and must not call run() again before that (the staging area is reused).
  void run(const ExpertGroupIndex& index, std::span<const DeviceExpert> experts,
           const float* x_host, int64_t hidden, int64_t inter, float* out_host,
           cudaStream_t stream);

  // The same in steps, for a request whose experts are not all on the device at once:
  //   stage():   one copy up of x, the index and `phases` description arrays (phase p's is
  //              descriptions[p * n_experts, (p + 1) * n_experts); an expert with null gate data
  //              is skipped by that phase);
  //   project(p): phase p's gate/up and down launches (the caller orders them after whatever
  //              they need, e.g. an expert upload on another stream, with events);
  //   host_y():  pinned [n_slots, hidden] where the caller writes the y rows of the slots of
  //              experts that no phase computes (valid after stage(), until the next stage());
  //   finish():  copies those experts' rows (positions in index.experts) up, combines, and
  //              copies out down into out_host.
  void stage(const ExpertGroupIndex& index, std::span<const DeviceExpert> descriptions, int phases,
             const float* x_host, int64_t hidden, int64_t inter, cudaStream_t stream);
  void project(int phase, cudaStream_t stream);
  float* host_y() { return host_y_; }
  void finish(std::span<const int32_t> host_experts, float* out_host, cudaStream_t stream);

  // Tensor cores for experts with 8+ slots (the default), or the CUDA-core path for every batch.
  void set_tensor_cores(bool on) { group_.tensor_cores = on ? 1 : 0; }

  // The last run's group (device pointers), e.g. to launch it again in a benchmark.
  const ExpertGroup& group() const { return group_; }

 private:
  void reserve(size_t staging_bytes, size_t workspace_floats);

  const ExpertGroupIndex* index_ = nullptr;      // of the staged request
  const DeviceExpert* phase_experts_ = nullptr;  // device: the phases' description arrays
  int phases_ = 0;
  float* host_y_ = nullptr;  // pinned [n_slots, hidden]
  size_t host_y_floats_ = 0;
  void* staging_host_ = nullptr;  // pinned
  void* staging_device_ = nullptr;
  size_t staging_bytes_ = 0;
  float* workspace_ = nullptr;  // h, y_slots, out
  size_t workspace_floats_ = 0;
  ExpertGroup group_;
  std::vector<uint8_t> phase_fp4_mma_;  // per phase: its experts fit nvfp4_mma_fits
};

}  // namespace colibri::cuda
