#include "cuda/expert_group.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

#include "cuda/check.h"
#include "cuda/nvfp4_mma.cuh"

namespace colibri::cuda {

ExpertGroupIndex index_pairs(int n_rows, std::span<const ExpertPair> pairs) {
  ExpertGroupIndex index;
  index.n_rows = n_rows;
  for (const ExpertPair& p : pairs)
    if (p.row < 0 || p.row >= n_rows)
      throw std::invalid_argument("expert pair row " + std::to_string(p.row) + " outside [0, " +
                                  std::to_string(n_rows) + ")");
  // Slots: pairs stably sorted by expert.
  std::vector<int32_t> order(pairs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return pairs[a].expert < pairs[b].expert; });
  index.slot_row.resize(pairs.size());
  std::vector<int32_t> slot_of_pair(pairs.size());
  for (size_t s = 0; s < order.size(); ++s) {
    const ExpertPair& p = pairs[size_t(order[s])];
    if (index.experts.empty() || index.experts.back() != p.expert) {
      index.experts.push_back(p.expert);
      index.expert_begin.push_back(int32_t(s));
    }
    index.slot_row[s] = p.row;
    slot_of_pair[size_t(order[s])] = int32_t(s);
  }
  index.expert_begin.push_back(int32_t(pairs.size()));
  for (size_t e = 0; e + 1 < index.expert_begin.size(); ++e)
    index.max_slots_per_expert =
        std::max(index.max_slots_per_expert, index.expert_begin[e + 1] - index.expert_begin[e]);
  // Per row: its slots in slot order, which is ascending expert order.
  index.row_begin.assign(size_t(n_rows) + 1, 0);
  for (const ExpertPair& p : pairs) ++index.row_begin[size_t(p.row) + 1];
  for (int r = 0; r < n_rows; ++r) index.row_begin[size_t(r) + 1] += index.row_begin[size_t(r)];
  index.row_slots.resize(pairs.size());
  index.row_weights.resize(pairs.size());
  std::vector<int32_t> fill(index.row_begin.begin(), index.row_begin.end() - 1);
  for (size_t s = 0; s < order.size(); ++s) {
    const ExpertPair& p = pairs[size_t(order[s])];
    const int32_t k = fill[size_t(p.row)]++;
    if (k > index.row_begin[size_t(p.row)] &&
        pairs[size_t(order[size_t(index.row_slots[size_t(k - 1)])])].expert == p.expert)
      throw std::invalid_argument("row " + std::to_string(p.row) + " names expert " +
                                  std::to_string(p.expert) + " twice");
    index.row_slots[size_t(k)] = int32_t(s);
    index.row_weights[size_t(k)] = p.weight;
  }
  return index;
}

ExpertGroupBuffers::~ExpertGroupBuffers() {
  cudaFreeHost(host_y_);
  cudaFreeHost(staging_host_);
  cudaFree(staging_device_);
  cudaFree(workspace_);
}

void ExpertGroupBuffers::reserve(size_t staging_bytes, size_t workspace_floats) {
  if (staging_bytes > staging_bytes_) {
    // The previous contents are no longer needed: the caller synchronised after the last run.
    CHECK_CUDA(cudaFreeHost(staging_host_));
    CHECK_CUDA(cudaFree(staging_device_));
    staging_bytes_ = std::max(staging_bytes, staging_bytes_ * 2);
    CHECK_CUDA(cudaMallocHost(&staging_host_, staging_bytes_));
    CHECK_CUDA(cudaMalloc(&staging_device_, staging_bytes_));
  }
  if (workspace_floats > workspace_floats_) {
    CHECK_CUDA(cudaFree(workspace_));
    workspace_floats_ = std::max(workspace_floats, workspace_floats_ * 2);
    CHECK_CUDA(
        cudaMalloc(reinterpret_cast<void**>(&workspace_), workspace_floats_ * sizeof(float)));
  }
}

namespace {

size_t align16(size_t n) {
  return (n + 15) & ~size_t(15);
}

}  // namespace

void ExpertGroupBuffers::run(const ExpertGroupIndex& index, std::span<const DeviceExpert> experts,
                             const float* x_host, int64_t hidden, int64_t inter, float* out_host,
                             cudaStream_t stream) {
  stage(index, experts, 1, x_host, hidden, inter, stream);
  project(0, stream);
  finish({}, out_host, stream);
}

