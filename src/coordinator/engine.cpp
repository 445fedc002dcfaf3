#include "coordinator/engine.h"

#include <algorithm>
#include <optional>

#include "common/error.h"
#include "common/finite.h"
#include "coordinator/cpu_attention.h"
#include "coordinator/router.h"
#include "cpu/elementwise.h"
#include "cpu/linear.h"
#include "rank/experts.h"

namespace colibri {

int default_kv_tokens(const ModelConfig& config) {
  return std::min(config.max_position_embeddings, EngineOptions::kDefaultKvTokens);
}

Engine::Engine(const ModelConfig& config, const ModelWeights& weights,
               const PlacementTable& placement, Dispatcher& dispatcher,
               const EngineOptions& options, Profiler* profiler)
    : config_(config),
      weights_(weights),
      placement_(placement),
      dispatcher_(dispatcher),
      options_(options),
      profiler_(profiler),
      kv_(config, options.kv_tokens > 0 ? options.kv_tokens : default_kv_tokens(config),
          options.max_seqs),
      attention_(std::make_unique<CpuAttention>(config, kv_, profiler)) {
  if (options.max_rows < 1) fail("--max-rows {} must be positive", options.max_rows);
  seq_end_.assign(size_t(options.max_seqs), -1);
}

void Engine::check(const Batch& batch) {
  const int n = batch.size();
  if (n == 0) fail("empty batch");
  if (n > options_.max_rows) fail("a batch of {} rows exceeds --max-rows {}", n, options_.max_rows);
  std::fill(seq_end_.begin(), seq_end_.end(), -1);
  int previous = -1;
  for (const BatchRow& row : batch.rows) {
    if (row.token < 0 || row.token >= config_.vocab_size)
      fail("token id {} is outside the vocabulary of {}", row.token, config_.vocab_size);
    if (!kv_.is_open(row.seq)) fail("sequence slot {} is not open", row.seq);
    int& end = seq_end_[size_t(row.seq)];
    if (row.seq != previous && end >= 0)
      fail("the rows of sequence {} are not consecutive in the batch", row.seq);
    const int expected = end >= 0 ? end : kv_.length(row.seq);
    if (row.pos != expected)
      fail("sequence {}: row at position {} where {} comes next", row.seq, row.pos, expected);
    end = expected + 1;
    previous = row.seq;
  }
  for (int s = 0; s < int(seq_end_.size()); ++s)
    if (seq_end_[size_t(s)] >= 0) kv_.reserve(s, seq_end_[size_t(s)]);
}

void Engine::check_residual(const Batch& batch, int layer, const char* after) const {
  const size_t hidden = size_t(config_.hidden_size);
  const std::optional<size_t> bad =
      find_non_finite(std::span<const float>(h_.data(), size_t(batch.size()) * hidden));
  if (!bad) return;
  const BatchRow& row = batch.rows[*bad / hidden];
  fail("layer {}: {} made the residual stream non-finite ({} at sequence {} position {})", layer,
       after, h_[*bad], row.seq, row.pos);
}

std::vector<float> Engine::forward(const Batch& batch) {
  check(batch);
  const int n = batch.size(), hidden = config_.hidden_size;
  const size_t values = size_t(n) * hidden;
  for (auto* v : {&h_, &normed_, &delta_, &shared_})
    if (v->size() < values) v->resize(values);
  float *h = h_.data(), *normed = normed_.data(), *delta = delta_.data();
  {
    OptionalScope scope(profiler_, Phase::kEmbed);
    for (int t = 0; t < n; ++t)
      std::copy_n(&weights_.embed.data[size_t(batch.rows[size_t(t)].token) * hidden], hidden,
                  h + size_t(t) * hidden);
  }

  attention_->begin(batch);
  Routing routing;
  for (int l = 0; l < config_.num_layers; ++l) {
    const LayerWeights& layer = weights_.layers[size_t(l)];
    kernels::rms_norm(h, n, hidden, layer.input_norm.data(), config_.rms_norm_eps, normed);
    attention_->forward(l, layer.attn, normed, delta);
    for (size_t i = 0; i < values; ++i) h[i] += delta[i];
    check_residual(batch, l, "attention");

    kernels::rms_norm(h, n, hidden, layer.post_attention_norm.data(), config_.rms_norm_eps, normed);
    if (layer.is_moe) {
      {
        OptionalScope scope(profiler_, Phase::kRouter, l);
        routing = route_tokens(config_, layer, normed, n);
        plan_.build(placement_, l, routing, n);
      }
      dispatcher_.dispatch(plan_, host_f32(normed, values));
      if (!layer.shared_experts.empty()) {
        OptionalScope scope(profiler_, Phase::kSharedExpert, l);
        mlp_forward(layer.shared_experts, normed, n, shared_.data());
      }
      dispatcher_.combine(host_f32(delta, values));
      if (!layer.shared_experts.empty())
        for (size_t i = 0; i < values; ++i) delta[i] += shared_[i];
    } else {
      OptionalScope scope(profiler_, Phase::kDenseMlp, l);
      mlp_forward(layer.dense_mlp, normed, n, delta);
    }
    for (size_t i = 0; i < values; ++i) h[i] += delta[i];
    check_residual(batch, l, layer.is_moe ? "the experts" : "the dense MLP");
  }
  for (int s = 0; s < int(seq_end_.size()); ++s)
    if (seq_end_[size_t(s)] >= 0) kv_.set_length(s, seq_end_[size_t(s)]);

  OptionalScope scope(profiler_, Phase::kLmHead);
  int rows = 0;
  for (int t = 0; t < n; ++t) {
    if (!batch.rows[size_t(t)].logits) continue;
    kernels::rms_norm(h + size_t(t) * hidden, 1, hidden, weights_.final_norm.data(),
                      config_.rms_norm_eps, normed + size_t(rows) * hidden);
    ++rows;
  }
  std::vector<float> logits(size_t(rows) * config_.vocab_size);
  linear(weights_.lm_head, normed, rows, logits.data());
  return logits;
}

std::vector<float> Engine::forward(int seq, std::span<const int> tokens, bool all_logits) {
  std::vector<float> logits;
  Batch batch;
  const size_t chunk = size_t(options_.max_rows);
  for (size_t begin = 0; begin < tokens.size(); begin += chunk) {
    const size_t count = std::min(chunk, tokens.size() - begin);
    const int start = kv_.length(seq);
    batch.clear();
    for (size_t i = 0; i < count; ++i)
      batch.add(seq, tokens[begin + i], start + int(i),
                all_logits || begin + i + 1 == tokens.size());
    std::vector<float> part = forward(batch);
    logits.insert(logits.end(), part.begin(), part.end());
  }
  return logits;
}

}  // namespace colibri
