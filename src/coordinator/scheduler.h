// Continuous batching for the server. One thread, the one that owns the Engine (and, in a job,
// every MPI call), runs Scheduler::run(): between forward calls it admits waiting requests, and
// each call carries one decode row of every running sequence plus prompt chunks of new ones
// within --max-batch-tokens, so a long prompt does not stall running streams. With --max-itl-ms,
// a call that carries decode rows carries only the prompt rows that keep its time, as the
// step-cost model predicts it (step_cost.h), within that bound. HTTP threads only submit jobs and
// read their ServeChannel; they never touch the engine.
//
// KV memory is reserved at admission: a request is admitted when the pool can hold its prompt
// plus max_tokens next to what running sequences may still grow to, so a running sequence never
// meets a full pool. Finished sequences stay in a small LRU (the prefix cache): a request whose
// prompt starts with a cached sequence's tokens continues from that slot instead of recomputing
// them; cached sequences are evicted when their slots or blocks are needed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "coordinator/engine.h"
#include "coordinator/kv_cache_dir.h"
#include "coordinator/output_grammar.h"
#include "coordinator/serve_metrics.h"
#include "coordinator/step_cost.h"
#include "model/sampler.h"
#include "tokenizer/tokenizer.h"

namespace colibri {

struct ServeRequest {
  std::vector<int> prompt;
  int max_tokens = 16;  // >= 1
  SamplingParams sampling;
  std::vector<int> stop_ids;              // generation ends after one of these
  std::vector<std::string> stop_strings;  // generation ends before one of these (not returned)
  int logprobs = -1;  // >= 0: each token's log-probability with this many alternatives
  // A chat's thinking block, returned apart from the answer: the ids of its markers (-1: no
  // split), and whether the prompt opened it. Without that, a reply that starts with the
  // opening marker opens it.
  int think_open = -1, think_close = -1;
  bool thinking_open = false;
  // What the reply must be (response_format, a forced tool call): enforced on every token after
  // the thinking block; null: free.
  std::shared_ptr<const CompiledOutput> grammar;
  int grammar_logits = 0;  // the grammar's logits row length
};

enum class FinishReason { kStop, kLength };
const char* finish_reason_name(FinishReason reason);

struct ServeEvent {
  enum class Kind { kDelta, kFinish, kError };
  Kind kind = Kind::kDelta;
  std::string text;         // kDelta: new text, whole UTF-8 characters; kError: the message
  std::vector<int> tokens;  // kDelta: ids sampled since the previous event
  std::vector<TokenLogprob> logprobs;  // kDelta: theirs, when the request asked
  std::string reasoning;               // kDelta: new text of the thinking block
  FinishReason finish = FinishReason::kLength;
  int prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;  // kFinish
  int status = 503;                                                 // kError: HTTP status
};

// One request's events, from the scheduler thread to its HTTP thread.
class ServeChannel {
 public:
  // Ignored once a finish or error event was pushed.
  void push(ServeEvent event);
  // Appends every pending event to `out`, waiting up to `timeout` for one; false if none came.
  bool wait(std::vector<ServeEvent>& out, std::chrono::milliseconds timeout);
  // The client went away: the scheduler ends the sequence and frees its blocks.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }
  bool ended() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<ServeEvent> events_;
  bool ended_ = false;
  std::atomic<bool> cancelled_{false};
};

struct ServeJob {
  ServeRequest request;
  ServeChannel channel;
  std::chrono::steady_clock::time_point arrived = std::chrono::steady_clock::now();
};

struct SchedulerOptions {
  int max_batch_tokens = 256;  // rows per forward call (decode rows + prompt chunks)
  int max_queue = 64;          // waiting requests; submit() refuses more
  // --max-itl-ms in seconds: while a sequence decodes, a call's prompt rows are cut so that its
  // predicted time stays within it (at least min_prompt_rows(max_batch_tokens) of them); 0: off.
  double max_itl_s = 0;
  bool prefix_cache = true;
  std::optional<KvCacheDirOptions> kv_cache_dir;  // --kv-cache-dir
  // Every rank's own counters, asked for between steps (Node::live_counters) about once a second
  // while the engine steps, and once more when it stops; empty: not asked.
  std::function<std::vector<LiveCounters>()> live_counters;
};

enum class SubmitResult { kAccepted, kQueueFull, kDraining };

class Scheduler {
 public:
  Scheduler(Engine& engine, const Tokenizer& tokenizer, ServeMetrics& metrics,
            const SchedulerOptions& options);
  ~Scheduler();