void ExpertGroupBuffers::stage(const ExpertGroupIndex& index,
                               std::span<const DeviceExpert> descriptions, int phases,
                               const float* x_host, int64_t hidden, int64_t inter,
                               cudaStream_t stream) {
  const size_t n_experts = index.experts.size(), n_slots = index.slot_row.size();
  if (phases < 1 || descriptions.size() != size_t(phases) * n_experts)
    throw std::invalid_argument("ExpertGroupBuffers: " + std::to_string(descriptions.size()) +
                                " expert descriptions for " + std::to_string(phases) +
                                " phases of " + std::to_string(n_experts) + " experts");
  const size_t n_rows = size_t(index.n_rows);
  // Staging layout: x, experts, then the int and float index arrays, each 16-byte aligned.
  const size_t x_bytes = n_rows * size_t(hidden) * sizeof(float);
  size_t offset = 0;
  const auto take = [&](size_t bytes) {
    const size_t at = offset;
    offset += align16(bytes);
    return at;
  };
  const size_t at_x = take(x_bytes);
  const size_t at_experts = take(descriptions.size() * sizeof(DeviceExpert));
  const size_t at_expert_begin = take(index.expert_begin.size() * sizeof(int32_t));
  const size_t at_slot_row = take(n_slots * sizeof(int32_t));
  const size_t at_row_begin = take(index.row_begin.size() * sizeof(int32_t));
  const size_t at_row_slots = take(n_slots * sizeof(int32_t));
  const size_t at_row_weights = take(n_slots * sizeof(float));
  const size_t h_floats = align16(n_slots * size_t(inter) * 4) / 4;
  const size_t y_floats = align16(n_slots * size_t(hidden) * 4) / 4;
  const size_t out_floats = n_rows * size_t(hidden);
  reserve(offset, h_floats + y_floats + out_floats);
  if (n_slots * size_t(hidden) > host_y_floats_) {
    CHECK_CUDA(cudaFreeHost(host_y_));
    host_y_floats_ = std::max(n_slots * size_t(hidden), host_y_floats_ * 2);
    CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&host_y_), host_y_floats_ * sizeof(float)));
  }

  auto* host = static_cast<std::byte*>(staging_host_);
  auto* device = static_cast<std::byte*>(staging_device_);
  const auto put = [&](size_t at, const void* src, size_t bytes) {
    if (bytes) std::memcpy(host + at, src, bytes);
  };
  put(at_x, x_host, x_bytes);
  put(at_experts, descriptions.data(), descriptions.size() * sizeof(DeviceExpert));
  put(at_expert_begin, index.expert_begin.data(), index.expert_begin.size() * sizeof(int32_t));
  put(at_slot_row, index.slot_row.data(), n_slots * sizeof(int32_t));
  put(at_row_begin, index.row_begin.data(), index.row_begin.size() * sizeof(int32_t));
  put(at_row_slots, index.row_slots.data(), n_slots * sizeof(int32_t));
  put(at_row_weights, index.row_weights.data(), n_slots * sizeof(float));
  if (offset) CHECK_CUDA(cudaMemcpyAsync(device, host, offset, cudaMemcpyHostToDevice, stream));

  ExpertGroup& g = group_;
  g.n_experts = int(n_experts);
  g.n_slots = int(n_slots);
  g.n_rows = index.n_rows;
  g.max_slots_per_expert = index.max_slots_per_expert;
  g.hidden = hidden;
  g.inter = inter;
  g.experts = reinterpret_cast<const DeviceExpert*>(device + at_experts);
  g.expert_begin = reinterpret_cast<const int32_t*>(device + at_expert_begin);
  g.slot_row = reinterpret_cast<const int32_t*>(device + at_slot_row);
  g.row_begin = reinterpret_cast<const int32_t*>(device + at_row_begin);
  g.row_slots = reinterpret_cast<const int32_t*>(device + at_row_slots);
  g.row_weights = reinterpret_cast<const float*>(device + at_row_weights);
  g.x = reinterpret_cast<const float*>(device + at_x);
  g.h = workspace_;
  g.y_slots = workspace_ + h_floats;
  g.out = workspace_ + h_floats + y_floats;
  index_ = &index;
  phase_experts_ = g.experts;
  phases_ = phases;
  phase_fp4_mma_.assign(size_t(phases), 0);
  for (int p = 0; p < phases; ++p)
    phase_fp4_mma_[size_t(p)] =
        nvfp4_mma_fits(descriptions.data() + size_t(p) * n_experts, int64_t(n_experts)) ? 1 : 0;
}

void ExpertGroupBuffers::project(int phase, cudaStream_t stream) {
  if (phase < 0 || phase >= phases_)
    throw std::invalid_argument("ExpertGroupBuffers::project: phase " + std::to_string(phase) +
                                " of " + std::to_string(phases_));
  ExpertGroup g = group_;
  g.experts = phase_experts_ + size_t(phase) * size_t(g.n_experts);
  g.fp4_mma = phase_fp4_mma_[size_t(phase)];
  expert_ffn_grouped_no_combine(g, stream);
}

void ExpertGroupBuffers::finish(std::span<const int32_t> host_experts, float* out_host,
                                cudaStream_t stream) {
  const ExpertGroup& g = group_;
  for (int32_t e : host_experts) {
    if (e < 0 || e >= g.n_experts)
      throw std::invalid_argument("ExpertGroupBuffers::finish: expert position " +
                                  std::to_string(e) + " of " + std::to_string(g.n_experts));
    const size_t begin = size_t(index_->expert_begin[size_t(e)]);
    const size_t count = size_t(index_->expert_begin[size_t(e) + 1]) - begin;
    CHECK_CUDA(
        cudaMemcpyAsync(g.y_slots + begin * size_t(g.hidden), host_y_ + begin * size_t(g.hidden),
                        count * size_t(g.hidden) * sizeof(float), cudaMemcpyHostToDevice, stream));
  }
  expert_ffn_combine(g, stream);
  const size_t out_floats = size_t(g.n_rows) * size_t(g.hidden);
  if (out_floats)
    CHECK_CUDA(cudaMemcpyAsync(out_host, g.out, out_floats * sizeof(float), cudaMemcpyDeviceToHost,
                               stream));
}

}  // namespace colibri::cuda
