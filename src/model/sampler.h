// Token sampling: greedy (temperature 0), or temperature with top-k, min-p and nucleus (top-p)
// from a seeded RNG; before either, a logit bias and the presence, frequency and repetition
// penalties of the OpenAI and vLLM APIs.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colibri {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;
  uint64_t seed = 0;
  int top_k = 0;       // keep the k most likely tokens; 0: all
  float min_p = 0.0f;  // drop tokens below min_p times the most likely one's probability
  // OpenAI: logit -= presence * [count > 0] + frequency * count, over the generated tokens.
  float presence_penalty = 0.0f, frequency_penalty = 0.0f;
  // CTRL / transformers / vLLM: the logit of a token in the prompt or the generated text is
  // divided by it when positive, multiplied when negative; 1: off.
  float repetition_penalty = 1.0f;
  std::vector<std::pair<int, float>> logit_bias;  // (token, added to its logit)

  // Whether sample() needs more than the raw logits (a bias or a penalty).
  bool adjusts_logits() const;
};

class Sampler {
 public:
  // `prompt`: the tokens the repetition penalty counts besides the generated ones.
  explicit Sampler(const SamplingParams& params, std::span<const int> prompt = {});
  // Samples from `logits` (vocabulary order) and counts the token as generated.
  int sample(std::span<const float> logits);

 private:
  // The logits after the bias and the penalties.
  std::span<const float> adjusted(std::span<const float> logits);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::unordered_map<int, int> generated_;  // token -> times generated
  std::vector<int> prompt_;                 // distinct prompt tokens (repetition penalty only)
  std::vector<float> scratch_;
};

// Index of the largest value; the lowest index wins ties.
int argmax(std::span<const float> values);

// A sampled token's log-probability under the model (the log-softmax of the raw logits, before
// any bias, penalty or temperature) and the `top` most likely tokens with theirs, most likely
// first (the lower id first on ties).
struct TokenLogprob {
  int token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int, float>> top;
};
TokenLogprob token_logprob(std::span<const float> logits, int token, int top);

}  // namespace colibri
