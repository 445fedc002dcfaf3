#include "coordinator/coordinator_compute.h"

#include <algorithm>
#include <optional>

#include "common/error.h"
#include "common/finite.h"
#include "coordinator/cpu_attention.h"
#include "cpu/elementwise.h"
#include "moe/experts.h"

namespace colibri {

CpuCompute::CpuCompute(const ModelConfig& config, const ModelWeights& weights, KvManager& kv,
                       Profiler* profiler)
    : config_(config),
      weights_(weights),
      profiler_(profiler),
      attention_(std::make_unique<CpuAttention>(config, kv, profiler)) {}

CpuCompute::~CpuCompute() = default;

void CpuCompute::begin(const Batch& batch) {
  batch_ = &batch;
  const int n = batch.size(), hidden = config_.hidden_size;
  const size_t values = size_t(n) * hidden;
  for (auto* v : {&h_, &normed_, &delta_, &shared_})
    if (v->size() < values) v->resize(values);
  {
    OptionalScope scope(profiler_, Phase::kEmbed);
    for (int t = 0; t < n; ++t)
      std::copy_n(&weights_.embed.data[size_t(batch.rows[size_t(t)].token) * hidden], hidden,
                  h_.data() + size_t(t) * hidden);
  }
  attention_->begin(batch);
}

void CpuCompute::check_residual(int layer, const char* after) const {
  const size_t hidden = size_t(config_.hidden_size);
  const std::optional<size_t> bad =
      find_non_finite(std::span<const float>(h_.data(), size_t(batch_->size()) * hidden));
  if (!bad) return;
  const BatchRow& row = batch_->rows[*bad / hidden];
  fail("layer {}: {} made the residual stream non-finite ({} at sequence {} position {})", layer,
       after, h_[*bad], row.seq, row.pos);
}

void CpuCompute::add_delta() {
  const size_t values = size_t(batch_->size()) * config_.hidden_size;
  for (size_t i = 0; i < values; ++i) h_[i] += delta_[i];
}

void CpuCompute::attention(int l) {
  const LayerWeights& layer = weights_.layers[size_t(l)];
  const int n = batch_->size(), hidden = config_.hidden_size;
  kernels::rms_norm(h_.data(), n, hidden, layer.input_norm.data(), config_.rms_norm_eps,
                    normed_.data());
  attention_->forward(l, layer.attn, normed_.data(), delta_.data());
  add_delta();
  check_residual(l, "attention");
  kernels::rms_norm(h_.data(), n, hidden, layer.post_attention_norm.data(), config_.rms_norm_eps,
                    normed_.data());
}

Routing CpuCompute::route(int l) {
  return route_tokens(config_, weights_.layers[size_t(l)], normed_.data(), batch_->size());
}

ConstView CpuCompute::normed(Device) {
  return host_f32(normed_.data(), size_t(batch_->size()) * config_.hidden_size);
}

View CpuCompute::routed(Device) {
  return host_f32(delta_.data(), size_t(batch_->size()) * config_.hidden_size);
}

void CpuCompute::shared_expert(int l) {
  const LayerWeights& layer = weights_.layers[size_t(l)];
  if (!layer.shared_experts.empty())
    mlp_forward(layer.shared_experts, normed_.data(), batch_->size(), shared_.data());
}

void CpuCompute::add_moe(int l) {
  const size_t values = size_t(batch_->size()) * config_.hidden_size;
  if (!weights_.layers[size_t(l)].shared_experts.empty())
    for (size_t i = 0; i < values; ++i) delta_[i] += shared_[i];
  add_delta();
  check_residual(l, "the experts");
}

void CpuCompute::dense_mlp(int l) {
  mlp_forward(weights_.layers[size_t(l)].dense_mlp, normed_.data(), batch_->size(), delta_.data());
  add_delta();
  check_residual(l, "the dense MLP");
}

std::vector<float> CpuCompute::logits(const Batch& batch) {
  const int n = batch.size(), hidden = config_.hidden_size;
  int rows = 0;
  for (int t = 0; t < n; ++t) {
    if (!batch.rows[size_t(t)].logits) continue;
    kernels::rms_norm(h_.data() + size_t(t) * hidden, 1, hidden, weights_.final_norm.data(),
                      config_.rms_norm_eps, normed_.data() + size_t(rows) * hidden);
    ++rows;
  }
  std::vector<float> logits(size_t(rows) * config_.vocab_size);
  linear(weights_.lm_head, normed_.data(), rows, logits.data());
  return logits;
}

}  // namespace colibri
