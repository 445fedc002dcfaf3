// Token sampling: greedy (temperature 0), or temperature + nucleus (top-p) with a seeded RNG.
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace colibri {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int sample(std::span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

// Index of the largest value; the lowest index wins ties.
int argmax(std::span<const float> values);

}  // namespace colibri
