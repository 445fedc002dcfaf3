#include "rank/cuda_expert_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <optional>
#include <string>

#include "common/error.h"
#include "cuda/check.h"
#include "moe/experts.h"
#include "rank/expert_slot.h"

namespace colibri {
namespace {

// The CUDA expert kernels' format for a weight format; none for a format they do not read (FP8
// blocks, which expert_slot_layout refuses).
std::optional<cuda::WeightFormat> cuda_format(WeightFormat format) {
  switch (format) {
    case WeightFormat::kF32:
      return cuda::WeightFormat::kF32;
    case WeightFormat::kBF16:
      return cuda::WeightFormat::kBF16;
    case WeightFormat::kFp8Block:
      return std::nullopt;
    case WeightFormat::kNvfp4:
      return cuda::WeightFormat::kNvfp4;
    case WeightFormat::kInt8Row:
      return cuda::WeightFormat::kInt8Row;
    case WeightFormat::kInt4Row:
      return cuda::WeightFormat::kInt4Row;
    case WeightFormat::kInt4Grouped:
      return cuda::WeightFormat::kInt4Grouped;
  }
  return std::nullopt;
}

// A slot's description with the NVFP4 second-level scales of the expert it holds (each expert's
// own; the codes and E4M3 scales are in the slot).
cuda::DeviceExpert with_globals(cuda::DeviceExpert d, const MlpWeights& w) {
  if (d.gate.format != cuda::WeightFormat::kNvfp4) return d;
  d.gate.global = w.gate.nvfp4.global;
  d.up.global = w.up.nvfp4.global;
  d.down.global = w.down.nvfp4.global;
  return d;
}

}  // namespace

CudaExpertBackend::CudaExpertBackend(const ModelConfig& config, ExpertStore& store,
                                     std::span<const std::pair<int, int>> owned, int device,
                                     uint64_t vram_bytes, VramCostModel cost)
    : config_(config), device_(device), store_(&store) {
  weights_of_ = [&store](int layer, int expert) -> const MlpWeights& {
    return store.acquire(layer, expert);
  };
  done_with_ = [&store] { store.release(); };
  init({owned.begin(), owned.end()}, vram_bytes, cost);
}

CudaExpertBackend::CudaExpertBackend(const ModelConfig& config, const ModelWeights& weights,
                                     int device, uint64_t vram_bytes, VramCostModel cost)
    : config_(config), device_(device) {
  std::vector<std::pair<int, int>> owned;
  for (size_t l = 0; l < weights.layers.size(); ++l)
    for (size_t e = 0; e < weights.layers[l].experts.size(); ++e)
      if (!weights.layers[l].experts[e].empty()) owned.emplace_back(int(l), int(e));
  weights_of_ = [&weights](int layer, int expert) -> const MlpWeights& {
    return weights.layers[size_t(layer)].experts[size_t(expert)];
  };
  done_with_ = [] {};
  init(owned, vram_bytes, cost);
}

CudaExpertBackend::~CudaExpertBackend() {
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  if (stream_) cudaStreamSynchronize(stream_);
  for (cudaEvent_t e : {start_, stop_, upload_start_, uploaded_})
    if (e) cudaEventDestroy(e);
  for (int i = 0; i < kStaging; ++i) {
    if (staging_free_[size_t(i)]) cudaEventDestroy(staging_free_[size_t(i)]);
    cudaFreeHost(staging_[size_t(i)]);
  }
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  if (stream_) cudaStreamDestroy(stream_);
  cudaFree(memory_);
}

DeviceCounters CudaExpertBackend::device_stats() const {
  DeviceCounters out;
  out.vram_bytes = device_bytes_;
  out.gpu_requests = stats_.requests;
  out.gpu_us = stats_.device_us;
  if (tier_) {
    const VramTierStats& t = tier_->stats();
    out.vram_hits = t.hits;
    out.vram_uploads = t.uploads;
    out.vram_cpu_experts = t.cpu_experts;
    out.vram_evictions = t.evictions;
    out.vram_upload_bytes = t.upload_bytes;
  }
  out.vram_upload_us = stats_.upload_us;
  return out;
}

void CudaExpertBackend::init(const std::vector<std::pair<int, int>>& owned, uint64_t vram_bytes,
                             const VramCostModel& cost) {
  CHECK_CUDA(cudaSetDevice(device_));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&start_, &stop_, &upload_start_, &uploaded_})
    CHECK_CUDA(cudaEventCreate(e));
  const int64_t hidden = config_.hidden_size, inter = config_.moe_intermediate_size;
  // gate/up and down: 2 * hidden * inter multiply-adds each; per row of the CPU's batch.
  const double flops_per_row = 6.0 * double(hidden) * double(inter);
  if (owned.empty()) {
    tier_ = std::make_unique<VramTier>(0, 0, flops_per_row, cost);
    return;
  }
  // Every owned expert has the same shapes and formats within a model: lay out a slot from the
  // first, and check each one against it as it is packed (rank/expert_slot.h).
  layout_ = expert_slot_layout(weights_of_(owned[0].first, owned[0].second));
  done_with_();
  slot_bytes_ = layout_.bytes;
  {
    const int64_t rows[3] = {inter, inter, hidden}, cols[3] = {hidden, hidden, inter};
    for (size_t m = 0; m < 3; ++m) {
      const SlotMatrix& l = layout_.matrices[m];
      if (l.rows != rows[m] || l.cols != cols[m])
        fail("layer {} expert {} {} on GPU {}: shape {}x{}, expected {}x{}", owned[0].first,
             owned[0].second, kExpertMatrixNames[m], device_, l.rows, l.cols, rows[m], cols[m]);
    }
  }
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  // Room left for the request buffers (rows, workspace, partials) when the budget is the device.
  const uint64_t margin = std::max<uint64_t>(uint64_t(256) << 20, free_bytes / 32);
  if (vram_bytes > free_bytes)
    fail(
        "GPU {}: the VRAM budget of {:.2f} GiB (--vram-gb or the layout's vram_gb) is more than "
        "the {:.2f} GiB the device has free",
        device_, double(vram_bytes) / double(1 << 30), double(free_bytes) / double(1 << 30));
  const uint64_t budget =
      vram_bytes > 0 ? vram_bytes : (free_bytes > margin ? free_bytes - margin : 0);
  const uint64_t slots = std::min<uint64_t>(owned.size(), budget / slot_bytes_);
  all_resident_ = slots == owned.size();
  tier_ = std::make_unique<VramTier>(int(slots), slot_bytes_, flops_per_row, cost);
  if (slots > 0) CHECK_CUDA(cudaMalloc(&memory_, slots * slot_bytes_));
  device_bytes_ = slots * slot_bytes_;
  for (int i = 0; i < kStaging; ++i) {
    CHECK_CUDA(cudaMallocHost(&staging_[size_t(i)], slot_bytes_));
    CHECK_CUDA(cudaEventCreateWithFlags(&staging_free_[size_t(i)], cudaEventDisableTiming));
  }
  // Every slot's description: the same offsets within each slot.
  auto* base = static_cast<std::byte*>(memory_);
  slot_experts_.resize(size_t(slots));
  for (uint64_t s = 0; s < slots; ++s) {
    cuda::DeviceMatrix dev[3];
    for (size_t m = 0; m < 3; ++m) {
      const SlotMatrix& l = layout_.matrices[m];
      // A format the kernels read: expert_slot_layout refused the others.
      const cuda::WeightFormat format = *cuda_format(l.format);
      const std::string what =
          fmt::format("{} of VRAM slot {} on GPU {}", kExpertMatrixNames[m], s, device_);
      std::byte* slot = base + s * slot_bytes_;
      const auto floats = [&](uint64_t at, uint64_t bytes) {
        return bytes ? reinterpret_cast<const float*>(slot + at) : nullptr;
      };
      try {
        // NVFP4: the global scale is set from the expert uploaded into the slot (with_globals).
        dev[m] = format == cuda::WeightFormat::kNvfp4
                     ? cuda::device_matrix_nvfp4(
                           l.rows, l.cols, reinterpret_cast<const uint8_t*>(slot + l.data_at),
                           reinterpret_cast<const uint8_t*>(slot + l.scales_at), 1.0f, what.c_str())
                     : cuda::device_matrix(format, l.group_size, l.rows, l.cols, slot + l.data_at,
                                           floats(l.scales_at, l.scale_bytes), what.c_str(),
                                           floats(l.offsets_at, l.offset_bytes));
      } catch (const std::invalid_argument& e) {
        fail("{}", e.what());
      }
    }
    slot_experts_[size_t(s)] = {dev[0], dev[1], dev[2]};
  }
  // The hot set at start: all owned experts, or as many as fit, round robin over layers.
  for (const auto& [layer, expert] : all_resident_ ? owned : vram_fill_order(owned)) {
    const int slot = tier_->preload(layer, expert);
    if (slot < 0) break;
    upload(layer, expert, slot);
    done_with_();  // the staging copy is done: upload() waits for the buffer before reusing it
    stats_.upload_bytes += slot_bytes_;
  }
  CHECK_CUDA(cudaStreamSynchronize(copy_stream_));
}