  // Any thread. The request must fit the context and the KV pool (fits()).
  SubmitResult submit(std::shared_ptr<ServeJob> job);
  // Whether a request of `positions` tokens (prompt + max_tokens) can ever be admitted.
  bool fits(int64_t positions) const;
  int kv_capacity_tokens() const { return kv_capacity_tokens_; }

  // Engine thread: one forward call, so that the first request does not pay for start-up.
  void warm_up();
  // Engine thread: the loop; returns once drain() was called and no request is left.
  void run();
  // Any thread: refuse new requests and end queued ones (503); running ones finish.
  void drain();
  bool draining() const { return draining_; }
  // Any thread: an error event (503) to every request not yet ended.
  void fail_all(const std::string& message);

  // Start of the forward call in progress (steady clock, ns; 0 when none), the longest one so
  // far and a moving average of recent ones: a signal watcher tells a stalled exchange from a
  // slow one.
  int64_t step_started_ns() const { return step_started_ns_; }
  double longest_step_seconds() const { return longest_step_s_; }
  double typical_step_seconds() const { return typical_step_s_; }

  // Test hook: the logits row each token was sampled from.
  std::function<void(const ServeJob&, std::span<const float>)> on_logits;
  // Test hook: the time the step-cost model learns for each call, in place of the measured one.
  std::function<double(const StepShape&)> step_seconds;

 private:
  struct Active;
  struct Cached {
    int slot = -1;
    std::vector<int> ids;  // tokens in the slot's KV
    uint64_t last_used = 0;
  };

  int blocks_for(int64_t tokens) const;
  void drop_cancelled();
  void admit();
  void evict(size_t cache_index);
  void step();
  // Samples the next token of `a` from its logits row (its grammar's mask applied).
  int sample(Active& a, std::span<const float> logits);
  // Handles a sampled token; true when the request is finished.
  bool on_token(Active& a, int token, std::optional<TokenLogprob> logprob);
  void finish(size_t active_index, const char* reason);
  void update_gauges();
  // The engine's counters for the dashboard and /metrics' per-layer lines (EngineView), and the
  // step-cost model's fit: at most every kViewPeriod, so that a step of a large model does not
  // copy its routes (or refit) each time.
  void update_engine_view();
  static constexpr std::chrono::milliseconds kViewPeriod{250};
  // Asks the ranks for their counters (options_.live_counters) when the engine stepped since the
  // last time and kCountersPeriod has passed.
  void update_live_counters();
  static constexpr std::chrono::milliseconds kCountersPeriod{1000};

  Engine& engine_;
  const Tokenizer& tokenizer_;
  ServeMetrics& metrics_;
  SchedulerOptions options_;
  int kv_capacity_tokens_ = 0;

  mutable std::mutex mutex_;  // guards pending_, jobs_, draining_ changes
  std::condition_variable wake_;
  std::deque<std::shared_ptr<ServeJob>> pending_;
  std::set<std::shared_ptr<ServeJob>> jobs_;  // every job not yet ended: for fail_all
  std::atomic<bool> draining_{false};

  // Engine thread only.
  std::vector<std::unique_ptr<Active>> active_;
  std::vector<Cached> cache_;
  std::unique_ptr<KvCacheDir> kv_dir_;
  uint64_t tick_ = 0;
  Batch batch_;
  std::vector<Active*> logit_owner_;
  std::vector<float> masked_;  // a constrained row's logits
  StepCostModel step_cost_;
  std::vector<PromptWork> prompt_work_;
  StepShape decode_shape_;  // the last call's decode rows

  std::chrono::steady_clock::time_point last_view_{};
  std::chrono::steady_clock::time_point last_counters_{};
  uint64_t steps_ = 0;                         // forward calls
  uint64_t steps_at_counters_ = ~uint64_t{0};  // steps_ at the last counters (none yet: all ones)
  std::atomic<int64_t> step_started_ns_{0};
  std::atomic<double> longest_step_s_{0};
  std::atomic<double> typical_step_s_{0};
};

// Bytes of `text` up to `end`, cut back so that it does not end inside a UTF-8 character.
size_t utf8_complete_prefix(const std::string& text, size_t end);

}  // namespace colibri
