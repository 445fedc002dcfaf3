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

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  if (!(params.temperature >= 0.0f) || !std::isfinite(params.temperature))
    fail("temperature must be a finite number >= 0, got {}", params.temperature);
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f))
    fail("top-p must be in (0, 1], got {}", params.top_p);
}

int Sampler::sample(std::span<const float> logits) {
  if (params_.temperature == 0.0f) return argmax(logits);
  const float max = *std::max_element(logits.begin(), logits.end());
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  std::vector<double> probs(order.size());
  double total = 0.0;
  for (size_t i = 0; i < order.size(); ++i) {
    probs[i] = std::exp(double(logits[size_t(order[i])] - max) / params_.temperature);
    total += probs[i];
  }
  // Keep the smallest prefix whose probability mass reaches top_p (at least one token).
  size_t keep = 0;
  double mass = 0.0;
  while (keep < probs.size() && (keep == 0 || mass < params_.top_p * total)) mass += probs[keep++];
  std::uniform_real_distribution<double> uniform(0.0, mass);
  double u = uniform(rng_);
  for (size_t i = 0; i < keep; ++i) {
    if (u < probs[i]) return order[i];
    u -= probs[i];
  }
  return order[keep - 1];
}

}  // namespace colibri