void CudaExpertBackend::upload(int layer, int expert, int slot) {
  const MlpWeights& w = weights_of_(layer, expert);
  const size_t k = size_t(next_staging_);
  next_staging_ = (next_staging_ + 1) % kStaging;
  CHECK_CUDA(cudaEventSynchronize(staging_free_[k]));  // its previous copy is done
  auto* staging = static_cast<std::byte*>(staging_[k]);
  try {
    pack_expert_slot(layout_, w, layer, expert, staging);
  } catch (const Error& e) {
    fail("GPU {}: {}", device_, e.what());
  }
  slot_experts_[size_t(slot)] = with_globals(slot_experts_[size_t(slot)], w);
  CHECK_CUDA(cudaMemcpyAsync(static_cast<std::byte*>(memory_) + uint64_t(slot) * slot_bytes_,
                             staging, slot_bytes_, cudaMemcpyHostToDevice, copy_stream_));
  CHECK_CUDA(cudaEventRecord(staging_free_[k], copy_stream_));
}

void CudaExpertBackend::prefetch(int layer, std::span<const int> experts) {
  if (!store_ || all_resident_) return;
  not_resident_.clear();
  for (int e : experts)
    if (!tier_->cache().contains(layer, e)) not_resident_.push_back(e);
  if (!not_resident_.empty()) store_->prefetch(layer, not_resident_);
}

