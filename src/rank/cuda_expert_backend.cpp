#include "rank/cuda_expert_backend.h"

#include <fmt/format.h>

#include <array>
#include <cstring>
#include <functional>
#include <string>

#include "common/error.h"
#include "cuda/check.h"

namespace colibri {
namespace {

uint64_t key(int layer, int expert) {
  return (uint64_t(uint32_t(layer)) << 32) | uint32_t(expert);
}

uint64_t padded(uint64_t bytes) {
  return (bytes + 255) / 256 * 256;
}

cuda::WeightFormat weight_format(kernels::QuantFormat f) {
  switch (f) {
    case kernels::QuantFormat::kInt4Row:
      return cuda::WeightFormat::kInt4Row;
    case kernels::QuantFormat::kInt4Grouped:
      return cuda::WeightFormat::kInt4Grouped;
    case kernels::QuantFormat::kInt8Row:
      return cuda::WeightFormat::kInt8Row;
  }
  fail("unknown quantized format");
}

// The host bytes of one matrix of an expert: data and scales (none for fp32).
struct HostMatrix {
  cuda::WeightFormat format;
  int group_size;
  int64_t rows, cols;
  const void* data;
  uint64_t data_bytes;
  const float* scales;
  uint64_t scale_bytes;
};

HostMatrix host_matrix(const Matrix& fp32, const QuantMatrix& quant) {
  if (!quant.empty())
    return {weight_format(quant.format),
            quant.group_size,
            quant.rows,
            quant.cols,
            quant.data.data(),
            quant.data.size(),
            quant.scales.data(),
            4 * quant.scales.size()};
  return {cuda::WeightFormat::kF32, 0,       fp32.rows, fp32.cols, fp32.data.data(),
          4 * fp32.data.size(),     nullptr, 0};
}

std::array<HostMatrix, 3> host_matrices(const MlpWeights& w) {
  return {host_matrix(w.gate, w.quant.gate), host_matrix(w.up, w.quant.up),
          host_matrix(w.down, w.quant.down)};
}

}  // namespace

CudaExpertBackend::CudaExpertBackend(const ModelConfig& config, ExpertStore& store,
                                     std::span<const std::pair<int, int>> owned, int device,
                                     uint64_t vram_bytes)
    : config_(config), device_(device) {
  upload(
      {owned.begin(), owned.end()},
      [&](int layer, int expert) -> const MlpWeights& { return store.acquire(layer, expert); },
      [&] { store.release(); }, vram_bytes);
}

CudaExpertBackend::CudaExpertBackend(const ModelConfig& config, const ModelWeights& weights,
                                     int device, uint64_t vram_bytes)
    : config_(config), device_(device) {
  std::vector<std::pair<int, int>> owned;
  for (size_t l = 0; l < weights.layers.size(); ++l)
    for (size_t e = 0; e < weights.layers[l].experts.size(); ++e)
      if (!weights.layers[l].experts[e].empty()) owned.emplace_back(int(l), int(e));
  upload(
      owned,
      [&](int layer, int expert) -> const MlpWeights& {
        return weights.layers[size_t(layer)].experts[size_t(expert)];
      },
      [] {}, vram_bytes);
}

CudaExpertBackend::~CudaExpertBackend() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (start_) cudaEventDestroy(start_);
  if (stop_) cudaEventDestroy(stop_);
  if (stream_) cudaStreamDestroy(stream_);
  cudaFree(memory_);
}

