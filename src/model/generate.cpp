#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include "common/error.h"

namespace colibri {

GenerateResult generate(const ForwardFn& forward, int vocab, const GenerateRequest& request,
                        const std::function<void(int)>& on_token, Profiler* profiler) {
  if (request.prompt.empty()) fail("the prompt is empty");
  using clock = std::chrono::steady_clock;
  const auto seconds = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  GenerateResult result;
  Sampler sampler(request.sampling);

  const auto start = clock::now();
  std::vector<float> logits;
  const std::span<const int> prompt(request.prompt);
  const size_t chunk = request.prefill_chunk > 0 ? size_t(request.prefill_chunk) : prompt.size();
  for (size_t begin = 0; begin < prompt.size(); begin += chunk) {
    const auto part = prompt.subspan(begin, std::min(chunk, prompt.size() - begin));
    logits = forward(part, request.keep_logits);
    if (request.keep_logits)
      result.logits.insert(result.logits.end(), logits.begin(), logits.end());
  }
  const auto prefill_end = clock::now();
  result.prefill_seconds = seconds(start, prefill_end);
  std::span<const float> last(logits.data() + logits.size() - size_t(vocab), size_t(vocab));

  auto first_token_time = prefill_end, last_token_time = prefill_end;
  for (int i = 0; i < request.max_new_tokens; ++i) {
    int token;
    {
      OptionalScope scope(profiler, Phase::kSampling);
      token = sampler.sample(last);
    }
    last_token_time = clock::now();
    if (i == 0) first_token_time = last_token_time;
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    const bool stop = std::find(request.stop_ids.begin(), request.stop_ids.end(), token) !=
                      request.stop_ids.end();
    const bool done = stop || i + 1 == request.max_new_tokens;
    // The last token is fed too when logits are kept, so every position has its row.
    if (done && !request.keep_logits) break;
    const int next[] = {token};
    logits = forward(next, false);
    if (request.keep_logits)
      result.logits.insert(result.logits.end(), logits.begin(), logits.end());
    last = std::span<const float>(logits.data(), size_t(vocab));
    if (done) break;
  }
  result.ttft_seconds = seconds(start, first_token_time);
  result.decode_seconds = seconds(first_token_time, last_token_time);
  return result;
}

}  // namespace colibri