void CudaExpertBackend::compute(const ExpertRequest& request, float* partial) {
  const int hidden = config_.hidden_size;
  const int64_t inter = config_.moe_intermediate_size;
  const float* rows = host_f32_rows(request, hidden, rows_f32_);
  pairs_.clear();
  for (const RoutedPair& p : request.pairs) {
    if (p.row >= uint32_t(request.n_rows))
      fail("layer {}: pair row {} outside the request's {} rows", request.layer, p.row,
           request.n_rows);
    if (p.expert >= uint32_t(config_.n_routed_experts))
      fail("layer {}: routed expert {} out of range [0, {})", request.layer, p.expert,
           config_.n_routed_experts);
    pairs_.push_back({int32_t(p.row), int32_t(p.expert), p.weight});
  }
  cuda::ExpertGroupIndex index;
  try {
    index = cuda::index_pairs(request.n_rows, pairs_);
  } catch (const std::invalid_argument& e) {
    fail("layer {}: {}", request.layer, e.what());
  }
  const size_t n = index.experts.size();
  request_rows_.resize(n);
  for (size_t i = 0; i < n; ++i)
    request_rows_[i] = index.expert_begin[i + 1] - index.expert_begin[i];
  const std::vector<VramPlanEntry> plan = tier_->plan(request.layer, index.experts, request_rows_);
  // Phase 0: the resident experts; phase 1: the ones uploaded now. CPU experts: neither.
  const bool uploads = std::any_of(plan.begin(), plan.end(), [](const VramPlanEntry& e) {
    return e.kind == VramPlanEntry::kUpload;
  });
  const int phases = uploads ? 2 : 1;
  descriptions_.assign(size_t(phases) * n, cuda::DeviceExpert{});
  cpu_positions_.clear();
  for (size_t i = 0; i < n; ++i) {
    if (plan[i].kind == VramPlanEntry::kCpu) {
      cpu_positions_.push_back(int32_t(i));
      continue;
    }
    const size_t phase = plan[i].kind == VramPlanEntry::kHit ? 0 : 1;
    descriptions_[phase * n + i] = slot_experts_[size_t(plan[i].slot)];
    // An expert uploaded now: its NVFP4 global scales, before the descriptions go to the device.
    // (Other formats: their weights are not read before the upload itself.)
    if (phase == 1 && layout_.matrices[0].format == WeightFormat::kNvfp4)
      descriptions_[phase * n + i] =
          with_globals(descriptions_[phase * n + i], weights_of_(request.layer, plan[i].expert));
  }
  CHECK_CUDA(cudaSetDevice(device_));
  CHECK_CUDA(cudaEventRecord(start_, stream_));
  try {
    buffers_.stage(index, descriptions_, phases, rows, hidden, inter, stream_);
    buffers_.project(0, stream_);
    if (uploads) {
      // Each missed expert goes up on the copy stream while phase 0 runs; phase 1 waits for them.
      // The request's experts are not evicted (the tier holds them until release), and the
      // previous request's kernels are done (it was synchronised), so a slot is free to reuse.
      CHECK_CUDA(cudaEventRecord(upload_start_, copy_stream_));
      for (size_t i = 0; i < n; ++i)
        if (plan[i].kind == VramPlanEntry::kUpload)
          upload(request.layer, plan[i].expert, plan[i].slot);
      CHECK_CUDA(cudaEventRecord(uploaded_, copy_stream_));
      CHECK_CUDA(cudaStreamWaitEvent(stream_, uploaded_, 0));
      buffers_.project(1, stream_);
    }
    // The CPU experts while the device works: y rows of their slots, in slot order.
    for (int32_t i : cpu_positions_) {
      const MlpWeights& w = weights_of_(request.layer, index.experts[size_t(i)]);
      const int32_t begin = index.expert_begin[size_t(i)], count = request_rows_[size_t(i)];
      cpu_rows_.resize(size_t(count) * size_t(hidden));
      for (int32_t k = 0; k < count; ++k)
        std::copy_n(rows + size_t(index.slot_row[size_t(begin + k)]) * size_t(hidden), hidden,
                    &cpu_rows_[size_t(k) * size_t(hidden)]);
      mlp_forward(w, cpu_rows_.data(), count, buffers_.host_y() + size_t(begin) * size_t(hidden));
    }
    buffers_.finish(cpu_positions_, partial, stream_);
  } catch (const std::invalid_argument& e) {
    fail("layer {} on GPU {}: {}", request.layer, device_, e.what());
  }
  CHECK_CUDA(cudaEventRecord(stop_, stream_));
  CHECK_CUDA(cudaStreamSynchronize(stream_));
  done_with_();
  tier_->release();
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
  stats_.device_us += uint64_t(ms * 1000.0f);
  if (uploads) {
    CHECK_CUDA(cudaEventElapsedTime(&ms, upload_start_, uploaded_));
    stats_.upload_us += uint64_t(ms * 1000.0f);
  }
  ++stats_.requests;
}

}  // namespace colibri
