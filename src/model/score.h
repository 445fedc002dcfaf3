// Teacher-forced scoring: the negative log-likelihood of every token given the ones before it.
#pragma once

#include <vector>

#include "model/forward_fn.h"

namespace colibri {

struct ScoreResult {
  std::vector<double> nll;  // [ids.size() - 1]: -log p(ids[i + 1] | ids[0..i]), natural log
  double mean_nll = 0;
  double perplexity = 0;             // exp(mean_nll)
  std::vector<double> call_seconds;  // wall time of each forward call, in order
};

// Scores ids in forward calls of at most `chunk` tokens (0: one call) on a fresh sequence.
ScoreResult score_tokens(const ForwardFn& forward, int vocab, const std::vector<int>& ids,
                         int chunk = 0);

}  // namespace colibri
