#include "coordinator/batch_generate.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "common/error.h"
#include "model/sampler.h"

namespace colibri {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Running {
  int slot = -1;   // -1: waiting or finished
  size_t fed = 0;  // prompt tokens in the KV cache
  int last = -1;   // last sampled token, to feed next
  bool done = false;
  std::optional<Sampler> sampler;
  Clock::time_point admitted, first_token, last_token;
};

}  // namespace

std::vector<GenerateResult> generate_batch(Engine& engine,
                                           const std::vector<GenerateRequest>& requests,
                                           const std::function<void(int, int)>& on_token,
                                           BatchGenerateStats* stats) {
  const int vocab = engine.config().vocab_size, max_rows = engine.max_rows();
  std::vector<GenerateResult> results(requests.size());
  std::vector<Running> state(requests.size());
  // Every sequence's prompt and new tokens are reserved in the KV pool when it is admitted, so
  // that none can run out part-way; one that cannot fit the whole pool is refused before any work.
  const KvManager& kv = engine.kv();
  std::vector<int64_t> need_blocks(requests.size());  // prompt + new tokens, in whole blocks
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerateRequest& r = requests[i];
    if (r.prompt.empty()) fail("the prompt is empty");
    if (r.keep_logits) fail("batched generation does not keep logits");
    const int64_t tokens = int64_t(r.prompt.size()) + r.max_new_tokens;
    need_blocks[i] = (tokens + kv.block_tokens() - 1) / kv.block_tokens();
    if (need_blocks[i] > kv.total_blocks())
      fail(
          "sequence {}: {} prompt tokens and {} new ones need {} KV blocks of {} tokens, more than "
          "the pool's {} (--kv-tokens {})",
          i, r.prompt.size(), r.max_new_tokens, need_blocks[i], kv.block_tokens(),
          kv.total_blocks(), kv.capacity_tokens());
  }
  int64_t reserved_blocks = 0;  // of the open sequences'

  BatchGenerateStats local;
  BatchGenerateStats& s = stats ? *stats : local;
  const auto start = Clock::now();
  size_t next_waiting = 0, finished = 0, open = 0;
  Batch batch;
  std::vector<int> logit_owner;  // request index of each logits row

  const auto finish = [&](size_t i) {
    Running& run = state[i];
    engine.close_sequence(run.slot);
    reserved_blocks -= need_blocks[i];
    run.slot = -1;
    run.done = true;
    --open;
    ++finished;
    GenerateResult& result = results[i];
    result.prefill_seconds = seconds(run.admitted, run.first_token);
    result.ttft_seconds = seconds(start, run.first_token);
    result.decode_seconds = seconds(run.first_token, run.last_token);
  };

  while (finished < requests.size()) {
    // Admit waiting requests while slots and their blocks are free.
    while (next_waiting < requests.size() && int(open) < kv.max_seqs() &&
           reserved_blocks + need_blocks[next_waiting] <= kv.total_blocks()) {
      reserved_blocks += need_blocks[next_waiting];
      Running& run = state[next_waiting];
      run.slot = engine.open_sequence();
      run.sampler.emplace(requests[next_waiting].sampling);
      run.admitted = Clock::now();
      ++open;
      ++next_waiting;
    }
    // Decode rows of running sequences first, then prompt chunks in arrival order.
    batch.clear();
    logit_owner.clear();
    bool has_prefill = false;
    for (size_t i = 0; i < state.size() && batch.size() < max_rows; ++i) {
      Running& run = state[i];
      if (run.slot < 0 || run.last < 0) continue;
      batch.add(run.slot, run.last, engine.length(run.slot), true);
      logit_owner.push_back(int(i));
      ++s.decode_rows;
    }
    for (size_t i = 0; i < state.size() && batch.size() < max_rows; ++i) {
      Running& run = state[i];
      const std::vector<int>& prompt = requests[i].prompt;
      if (run.slot < 0 || run.fed == prompt.size()) continue;
      const size_t take = std::min(size_t(max_rows - batch.size()), prompt.size() - run.fed);
      const int pos = engine.length(run.slot);
      for (size_t k = 0; k < take; ++k) {
        const bool last = run.fed + k + 1 == prompt.size();
        batch.add(run.slot, prompt[run.fed + k], pos + int(k), last);
        if (last) logit_owner.push_back(int(i));
      }
      run.fed += take;
      s.prefill_rows += int(take);
      has_prefill = true;
    }
    const auto step_start = Clock::now();
    const std::vector<float> logits = engine.forward(batch);
    ++s.steps;

    for (size_t row = 0; row < logit_owner.size(); ++row) {
      const size_t i = size_t(logit_owner[row]);
      Running& run = state[i];
      const GenerateRequest& request = requests[i];
      GenerateResult& result = results[i];
      if (request.max_new_tokens == 0) {
        run.first_token = run.last_token = Clock::now();
        finish(i);
        continue;
      }
      int token;
      {
        OptionalScope scope(engine.profiler(), Phase::kSampling);
        token = run.sampler->sample(
            std::span<const float>(logits.data() + row * size_t(vocab), size_t(vocab)));
      }
      run.last_token = Clock::now();
      if (result.tokens.empty()) run.first_token = run.last_token;
      result.tokens.push_back(token);
      if (on_token) on_token(int(i), token);
      run.last = token;
      const bool stop = std::find(request.stop_ids.begin(), request.stop_ids.end(), token) !=
                        request.stop_ids.end();
      if (stop || int(result.tokens.size()) == request.max_new_tokens) finish(i);
    }
    if (!has_prefill) {
      s.decode_seconds += seconds(step_start, Clock::now());
      s.decode_only_tokens += batch.size();
    }
  }
  s.seconds = seconds(start, Clock::now());
  return results;
}

}  // namespace colibri
