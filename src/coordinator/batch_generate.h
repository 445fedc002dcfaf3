// Generation for many sequences at once on one engine: every step carries one decode row of each
// running sequence plus prefill chunks of the ones still reading their prompt, within the
// engine's max_rows; at most max_seqs sequences hold KV slots, the others wait and join as
// sequences finish. The seed of the server's continuous batching.
#pragma once

#include <functional>
#include <vector>

#include "coordinator/engine.h"
#include "model/generate.h"

namespace colibri {

struct BatchGenerateStats {
  int steps = 0;               // forward calls
  int decode_rows = 0;         // rows that fed a generated token back
  int prefill_rows = 0;        // prompt rows
  double seconds = 0;          // the whole run
  double decode_seconds = 0;   // steps that carried decode rows only
  int decode_only_tokens = 0;  // rows of those steps
};

// One result per request, in order (keep_logits is not supported here). on_token(request index,
// token) is called as tokens are sampled.
std::vector<GenerateResult> generate_batch(Engine& engine,
                                           const std::vector<GenerateRequest>& requests,
                                           const std::function<void(int, int)>& on_token = {},
                                           BatchGenerateStats* stats = nullptr);

}  // namespace colibri
