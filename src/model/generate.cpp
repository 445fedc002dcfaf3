#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include "common/error.h"

namespace colibri {

GenerateResult generate(ReferenceModel& model, const GenerateRequest& request,
                        const std::function<void(int)>& on_token) {
  if (request.prompt.empty()) fail("the prompt is empty");
  const int vocab = model.config().vocab_size;
  using clock = std::chrono::steady_clock;
  GenerateResult result;
  KvCache cache(model.config());
  Sampler sampler(request.sampling);

  auto t0 = clock::now();
  std::vector<float> logits = model.forward(request.prompt, cache, request.keep_logits);
  result.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  if (request.keep_logits) result.logits = logits;
  std::span<const float> last(logits.data() + logits.size() - size_t(vocab), size_t(vocab));

  t0 = clock::now();
  for (int i = 0; i < request.max_new_tokens; ++i) {
    const int token = sampler.sample(last);
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    const bool stop = std::find(request.stop_ids.begin(), request.stop_ids.end(), token) !=
                      request.stop_ids.end();
    // The last token is fed too when logits are kept, so every position has its row.
    if ((stop || i + 1 == request.max_new_tokens) && !request.keep_logits) break;
    const int next[] = {token};
    logits = model.forward(next, cache, false);
    if (request.keep_logits) result.logits.insert(result.logits.end(), logits.begin(), logits.end());
    last = std::span<const float>(logits.data(), size_t(vocab));
    if (stop) break;
  }
  result.decode_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return result;
}

}  // namespace colibri
