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
};

struct GenerateResult {
  std::vector<int> tokens;     // generated ids
  std::vector<float> logits;   // [prompt + generated, vocab] when keep_logits: row i follows token i
  double prefill_seconds = 0, decode_seconds = 0;
};

GenerateResult generate(ReferenceModel& model, const GenerateRequest& request,
                        const std::function<void(int)>& on_token = {});

}  // namespace colibri
