#include "model/score.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <span>

#include "common/error.h"

namespace colibri {

ScoreResult score_tokens(const ForwardFn& forward, int vocab, const std::vector<int>& ids,
                         int chunk) {
  if (ids.size() < 2) fail("scoring needs at least two tokens, got {}", ids.size());
  ScoreResult result;
  const std::span<const int> all(ids);
  const size_t step = chunk > 0 ? size_t(chunk) : ids.size();
  for (size_t begin = 0; begin + 1 < ids.size(); begin += step) {
    // Row t of this call predicts ids[begin + t + 1]; the last token needs no row.
    const size_t count = std::min(step, ids.size() - 1 - begin);
    const auto start = std::chrono::steady_clock::now();
    const std::vector<float> logits = forward(all.subspan(begin, count), true);
    result.call_seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    for (size_t t = 0; t < count; ++t) {
      const float* row = &logits[t * size_t(vocab)];
      const double max = *std::max_element(row, row + vocab);
      double sum = 0;
      for (int v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - max);
      const int target = ids[begin + t + 1];
      result.nll.push_back(max + std::log(sum) - double(row[target]));
    }
  }
  double total = 0;
  for (double v : result.nll) total += v;
  result.mean_nll = total / double(result.nll.size());
  result.perplexity = std::exp(result.mean_nll);
  return result;
}

}  // namespace colibri
