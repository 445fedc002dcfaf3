#include "oracle/reference_model.h"

#include <algorithm>

#include "common/error.h"
#include "cpu/elementwise.h"
#include "cpu/linear.h"

namespace colibri {

ReferenceModel::ReferenceModel(const ModelConfig& config, const ModelWeights& weights,
                               ExpertExecutor* experts)
    : config_(config),
      weights_(weights),
      rope_(config.rope, config.qk_rope_head_dim),
      attention_(config, rope_),
      local_experts_(config, weights),
      experts_(experts ? experts : &local_experts_) {}

void ReferenceModel::set_profiler(Profiler* profiler) {
  profiler_ = profiler;
  attention_.set_profiler(profiler);
}

std::vector<float> ReferenceModel::forward(std::span<const int> tokens, KvCache& cache,
                                           bool all_logits) {
  const int n = int(tokens.size()), hidden = config_.hidden_size, start = cache.length();
  if (n == 0) return {};
  for (int token : tokens)
    if (token < 0 || token >= config_.vocab_size)
      fail("token id {} is outside the vocabulary of {}", token, config_.vocab_size);

  std::vector<float> h(size_t(n) * hidden);  // residual stream [n, hidden]
  {
    OptionalScope scope(profiler_, Phase::kEmbed, -1);
    for (int t = 0; t < n; ++t)
      std::copy_n(&weights_.embed.data[size_t(tokens[size_t(t)]) * hidden], hidden,
                  &h[size_t(t) * hidden]);
  }

  std::vector<float> normed(h.size()), delta(h.size()), shared(h.size());
  KeySelection selection;  // carried from full to shared indexer layers
  for (int l = 0; l < config_.num_layers; ++l) {
    const LayerWeights& layer = weights_.layers[size_t(l)];
    kernels::rms_norm(h.data(), n, hidden, layer.input_norm.data(), config_.rms_norm_eps,
                      normed.data());
    attention_.forward(l, layer.attn, normed.data(), n, start, cache.layer(l), selection,
                       delta.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += delta[i];

    kernels::rms_norm(h.data(), n, hidden, layer.post_attention_norm.data(), config_.rms_norm_eps,
                      normed.data());
    if (layer.is_moe) {
      Routing routing;
      {
        OptionalScope scope(profiler_, Phase::kRouter, l);
        routing = route_tokens(config_, layer, normed.data(), n);
      }
      experts_->begin(l, normed.data(), n, routing);
      if (!layer.shared_experts.empty()) {
        OptionalScope scope(profiler_, Phase::kSharedExpert, l);
        mlp_forward(layer.shared_experts, normed.data(), n, shared.data());
      }
      experts_->finish(delta.data());
      if (!layer.shared_experts.empty())
        for (size_t i = 0; i < h.size(); ++i) delta[i] += shared[i];
    } else {
      OptionalScope scope(profiler_, Phase::kDenseMlp, l);
      mlp_forward(layer.dense_mlp, normed.data(), n, delta.data());
    }
    for (size_t i = 0; i < h.size(); ++i) h[i] += delta[i];
  }
  cache.advance(n);

  OptionalScope scope(profiler_, Phase::kLmHead, -1);
  const int first = all_logits ? 0 : n - 1;
  const int rows = n - first;
  kernels::rms_norm(&h[size_t(first) * hidden], rows, hidden, weights_.final_norm.data(),
                    config_.rms_norm_eps, normed.data());
  std::vector<float> logits(size_t(rows) * config_.vocab_size);
  kernels::linear_f32(normed.data(), rows, weights_.lm_head.data.data(), config_.vocab_size, hidden,
                      logits.data());
  return logits;
}

}  // namespace colibri
