#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/error.h"

namespace colibri {

int argmax(std::span<const float> values) {
  return int(std::max_element(values.begin(), values.end()) - values.begin());
}

namespace {

// The `n` most likely token ids of `logits`, most likely first, the lower id first on ties.
std::vector<int> most_likely(std::span<const float> logits, size_t n) {
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  n = std::min(n, order.size());
  std::partial_sort(order.begin(), order.begin() + std::ptrdiff_t(n), order.end(),
                    [&](int a, int b) {
                      return logits[size_t(a)] > logits[size_t(b)] ||
                             (logits[size_t(a)] == logits[size_t(b)] && a < b);
                    });
  order.resize(n);
  return order;
}

}  // namespace

TokenLogprob token_logprob(std::span<const float> logits, int token, int top) {
  const float max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(double(x) - double(max));
  const double log_total = double(max) + std::log(sum);
  TokenLogprob out;
  out.token = token;
  out.logprob = float(double(logits[size_t(token)]) - log_total);
  for (int id : most_likely(logits, size_t(std::max(top, 0))))
    out.top.emplace_back(id, float(double(logits[size_t(id)]) - log_total));
  return out;
}

bool SamplingParams::adjusts_logits() const {
  return !logit_bias.empty() || presence_penalty != 0.0f || frequency_penalty != 0.0f ||
         repetition_penalty != 1.0f;
}

Sampler::Sampler(const SamplingParams& params, std::span<const int> prompt)
    : params_(params), rng_(params.seed) {
  if (!(params.temperature >= 0.0f) || !std::isfinite(params.temperature))
    fail("temperature must be a finite number >= 0, got {}", params.temperature);
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f))
    fail("top-p must be in (0, 1], got {}", params.top_p);
  if (params.top_k < 0) fail("top-k must be >= 0, got {}", params.top_k);
  if (!(params.min_p >= 0.0f && params.min_p <= 1.0f))
    fail("min-p must be in [0, 1], got {}", params.min_p);
  if (!(params.repetition_penalty > 0.0f) || !std::isfinite(params.repetition_penalty))
    fail("repetition penalty must be a finite number > 0, got {}", params.repetition_penalty);
  if (params.repetition_penalty != 1.0f) {
    prompt_.assign(prompt.begin(), prompt.end());
    std::sort(prompt_.begin(), prompt_.end());
    prompt_.erase(std::unique(prompt_.begin(), prompt_.end()), prompt_.end());
  }
}

std::span<const float> Sampler::adjusted(std::span<const float> logits) {
  if (!params_.adjusts_logits()) return logits;
  scratch_.assign(logits.begin(), logits.end());
  const auto in_vocab = [&](int token) { return token >= 0 && size_t(token) < scratch_.size(); };
  for (const auto& [token, bias] : params_.logit_bias)
    if (in_vocab(token)) scratch_[size_t(token)] += bias;
  if (params_.repetition_penalty != 1.0f) {
    const auto penalise = [&](int token) {
      if (!in_vocab(token)) return;
      float& x = scratch_[size_t(token)];
      x = x > 0 ? x / params_.repetition_penalty : x * params_.repetition_penalty;
    };
    for (int token : prompt_) penalise(token);
    for (const auto& [token, count] : generated_)
      if (!std::binary_search(prompt_.begin(), prompt_.end(), token)) penalise(token);
  }
  for (const auto& [token, count] : generated_)
    if (in_vocab(token))
      scratch_[size_t(token)] -=
          params_.presence_penalty + params_.frequency_penalty * float(count);
  return scratch_;
}

int Sampler::sample(std::span<const float> raw) {
  const std::span<const float> logits = adjusted(raw);
  int token = 0;
  if (params_.temperature == 0.0f) {
    token = argmax(logits);
  } else {
    const float max = *std::max_element(logits.begin(), logits.end());
    // Candidates: the top_k most likely, then those within min_p of the most likely (its
    // probability is exp(0) = 1 relative), then the smallest prefix whose mass reaches top_p;
    // at least one token.
    const std::vector<int> order =
        most_likely(logits, params_.top_k > 0 ? size_t(params_.top_k) : logits.size());
    size_t candidates = order.size();
    std::vector<double> probs(candidates);
    double total = 0.0;
    for (size_t i = 0; i < candidates; ++i) {
      probs[i] = std::exp(double(logits[size_t(order[i])] - max) / params_.temperature);
      // A token of probability 0 (a grammar's -inf) is never a candidate.
      if (i > 0 && (probs[i] < params_.min_p || probs[i] == 0.0)) {
        candidates = i;
        break;
      }
      total += probs[i];
    }
    size_t keep = 0;
    double mass = 0.0;
    while (keep < candidates && (keep == 0 || mass < params_.top_p * total)) mass += probs[keep++];
    std::uniform_real_distribution<double> uniform(0.0, mass);
    double u = uniform(rng_);
    token = order[keep - 1];
    for (size_t i = 0; i < keep; ++i) {
      if (u < probs[i]) {
        token = order[i];
        break;
      }
      u -= probs[i];
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f ||
      params_.repetition_penalty != 1.0f)
    ++generated_[token];
  return token;
}

}  // namespace colibri
