#include "coordinator/engine.h"

#include <algorithm>
#include <optional>

#include "common/error.h"
#include "common/finite.h"

namespace colibri {

int default_kv_tokens(const ModelConfig& config) {
  return std::min(config.max_position_embeddings, EngineOptions::kDefaultKvTokens);
}

Engine::Engine(const ModelConfig& config, const ModelWeights& weights,
               const PlacementTable& placement, Dispatcher& dispatcher,
               const EngineOptions& options, Profiler* profiler, const ComputeFactory& compute)
    : config_(config),
      weights_(weights),
      placement_(placement),
      dispatcher_(dispatcher),
      options_(options),
      profiler_(profiler),
      kv_(config, options.kv_tokens > 0 ? options.kv_tokens : default_kv_tokens(config),
          options.max_seqs) {
  if (options.max_rows < 1) fail("--max-rows {} must be positive", options.max_rows);
  compute_ = compute ? compute(config, weights, kv_, options.max_rows, profiler)
                     : std::make_unique<CpuCompute>(config, weights, kv_, profiler);
  seq_end_.assign(size_t(options.max_seqs), -1);
  routes_.reset(config.num_layers, config.n_routed_experts);
}

Engine::~Engine() = default;

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

void Engine::check_logits(const Batch& batch, std::span<const float> logits) const {
  const std::optional<size_t> bad = find_non_finite(logits);
  if (!bad) return;
  const size_t vocab = size_t(config_.vocab_size);
  size_t row = *bad / vocab;
  for (const BatchRow& r : batch.rows) {
    if (!r.logits) continue;
    if (row-- > 0) continue;
    fail("the lm_head made the logits non-finite ({} for token id {} at sequence {} position {})",
         logits[*bad], *bad % vocab, r.seq, r.pos);
  }
  fail("the lm_head made the logits non-finite ({} at index {})", logits[*bad], *bad);
}

std::vector<float> Engine::forward(const Batch& batch) {
  check(batch);
  const int n = batch.size();
  const size_t values = size_t(n) * config_.hidden_size;
  compute_->begin(batch);
  routes_.add_tokens(n);
  Routing routing;
  for (int l = 0; l < config_.num_layers; ++l) {
    const LayerWeights& layer = weights_.layers[size_t(l)];
    compute_->attention(l);
    if (layer.is_moe) {
      {
        OptionalScope scope(profiler_, Phase::kRouter, l);
        routing = compute_->route(l);
        plan_.build(placement_, l, routing, n);
        routes_.add_routes(l, std::span(routing.expert).first(size_t(n) * size_t(routing.top_k)));
      }
      // Host views: the NCCL transport will take the device's rows (Device::kCuda) instead.
      dispatcher_.dispatch(plan_, host_f32(compute_->normed_host(), values));
      if (!layer.shared_experts.empty()) {
        OptionalScope scope(profiler_, Phase::kSharedExpert, l);
        compute_->shared_expert(l);
      }
      dispatcher_.combine(host_f32(compute_->routed_host(), values));
      compute_->add_moe(l);
    } else {
      OptionalScope scope(profiler_, Phase::kDenseMlp, l);
      compute_->dense_mlp(l);
    }
  }
  std::vector<float> logits;
  {
    OptionalScope scope(profiler_, Phase::kLmHead);
    logits = compute_->logits(batch);  // a GPU compute reports a non-finite residual here
  }
  check_logits(batch, logits);
  for (int s = 0; s < int(seq_end_.size()); ++s)
    if (seq_end_[size_t(s)] >= 0) kv_.set_length(s, seq_end_[size_t(s)]);
  if (step_hook_) step_hook_(n);
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