void CudaExpertBackend::upload(const std::vector<std::pair<int, int>>& owned,
                               const std::function<const MlpWeights&(int, int)>& weights_of,
                               const std::function<void()>& done_with, uint64_t vram_bytes) {
  CHECK_CUDA(cudaSetDevice(device_));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CHECK_CUDA(cudaEventCreate(&start_));
  CHECK_CUDA(cudaEventCreate(&stop_));
  // Every owned expert has the same shapes and formats within a model: size from the first, and
  // check each one against it while uploading.
  if (owned.empty()) return;
  uint64_t per_expert = 0;
  {
    for (const HostMatrix& m : host_matrices(weights_of(owned[0].first, owned[0].second)))
      per_expert += padded(m.data_bytes) + padded(m.scale_bytes);
    done_with();
  }
  const uint64_t total = per_expert * owned.size();
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (vram_bytes > 0 && total > vram_bytes)
    fail(
        "GPU {}: the {} owned routed experts take {:.2f} GiB, over the VRAM budget of {:.2f} GiB "
        "(--vram-gb or the layout's vram_gb); this build keeps every owned expert in VRAM",
        device_, owned.size(), double(total) / double(1 << 30),
        double(vram_bytes) / double(1 << 30));
  if (total > free_bytes)
    fail("GPU {}: the {} owned routed experts take {:.2f} GiB, but the device has {:.2f} GiB free",
         device_, owned.size(), double(total) / double(1 << 30),
         double(free_bytes) / double(1 << 30));
  CHECK_CUDA(cudaMalloc(&memory_, total));
  device_bytes_ = total;

  // Through one pinned staging buffer, one expert at a time.
  void* staging = nullptr;
  CHECK_CUDA(cudaMallocHost(&staging, per_expert));
  auto* base = static_cast<std::byte*>(memory_);
  uint64_t at = 0;
  for (const auto& [layer, expert] : owned) {
    const MlpWeights& w = weights_of(layer, expert);
    const auto host = host_matrices(w);
    const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
    const int64_t rows[3] = {config_.moe_intermediate_size, config_.moe_intermediate_size,
                             config_.hidden_size};
    const int64_t cols[3] = {config_.hidden_size, config_.hidden_size,
                             config_.moe_intermediate_size};
    cuda::DeviceMatrix dev[3];
    uint64_t offset = 0;
    for (int m = 0; m < 3; ++m) {
      const HostMatrix& h = host[size_t(m)];
      const std::string what =
          fmt::format("layer {} expert {} {} on GPU {}", layer, expert, names[m], device_);
      if (h.rows != rows[m] || h.cols != cols[m])
        fail("{}: shape {}x{}, expected {}x{}", what, h.rows, h.cols, rows[m], cols[m]);
      if (offset + padded(h.data_bytes) + padded(h.scale_bytes) > per_expert)
        fail("{}: larger than the first owned expert (formats differ between experts)", what);
      std::memcpy(static_cast<std::byte*>(staging) + offset, h.data, h.data_bytes);
      const uint64_t data_at = offset;
      offset += padded(h.data_bytes);
      if (h.scale_bytes)
        std::memcpy(static_cast<std::byte*>(staging) + offset, h.scales, h.scale_bytes);
      const uint64_t scales_at = offset;
      offset += padded(h.scale_bytes);
      try {
        dev[m] = cuda::device_matrix(
            h.format, h.group_size, h.rows, h.cols, base + at + data_at,
            h.scale_bytes ? reinterpret_cast<const float*>(base + at + scales_at) : nullptr,
            what.c_str());
      } catch (const std::invalid_argument& e) {
        fail("{}", e.what());
      }
    }
    done_with();
    CHECK_CUDA(cudaMemcpyAsync(base + at, staging, offset, cudaMemcpyHostToDevice, stream_));
    CHECK_CUDA(cudaStreamSynchronize(stream_));  // the staging buffer is reused
    experts_[key(layer, expert)] = {dev[0], dev[1], dev[2]};
    at += per_expert;
    stats_.upload_bytes += offset;
  }
  CHECK_CUDA(cudaFreeHost(staging));
}

void CudaExpertBackend::compute(const ExpertRequest& request, float* partial) {
  const int hidden = config_.hidden_size;
  const float* rows = host_f32_rows(request, hidden, rows_f32_);
  pairs_.clear();
  for (const RoutedPair& p : request.pairs) {
    if (p.row >= uint32_t(request.n_rows))
      fail("layer {}: pair row {} outside the request's {} rows", request.layer, p.row,
           request.n_rows);
    pairs_.push_back({int32_t(p.row), int32_t(p.expert), p.weight});
  }
  cuda::ExpertGroupIndex index;
  try {
    index = cuda::index_pairs(request.n_rows, pairs_);
  } catch (const std::invalid_argument& e) {
    fail("layer {}: {}", request.layer, e.what());
  }
  request_experts_.clear();
  for (int32_t e : index.experts) {
    const auto it = experts_.find(key(request.layer, e));
    if (it == experts_.end())
      fail("layer {}: expert {} is routed here but not owned by this rank (GPU {})", request.layer,
           e, device_);
    request_experts_.push_back(it->second);
  }
  CHECK_CUDA(cudaSetDevice(device_));
  CHECK_CUDA(cudaEventRecord(start_, stream_));
  buffers_.run(index, request_experts_, rows, hidden, config_.moe_intermediate_size, partial,
               stream_);
  CHECK_CUDA(cudaEventRecord(stop_, stream_));
  CHECK_CUDA(cudaStreamSynchronize(stream_));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
  stats_.device_us += uint64_t(ms * 1000.0f);
  ++stats_.requests;
}

}  // namespace colibri
