// Prompt → prefill → token-by-token decode with the KV cache.
#pragma once

#include <functional>
#include <vector>

#include "coordinator/sampler.h"
#include "model/reference_model.h"

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

GenerateResult generate(ReferenceModel& model, const GenerateRequest& request,
                        const std::function<void(int)>& on_token = {});

// The same continuing from `cache` (the prompt follows what the cache holds): a chat keeps its
// conversation's cache between turns. Every generated token but a final stop token is in the
// cache afterwards.
GenerateResult generate(ReferenceModel& model, KvCache& cache, const GenerateRequest& request,
                        const std::function<void(int)>& on_token = {});

}  // namespace colibri
