// Prompt → prefill → token-by-token decode with the KV cache.
#pragma once

#include <functional>
#include <vector>

#include "common/profile.h"
#include "model/forward_fn.h"
#include "model/sampler.h"

namespace colibri {

struct GenerateRequest {
  std::vector<int> prompt;
  int max_new_tokens = 16;
  SamplingParams sampling;
  std::vector<int> stop_ids;  // generation ends after emitting one of these
  bool keep_logits = false;   // collect logits of every position
  int prefill_chunk = 0;      // longest forward call during prefill; 0 = the whole prompt
};

struct GenerateResult {
  std::vector<int> tokens;    // generated ids
  std::vector<float> logits;  // [prompt + generated, vocab] when keep_logits: row i follows token i
  double prefill_seconds = 0;
  double ttft_seconds = 0;    // start to the first generated token
  double decode_seconds = 0;  // first to last generated token: tokens.size() - 1 decode steps
};

// Prefill (in calls of at most prefill_chunk tokens) then one decode call per token, continuing
// the sequence behind `forward`: a chat keeps its conversation's sequence between turns. Every
// generated token but a final stop token is in the sequence afterwards. Sampling time goes to
// `profiler` when given.
GenerateResult generate(const ForwardFn& forward, int vocab, const GenerateRequest& request,
                        const std::function<void(int)>& on_token = {},
                        Profiler* profiler = nullptr);

}  // namespace colibri
