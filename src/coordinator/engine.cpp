#include "coordinator/engine.h"

#include <algorithm>
#include <optional>

#include "common/error.h"
#include "common/finite.h"
#include "moe/router.h"

namespace colibri {

int default_kv_tokens(const ModelConfig& config) {
  return std::min(config.max_position_embeddings, EngineOptions::kDefaultKvTokens);
}

Engine::Engine(const ModelConfig& config, const ModelWeights& weights,
               const LivePlacement& placement, Dispatcher& dispatcher, const EngineOptions& options,
               Profiler* profiler, const ComputeFactory& compute)
    : config_(config),
      weights_(weights),
      placement_(placement),
      dispatcher_(dispatcher),
      options_(options),
      profiler_(profiler),
      kv_(config, options.kv_tokens > 0 ? options.kv_tokens : default_kv_tokens(config),
          options.max_seqs) {
  if (options.max_rows < 1) fail("--max-rows {} must be positive", options.max_rows);
  if (options.micro_batches != 1 && options.micro_batches != 2)
    fail("--micro-batches {} must be 1 or 2", options.micro_batches);
  compute_ = compute ? compute(config, weights, kv_, options.max_rows, profiler)
                     : std::make_unique<CpuCompute>(config, weights, kv_, profiler);
  if (options.micro_batches == 2 && !compute && dispatcher.exchange_slots() >= 2)
    second_compute_ = std::make_unique<CpuCompute>(config, weights, kv_, profiler);
  micro_[0].compute = compute_.get();
  micro_[1].compute = second_compute_.get();
  micro_[1].slot = 1;
  seq_end_.assign(size_t(options.max_seqs), -1);
  routes_.reset(config.num_layers, config.n_routed_experts);
  next_moe_.assign(size_t(config.num_layers), -1);
  for (int l = config.num_layers - 2, next = -1; l >= 0; --l) {
    if (config.layer_is_moe[size_t(l + 1)]) next = l + 1;
    next_moe_[size_t(l)] = next;
  }
  const auto layers = size_t(config.num_layers);
  prefetch_.pairs.assign(layers, 0);
  prefetch_.pair_hits.assign(layers, 0);
  prefetch_.set_predicted.assign(layers, 0);
  prefetch_.set_routed.assign(layers, 0);
  prefetch_.set_hits.assign(layers, 0);
  seen_.assign(size_t(config.n_routed_experts), 0);
}

PrefetchStats::Totals PrefetchStats::totals() const {
  Totals t;
  for (size_t l = 0; l < pairs.size(); ++l) {
    t.pairs += pairs[l];
    t.pair_hits += pair_hits[l];
    t.set_predicted += set_predicted[l];
    t.set_hits += set_hits[l];
  }
  return t;
}

void Engine::predict_next(MicroBatch& mb, int layer, int n, bool hint) {
  const int next = next_moe_[size_t(layer)];
  Prediction& predicted = mb.prediction;
  predicted.layer = next;
  if (next < 0) return;
  predicted.routing =
      route_tokens(config_, weights_.layers[size_t(next)],
                   static_cast<const float*>(mb.compute->normed(Device::kHost).data), n);
  // The distinct predicted experts, each hinted to every rank that holds it.
  std::fill(seen_.begin(), seen_.end(), 0);
  for (size_t i = 0; i < size_t(n) * size_t(predicted.routing.top_k); ++i)
    seen_[size_t(predicted.routing.expert[i])] = 1;
  for (OwnerHint& h : hints_) h.experts.clear();
  for (int e = 0; e < config_.n_routed_experts; ++e) {
    if (!seen_[size_t(e)]) continue;
    ++prefetch_.set_predicted[size_t(next)];
    const auto add = [&](int rank) {
      if (rank < 0) return;
      auto it = std::find_if(hints_.begin(), hints_.end(),
                             [rank](const OwnerHint& h) { return h.rank == rank; });
      if (it == hints_.end()) it = hints_.insert(hints_.end(), OwnerHint{rank, {}});
      it->experts.push_back(e);
    };
    add(placement_.current().owner_of(next, e));
    for (int rank : placement_.current().replicas_of(next, e)) add(rank);
  }
  if (hint) dispatcher_.hint(next, hints_);
}

void Engine::score_prediction(const Prediction& predicted, int layer, const Routing& routing,
                              int n) {
  const int k = routing.top_k;
  std::fill(seen_.begin(), seen_.end(), 0);
  for (size_t i = 0; i < size_t(n) * size_t(predicted.routing.top_k); ++i)
    seen_[size_t(predicted.routing.expert[i])] = 1;
  for (int t = 0; t < n; ++t) {
    const int* actual = &routing.expert[size_t(t) * k];
    const int* guess = &predicted.routing.expert[size_t(t) * predicted.routing.top_k];
    for (int i = 0; i < k; ++i) {
      prefetch_.pair_hits[size_t(layer)] += std::find(guess, guess + predicted.routing.top_k,
                                                      actual[i]) != guess + predicted.routing.top_k;
      if (seen_[size_t(actual[i])] == 1 || seen_[size_t(actual[i])] == 0)
        seen_[size_t(actual[i])] += 2;  // 2: routed only, 3: routed and predicted
    }
  }
  prefetch_.pairs[size_t(layer)] += uint64_t(n) * uint64_t(k);
  for (int v : seen_) {
    prefetch_.set_routed[size_t(layer)] += v >= 2;
    prefetch_.set_hits[size_t(layer)] += v == 3;
  }
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

int Engine::split_row(const ModelConfig& config, const Batch& batch, int min_rows) {
  const int n = batch.size();
  if (n < std::max(min_rows, 4)) return 0;
  // A row that sees every position (MlaHeads' dense rows): at most index_topk positions, or any
  // row where no indexer chooses.
  const auto dense = [&](int t) {
    return !config.has_indexer() || batch.rows[size_t(t)].pos + 1 <= config.index_topk;
  };
  // Rows s - 1 and s on either side of the cut: a dense one keeps the row beside it on its side
  // when that row is dense too, so that a run of dense rows is never cut down to one.
  const auto safe = [&](int s) {
    return !(dense(s - 1) && !dense(s - 2)) && !(dense(s) && !dense(s + 1));
  };
  for (int d = 0; d <= n / 2; ++d)
    for (const int s : {n / 2 - d, n / 2 + d})
      if (s >= 2 && s <= n - 2 && safe(s)) return s;
  return 0;
}

void Engine::start_layer(MicroBatch& mb, const PlacementTable& placement, int l) {
  const LayerWeights& layer = weights_.layers[size_t(l)];
  const int n = mb.batch->size();
  mb.compute->attention(l);
  if (!layer.is_moe) {
    OptionalScope scope(profiler_, Phase::kDenseMlp, l);
    mb.compute->dense_mlp(l);
    return;
  }
  {
    OptionalScope scope(profiler_, Phase::kRouter, l);
    const Routing routing = mb.compute->route(l);
    mb.plan.build(placement, l, routing, n);
    routes_.add_routes(l, std::span(routing.expert).first(size_t(n) * size_t(routing.top_k)));
    for (const OwnerShare& share : mb.plan.owners) {
      placement_counters_.pairs_to_rank[share.rank] += share.pairs.size();
      if (profiler_) profiler_->add_rows(l, share.rank, share.rows.size());
      if (placement.replicas.empty()) continue;
      for (const RoutedPair& p : share.pairs)
        placement_counters_.replica_pairs += placement.owner_of(l, int(p.expert)) != share.rank;
    }
    // With --prefetch-ahead every step predicts and hints; without, one step in
    // kPredictionSampling predicts (no hint), so that the prediction's quality is known
    // before the flag is turned on.
    if (options_.prefetch_ahead || steps_ % kPredictionSampling == 0) {
      if (mb.prediction.layer == l) score_prediction(mb.prediction, l, routing, n);
      predict_next(mb, l, n, options_.prefetch_ahead);
    }
  }
  // Device views where the compute and the dispatcher both take them (a GPU coordinator's
  // rows to gpu-expert ranks over NCCL), host views otherwise.
  const Device rows_on = dispatcher_.takes_device_rows() ? Device::kCuda : Device::kHost;
  dispatcher_.dispatch_slot(mb.slot, mb.plan, mb.compute->normed(rows_on));
  mb.in_flight = true;
}

void Engine::finish_layer(MicroBatch& mb, int l) {
  const LayerWeights& layer = weights_.layers[size_t(l)];
  if (!layer.is_moe) return;
  if (!layer.shared_experts.empty()) {
    OptionalScope scope(profiler_, Phase::kSharedExpert, l);
    mb.compute->shared_expert(l);
  }
  const Device rows_on = dispatcher_.takes_device_rows() ? Device::kCuda : Device::kHost;
  mb.in_flight = false;
  dispatcher_.combine_slot(mb.slot, mb.compute->routed(rows_on));
  if (profiler_) profiler_->end_exchange(l);
  mb.compute->add_moe(l);
}

void Engine::drain_exchanges() noexcept {
  const Device rows_on = dispatcher_.takes_device_rows() ? Device::kCuda : Device::kHost;
  for (MicroBatch& mb : micro_) {
    if (!mb.in_flight) continue;
    mb.in_flight = false;
    try {
      dispatcher_.combine_slot(mb.slot, mb.compute->routed(rows_on));
    } catch (...) {  // the first Error is the one the caller sees
    }
  }
}

std::vector<float> Engine::forward(const Batch& batch) {
  check(batch);
  const int n = batch.size();
  const int split = splits() ? split_row(config_, batch, options_.micro_batch_rows) : 0;
  const int parts = split > 0 ? 2 : 1;
  if (split > 0) {
    halves_[0].rows.assign(batch.rows.begin(), batch.rows.begin() + split);
    halves_[1].rows.assign(batch.rows.begin() + split, batch.rows.end());
    micro_[0].batch = &halves_[0];
    micro_[1].batch = &halves_[1];
  } else {
    micro_[0].batch = &batch;
  }
  for (int p = 0; p < parts; ++p) {
    micro_[p].compute->begin(*micro_[p].batch);
    micro_[p].prediction.layer = -1;
  }
  routes_.add_tokens(n);
  ++steps_;
  split_calls_ += parts == 2;
  // One table for the whole step: a change of placement is committed between steps.
  const std::shared_ptr<const PlacementTable> table = placement_.share();
  const PlacementTable& placement = *table;
  MicroBatch &a = micro_[0], &b = micro_[1];
  try {
    for (int l = 0; l < config_.num_layers; ++l) {
      if (parts == 1) {
        start_layer(a, placement, l);
        finish_layer(a, l);
        continue;
      }
      // Two in flight: while a's routed experts of layer l work, b ends layer l - 1 and starts
      // layer l; while b's work, a ends layer l and (next) starts layer l + 1. A row of b attends
      // to rows of a (one prompt chunk cut in two) at layer l after a's attention wrote them.
      start_layer(a, placement, l);
      if (l > 0) finish_layer(b, l - 1);
      start_layer(b, placement, l);
      finish_layer(a, l);
    }
    if (parts == 2) finish_layer(b, config_.num_layers - 1);
  } catch (...) {
    drain_exchanges();
    throw;
  }
  std::vector<float> logits;
  {
    OptionalScope scope(profiler_, Phase::kLmHead);
    // A GPU compute reports a non-finite residual here.
    logits = a.compute->logits(*a.batch);
    if (parts == 2) {
      const std::vector<float> second = b.compute->logits(*b.batch);
      logits.insert(logits.end(), second.begin(), second.end());
    }
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
