#include "rank/expert_backend.h"

#include <algorithm>

#include "common/error.h"
#include "moe/experts.h"

namespace colibri {

CpuExpertBackend::CpuExpertBackend(const ModelConfig& config, ExpertStore& store)
    : config_(config), store_(&store) {}

CpuExpertBackend::CpuExpertBackend(const ModelConfig& config, const ModelWeights& weights)
    : config_(config), weights_(&weights) {}

const float* host_f32_rows(const ExpertRequest& request, int hidden, std::vector<float>& buffer) {
  const size_t values = size_t(request.n_rows) * hidden;
  if (request.rows.count < values)
    fail("layer {}: {} row values for {} rows", request.layer, request.rows.count, request.n_rows);
  if (request.rows.type == ElemType::kF32 && request.rows.device == Device::kHost)
    return static_cast<const float*>(request.rows.data);
  if (buffer.size() < values) buffer.resize(values);
  to_f32({request.rows.data, request.rows.type, request.rows.device, values}, buffer.data());
  return buffer.data();
}

void CpuExpertBackend::prefetch(int layer, std::span<const int> experts) {
  if (store_) store_->prefetch(layer, experts);
}

void CpuExpertBackend::hint(int layer, std::span<const int> experts) {
  if (store_) store_->hint(layer, experts);
}

void CpuExpertBackend::compute(const ExpertRequest& request, float* partial) {
  const int hidden = config_.hidden_size;
  const float* rows = host_f32_rows(request, hidden, rows_f32_);
  // Every requested expert is queued for the loader, then computed in ascending order: the
  // missing ones are read while the resident ones run.
  requested_.clear();
  for (const RoutedPair& pair : request.pairs) requested_.push_back(int(pair.expert));
  std::sort(requested_.begin(), requested_.end());
  requested_.erase(std::unique(requested_.begin(), requested_.end()), requested_.end());
  if (!requested_.empty() &&
      (requested_.front() < 0 || requested_.back() >= config_.n_routed_experts))
    fail("layer {}: routed expert out of range [0, {})", request.layer, config_.n_routed_experts);
  if (weights_) {
    run_expert_pairs(weights_->layers[size_t(request.layer)], hidden, rows, request.n_rows,
                     request.pairs, partial);
    return;
  }
  store_->prefetch(request.layer, requested_);
  run_expert_pairs(
      [&](uint32_t e) -> const MlpWeights& { return store_->acquire(request.layer, int(e)); },
      hidden, rows, request.n_rows, request.pairs, partial);
  store_->release();
}

}  // namespace colibri
