#include "coordinator/scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <future>

#include "common/error.h"

namespace colibri {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

void print_kv_dir_notes(const std::vector<std::string>& notes) {
  for (const std::string& note : notes)
    std::fprintf(stderr, "colibri-node: --kv-cache-dir: %s\n", note.c_str());
  if (!notes.empty()) std::fflush(stderr);
}

// Length of the longest suffix of text[..end) that is a proper prefix of a stop string: text
// that may still become a stop string is held back.
size_t stop_holdback(const std::string& text, size_t end, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& stop : stops)
    for (size_t k = std::min(stop.size() - 1, end); k > hold; --k)
      if (text.compare(end - k, k, stop, 0, k) == 0) {
        hold = k;
        break;
      }
  return hold;
}

}  // namespace

const char* finish_reason_name(FinishReason reason) {
  return reason == FinishReason::kStop ? "stop" : "length";
}

size_t utf8_complete_prefix(const std::string& text, size_t end) {
  // Look back over at most 3 continuation bytes for the lead byte of the last character.
  for (size_t back = 1; back <= 4 && back <= end; ++back) {
    const unsigned char c = static_cast<unsigned char>(text[end - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    const size_t length = c < 0x80           ? 1
                          : (c >> 5) == 0x6  ? 2
                          : (c >> 4) == 0xE  ? 3
                          : (c >> 3) == 0x1E ? 4
                                             : 1;
    return back < length ? end - back : end;
  }
  return end;
}

// ---- ServeChannel --------------------------------------------------------------------------

void ServeChannel::push(ServeEvent event) {
  {
    std::lock_guard lock(mutex_);
    if (ended_) return;
    if (event.kind != ServeEvent::Kind::kDelta) ended_ = true;
    events_.push_back(std::move(event));
  }
  ready_.notify_all();
}

bool ServeChannel::wait(std::vector<ServeEvent>& out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!ready_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  for (ServeEvent& e : events_) out.push_back(std::move(e));
  events_.clear();
  return true;
}

bool ServeChannel::ended() const {
  std::lock_guard lock(mutex_);
  return ended_;
}

// ---- Scheduler -------------------------------------------------------------------------------

struct Scheduler::Active {
  std::shared_ptr<ServeJob> job;
  int slot = -1;
  int need_blocks = 0;   // blocks for prompt + max_tokens, reserved at admission
  size_t fed = 0;        // prompt tokens in the KV cache
  int cached = 0;        // of those, reused from the prefix cache
  int last = -1;         // sampled token to feed next; -1 while prefilling
  std::vector<int> ids;  // tokens in the KV cache, in order
  std::vector<int> generated;
  std::string text;           // generated text (bytes), stop strings cut
  size_t emitted = 0;         // bytes of text sent
  bool thinking = false;      // inside the thinking block: text goes to `reasoning`
  std::string reasoning;      // the thinking block's text (bytes)
  size_t reasoning_sent = 0;  // bytes of it sent
  Sampler sampler;
  std::optional<OutputConstraint> constraint;  // the reply's grammar, past the thinking block
  Clock::time_point admitted, last_token;

  Active(std::shared_ptr<ServeJob> j, const SamplingParams& sampling)
      : job(std::move(j)),
        thinking(job->request.thinking_open && job->request.think_close >= 0),
        sampler(sampling, job->request.prompt) {
    const ServeRequest& r = job->request;
    if (r.grammar) constraint.emplace(r.grammar, r.stop_ids, r.grammar_logits);
  }
};

Scheduler::Scheduler(Engine& engine, const Tokenizer& tokenizer, ServeMetrics& metrics,
                     const SchedulerOptions& options)
    : engine_(engine), tokenizer_(tokenizer), metrics_(metrics), options_(options) {
  if (options_.max_batch_tokens < 1 || options_.max_batch_tokens > engine.max_rows())
    fail("--max-batch-tokens {} must be in [1, --max-rows {}]", options_.max_batch_tokens,
         engine.max_rows());
  if (!(options_.max_itl_s >= 0) || !std::isfinite(options_.max_itl_s))
    fail("--max-itl-ms {} must be >= 0", options_.max_itl_s * 1e3);
  kv_capacity_tokens_ = engine.kv().capacity_tokens();
  if (options_.kv_cache_dir) {
    std::vector<std::string> notes;
    kv_dir_ = std::make_unique<KvCacheDir>(*options_.kv_cache_dir, engine.config(), notes);
    print_kv_dir_notes(notes);
    const KvCacheDirCounters c = kv_dir_->counters();
    std::fprintf(stderr, "colibri-node: --kv-cache-dir %s: %llu files, %.1f MB of prefixes\n",
                 kv_dir_->folder().c_str(), static_cast<unsigned long long>(c.files),
                 double(c.bytes) * 1e-6);
  }
  update_gauges();
}

Scheduler::~Scheduler() = default;

int Scheduler::blocks_for(int64_t tokens) const {
  const int64_t bt = engine_.kv().block_tokens();
  return int((tokens + bt - 1) / bt);
}

bool Scheduler::fits(int64_t positions) const {
  return positions <= engine_.config().max_position_embeddings && positions <= kv_capacity_tokens_;
}

SubmitResult Scheduler::submit(std::shared_ptr<ServeJob> job) {
  {
    std::lock_guard lock(mutex_);
    if (draining_) return SubmitResult::kDraining;
    if (int(pending_.size()) >= options_.max_queue) return SubmitResult::kQueueFull;
    job->arrived = Clock::now();
    pending_.push_back(job);
    jobs_.insert(std::move(job));
  }
  wake_.notify_all();
  return SubmitResult::kAccepted;
}

void Scheduler::drain() {
  std::deque<std::shared_ptr<ServeJob>> queued;
  {
    std::lock_guard lock(mutex_);
    draining_ = true;
    queued.swap(pending_);
    for (const auto& job : queued) jobs_.erase(job);
  }
  for (const auto& job : queued) {
    ServeEvent e;
    e.kind = ServeEvent::Kind::kError;
    e.text = "the server is shutting down";
    job->channel.push(std::move(e));
  }
  wake_.notify_all();
}

void Scheduler::fail_all(const std::string& message) {
  std::set<std::shared_ptr<ServeJob>> jobs;
  {
    std::lock_guard lock(mutex_);
    draining_ = true;
    jobs = jobs_;
  }
  for (const auto& job : jobs) {
    ServeEvent e;
    e.kind = ServeEvent::Kind::kError;
    e.text = message;
    job->channel.push(std::move(e));
  }
  wake_.notify_all();
}

void Scheduler::warm_up() {
  const int seq = engine_.open_sequence();
  const int token[] = {0};
  engine_.forward(seq, token, false);
  engine_.close_sequence(seq);
  ServeGauges g = metrics_.gauges();
  g.ready = true;
  metrics_.set_gauges(g);
  update_gauges();
}

void Scheduler::update_gauges() {
  ServeGauges g = metrics_.gauges();
  KvManager& kv = engine_.kv();
  {
    std::lock_guard lock(mutex_);
    g.waiting = int(pending_.size());
  }
  g.running = int(active_.size());
  g.kv_blocks_total = kv.total_blocks();
  g.kv_blocks_free = kv.free_blocks();
  g.kv_blocks_running = g.kv_blocks_cached = 0;
  for (const auto& a : active_) g.kv_blocks_running += kv.blocks(a->slot);
  for (const Cached& c : cache_) g.kv_blocks_cached += kv.blocks(c.slot);
  g.cached_sequences = int(cache_.size());
  metrics_.set_gauges(g);
  if (kv_dir_) {
    const KvCacheDirCounters c = kv_dir_->counters();
    KvCacheDirMetrics m;
    m.enabled = true;
    m.loads = c.loads;
    m.tokens_loaded = c.tokens_loaded;
    m.files_written = c.files_written;
    m.bytes_written = c.bytes_written;
    m.files_refused = c.files_refused;
    m.files_evicted = c.files_evicted;
    m.writes_failed = c.writes_failed + c.writes_dropped;
    m.files = c.files;
    m.bytes = c.bytes;
    m.load_seconds = c.load_seconds;
    metrics_.set_kv_cache_dir(m);
  }
  if (Profiler* p = engine_.profiler()) {
    metrics_.set_phases(p->counters().phase_us);
    metrics_.set_rank_replies(p->counters().reply_us);
  }
  PlacementMetrics placement;
  placement.epoch = engine_.placement().epoch;
  placement.pairs_to_rank = engine_.placement_counters().pairs_to_rank;
  placement.replica_pairs = engine_.placement_counters().replica_pairs;
  if (const RepinStats* r = engine_.repin_stats()) {
    placement.repin = true;
    placement.repin_rounds = r->rounds;
    placement.repin_changes = r->changes;
    placement.repin_moves = r->moves;
    placement.repin_seconds = double(r->coordinator_us) * 1e-6;
  }
  const PrefetchStats::Totals f = engine_.prefetch_stats().totals();
  placement.prefetch_pairs = f.pairs;
  placement.prefetch_pair_hits = f.pair_hits;
  placement.prefetch_hinted = f.set_predicted;
  placement.prefetch_hinted_hits = f.set_hits;
  placement.prefetch = placement.prefetch_pairs > 0;
  metrics_.set_placement(placement);
  if (Clock::now() - last_view_ >= kViewPeriod) update_engine_view();
  if (steps_ != steps_at_counters_ && Clock::now() - last_counters_ >= kCountersPeriod)
    update_live_counters();
}

void Scheduler::update_live_counters() {
  last_counters_ = Clock::now();
  steps_at_counters_ = steps_;
  if (!options_.live_counters) return;
  std::vector<LiveCounters> counters = options_.live_counters();
  metrics_.set_live_counters(std::move(counters),
                             std::chrono::duration<double>(Clock::now() - last_counters_).count());
}

void Scheduler::update_engine_view() {
  last_view_ = Clock::now();
  // The step-cost model, refitted here at most every kViewPeriod (and when a prompt's rows are
  // chosen), not after every step.
  StepCostMetrics cost;
  cost.fixed_s = step_cost_.fit().fixed_s;
  cost.row_s = step_cost_.fit().row_s;
  cost.kilo_key_s = step_cost_.fit().kilo_key_s;
  cost.observations = step_cost_.observations();
  cost.mean_abs_error_s = step_cost_.mean_abs_error_s();
  cost.decode_s = decode_shape_.rows() > 0 ? step_cost_.predict(decode_shape_) : 0;
  cost.itl_bound_s = options_.max_itl_s;
  metrics_.set_step_cost(cost);
  EngineView view;
  if (Profiler* p = engine_.profiler()) {
    const RankReport& r = p->counters();  // not report(): that copies the trace events
    view.coordinator = live_counters(r);
    view.coordinator.wall_us = p->now_us();
    view.bytes_to_rank = r.bytes_to_rank;
    view.layer_phase_us = r.layer_phase_us;
    view.layer_exchanges = r.layer_exchanges;
  }
  view.routes = engine_.routes();
  view.placement = engine_.shared_placement();
  metrics_.set_engine_view(std::move(view));
}

void Scheduler::evict(size_t i) {
  engine_.close_sequence(cache_[i].slot);
  cache_.erase(cache_.begin() + std::ptrdiff_t(i));
}

void Scheduler::drop_cancelled() {
  for (size_t i = 0; i < active_.size();) {
    if (active_[i]->job->channel.cancelled()) {
      finish(i, "cancelled");
    } else {
      ++i;
    }
  }
}

void Scheduler::admit() {
  KvManager& kv = engine_.kv();
  for (;;) {
    std::shared_ptr<ServeJob> job;
    {
      std::lock_guard lock(mutex_);
      if (pending_.empty()) return;
      job = pending_.front();
      if (job->channel.cancelled()) {
        pending_.pop_front();
        jobs_.erase(job);
        metrics_.count_finished("cancelled");
        continue;
      }
    }
    const ServeRequest& request = job->request;
    const int need = blocks_for(int64_t(request.prompt.size()) + request.max_tokens);

    // The cached sequence sharing the longest prefix with the prompt; at least one prompt token
    // is left to compute, for the logits of the first generated token.
    int hit = -1;
    size_t hit_length = 0;
    if (options_.prefix_cache) {
      for (size_t c = 0; c < cache_.size(); ++c) {
        const std::vector<int>& ids = cache_[c].ids;
        const size_t limit = std::min(ids.size(), request.prompt.size() - 1);
        size_t m = 0;
        while (m < limit && ids[m] == request.prompt[m]) ++m;
        if (m > hit_length) {
          hit = int(c);
          hit_length = m;
        }
      }
    }
    // Slots: running + cached + this one.
    const auto lru_except_hit = [&]() -> int {
      int lru = -1;
      for (size_t c = 0; c < cache_.size(); ++c)
        if (int(c) != hit && (lru < 0 || cache_[c].last_used < cache_[size_t(lru)].last_used))
          lru = int(c);
      return lru;
    };
    const auto evict_one = [&]() {
      const int lru = lru_except_hit();
      if (lru < 0) return false;
      evict(size_t(lru));
      if (hit > lru) --hit;
      return true;
    };
    while (int(active_.size() + cache_.size()) + (hit < 0 ? 1 : 0) > kv.max_seqs())
      if (!evict_one()) break;
    if (int(active_.size() + cache_.size()) + (hit < 0 ? 1 : 0) > kv.max_seqs()) return;
    // Blocks: what running sequences may still take, plus what this one needs.
    const auto short_of_blocks = [&] {
      int outstanding = 0;
      for (const auto& a : active_) outstanding += std::max(0, a->need_blocks - kv.blocks(a->slot));
      const int held = hit >= 0 ? kv.blocks(cache_[size_t(hit)].slot) : 0;
      return kv.free_blocks() - outstanding < std::max(0, need - held);
    };
    while (short_of_blocks())
      if (!evict_one()) break;
    if (short_of_blocks()) {
      // Even the reused sequence's own blocks may be needed for an admission later: give up the
      // hit rather than wait forever when nothing else is running.
      if (hit >= 0 && active_.empty()) {
        evict(size_t(hit));
        hit = -1;
        hit_length = 0;
        continue;
      }
      return;
    }

    {
      std::lock_guard lock(mutex_);
      pending_.pop_front();
    }
    auto a = std::make_unique<Active>(job, request.sampling);
    a->need_blocks = need;
    a->admitted = Clock::now();
    if (options_.prefix_cache) metrics_.prefix_query(hit >= 0);
    if (hit >= 0) {
      Cached& c = cache_[size_t(hit)];
      a->slot = c.slot;
      kv.set_length(a->slot, int(hit_length));
      a->ids.assign(request.prompt.begin(), request.prompt.begin() + std::ptrdiff_t(hit_length));
      a->fed = hit_length;
      a->cached = int(hit_length);
      cache_.erase(cache_.begin() + hit);
    } else {
      a->slot = engine_.open_sequence();
    }
    // A longer prefix on disk: loaded into the slot on this thread (reading the files and copying
    // their rows), instead of computed.
    if (kv_dir_) {
      std::vector<std::string> notes;
      const int held = kv_dir_->load(kv, a->slot, request.prompt, int(a->fed),
                                     int(request.prompt.size()) - 1, notes);
      print_kv_dir_notes(notes);
      if (held > int(a->fed)) {
        a->ids.assign(request.prompt.begin(), request.prompt.begin() + held);
        a->fed = size_t(held);
        a->cached = held;
      }
    }
    metrics_.observe_queue(seconds(job->arrived, a->admitted));
    metrics_.add_prompt_tokens(request.prompt.size(), size_t(a->cached));
    active_.push_back(std::move(a));
  }
}

int Scheduler::sample(Active& a, std::span<const float> logits) {
  if (!a.constraint || a.thinking) return a.sampler.sample(logits);
  masked_.assign(logits.begin(), logits.end());
  a.constraint->mask(masked_);
  return a.sampler.sample(masked_);
}

bool Scheduler::on_token(Active& a, int token, std::optional<TokenLogprob> logprob) {
  const ServeRequest& request = a.job->request;
  const auto now = Clock::now();
  if (a.generated.empty()) {
    metrics_.observe_ttft(seconds(a.job->arrived, now));
  } else {
    metrics_.observe_itl(seconds(a.last_token, now));
  }
  a.last_token = now;
  a.generated.push_back(token);
  metrics_.add_generated_tokens(1);

  bool finished = false;
  FinishReason reason = FinishReason::kLength;
  if (a.constraint && !a.thinking) {
    if (!a.constraint->accept(token)) {
      ServeEvent error;
      error.kind = ServeEvent::Kind::kError;
      error.status = 500;
      error.text = fmt::format("token {} was sampled against the reply's grammar", token);
      a.job->channel.push(std::move(error));
      metrics_.count_finished("error");
      return true;
    }
  }
  // The grammar complete: its stop id accepted, or the last token of a reply that has none.
  const bool grammar_ended = a.constraint && !a.thinking && a.constraint->ended();
  const bool opens = request.think_close >= 0 && token == request.think_open && !a.thinking &&
                     a.generated.size() == 1;
  const bool closes = a.thinking && token == request.think_close;
  if (std::find(request.stop_ids.begin(), request.stop_ids.end(), token) !=
      request.stop_ids.end()) {
    finished = true;
    reason = FinishReason::kStop;
  } else if (opens || closes) {
    a.thinking = opens;  // the markers themselves are in neither text
  } else if (a.thinking) {
    const int one[] = {token};
    a.reasoning += tokenizer_.decode_bytes(one, /*skip_special=*/true);
  } else {
    const int one[] = {token};
    const size_t before = a.text.size();
    a.text += tokenizer_.decode_bytes(one, /*skip_special=*/true);
    size_t cut = std::string::npos;
    for (const std::string& stop : request.stop_strings) {
      const size_t from = before >= stop.size() ? before - stop.size() + 1 : 0;
      const size_t at = a.text.find(stop, std::min(from, a.emitted));
      if (at != std::string::npos) cut = std::min(cut, at);
    }
    if (cut != std::string::npos) {
      a.text.resize(cut);
      finished = true;
      reason = FinishReason::kStop;
    }
  }
  if (!finished && grammar_ended) {
    finished = true;
    reason = FinishReason::kStop;
  }
  if (!finished && int(a.generated.size()) >= request.max_tokens) finished = true;

  size_t end = a.text.size();
  if (!finished) {
    end -= stop_holdback(a.text, end, request.stop_strings);
    end = std::max(a.emitted, utf8_complete_prefix(a.text, end));
  }
  ServeEvent delta;
  const size_t thought =
      finished ? a.reasoning.size()
               : std::max(a.reasoning_sent, utf8_complete_prefix(a.reasoning, a.reasoning.size()));
  delta.reasoning = a.reasoning.substr(a.reasoning_sent, thought - a.reasoning_sent);
  a.reasoning_sent = thought;
  delta.text = a.text.substr(a.emitted, end - a.emitted);
  delta.tokens = {token};
  if (logprob) delta.logprobs.push_back(std::move(*logprob));
  a.emitted = end;
  a.job->channel.push(std::move(delta));
  if (finished) {
    ServeEvent done;
    done.kind = ServeEvent::Kind::kFinish;
    done.finish = reason;
    done.prompt_tokens = int(request.prompt.size());
    done.completion_tokens = int(a.generated.size());
    done.cached_tokens = a.cached;
    a.job->channel.push(std::move(done));
    metrics_.count_finished(finish_reason_name(reason));
    metrics_.observe_e2e(seconds(a.job->arrived, now));
  } else {
    a.last = token;
  }
  return finished;
}

void Scheduler::finish(size_t i, const char* reason) {
  std::unique_ptr<Active> a = std::move(active_[i]);
  active_.erase(active_.begin() + std::ptrdiff_t(i));
  {
    std::lock_guard lock(mutex_);
    jobs_.erase(a->job);
  }
  const bool cancelled = std::string(reason) == "cancelled";
  if (cancelled) metrics_.count_finished(reason);
  const int length = engine_.length(a->slot);
  a->ids.resize(size_t(length));
  if (kv_dir_ && !cancelled && length > 0) kv_dir_->save(engine_.kv(), a->slot, a->ids);
  if (options_.prefix_cache && !cancelled && length > 0) {
    cache_.push_back({a->slot, std::move(a->ids), ++tick_});
  } else {
    engine_.close_sequence(a->slot);
  }
}

void Scheduler::step() {
  ++steps_;
  KvManager& kv = engine_.kv();
  batch_.clear();
  logit_owner_.clear();
  StepShape shape;
  for (const auto& a : active_) {
    if (a->last < 0) continue;
    const int pos = kv.length(a->slot);
    batch_.add(a->slot, a->last, pos, true);
    a->ids.push_back(a->last);
    a->last = -1;
    logit_owner_.push_back(a.get());
    ++shape.decode_rows;
    shape.attended += pos + 1;
  }
  decode_shape_ = shape;
  prompt_work_.clear();
  for (const auto& a : active_) {
    const size_t prompt = a->job->request.prompt.size();
    if (a->fed < prompt) prompt_work_.push_back({kv.length(a->slot), int64_t(prompt - a->fed)});
  }
  const int budget = std::min(options_.max_batch_tokens, engine_.max_rows()) - batch_.size();
  const ChunkChoice choice =
      choose_prompt_rows(step_cost_, shape, prompt_work_, budget, options_.max_itl_s,
                         min_prompt_rows(options_.max_batch_tokens));
  int left = choice.prompt_rows;
  for (const auto& a : active_) {
    const std::vector<int>& prompt = a->job->request.prompt;
    if (left <= 0) break;
    if (a->fed == prompt.size()) continue;
    const size_t take = std::min(size_t(left), prompt.size() - a->fed);
    const int pos = kv.length(a->slot);
    for (size_t k = 0; k < take; ++k) {
      const bool last = a->fed + k + 1 == prompt.size();
      batch_.add(a->slot, prompt[a->fed + k], pos + int(k), last);
      a->ids.push_back(prompt[a->fed + k]);
      if (last) logit_owner_.push_back(a.get());
    }
    a->fed += take;
    left -= int(take);
    shape.prompt_rows += int(take);
    shape.attended += attended_keys(pos, int64_t(take));
  }
  if (batch_.size() == 0) return;

  // The grammars' masks of this step's constrained rows, computed while the forward call runs.
  std::vector<OutputConstraint*> constrained;
  for (Active* a : logit_owner_)
    if (a->constraint && !a->thinking) constrained.push_back(&*a->constraint);
  std::future<void> masks;
  if (!constrained.empty())
    masks = std::async(std::launch::async, [&constrained] {
      for (OutputConstraint* c : constrained) c->prepare();
    });

  const auto start = Clock::now();
  step_started_ns_ = now_ns();
  const std::vector<float> logits = engine_.forward(batch_);
  if (masks.valid()) masks.get();
  step_started_ns_ = 0;
  const double took = seconds(start, Clock::now());
  if (took > longest_step_s_) longest_step_s_ = took;
  // A moving average of recent steps: one slow step (a descheduled rank) does not make every
  // later stall look normal.
  const double typical = typical_step_s_;
  typical_step_s_ = typical == 0 ? took : 0.9 * typical + 0.1 * took;
  metrics_.observe_step(batch_.size(), took);
  if (shape.prompt_rows > 0)
    metrics_.observe_prefill_chunk(shape.prompt_rows, choice.cut,
                                   choice.cut && choice.predicted_s > options_.max_itl_s);

  const size_t vocab = size_t(engine_.config().vocab_size);
  std::vector<Active*> finished;
  for (size_t row = 0; row < logit_owner_.size(); ++row) {
    Active& a = *logit_owner_[row];
    if (a.job->channel.cancelled()) continue;  // freed below
    const std::span<const float> row_logits(logits.data() + row * vocab, vocab);
    if (on_logits) on_logits(*a.job, row_logits);
    int token;
    std::optional<TokenLogprob> logprob;
    {
      OptionalScope scope(engine_.profiler(), Phase::kSampling);
      token = sample(a, row_logits);
      if (a.job->request.logprobs >= 0)
        logprob = token_logprob(row_logits, token, a.job->request.logprobs);
    }
    if (on_token(a, token, std::move(logprob))) finished.push_back(&a);
  }
  // The cost model learns the call with its sampling: what a running stream waits for.
  step_cost_.observe(shape, step_seconds ? step_seconds(shape) : seconds(start, Clock::now()));
  for (Active* done : finished)
    for (size_t i = 0; i < active_.size(); ++i)
      if (active_[i].get() == done) {
        finish(i, "done");
        break;
      }
}

void Scheduler::run() {
  for (;;) {
    drop_cancelled();
    admit();
    update_gauges();
    if (active_.empty()) {
      std::unique_lock lock(mutex_);
      if (draining_ && pending_.empty()) break;
      wake_.wait_for(lock, std::chrono::milliseconds(50),
                     [&] { return !pending_.empty() || draining_; });
      continue;
    }
    step();
  }
  if (kv_dir_ && !kv_dir_->flush(60))
    std::fprintf(stderr,
                 "colibri-node: --kv-cache-dir: writes still queued after 60 s are dropped\n");
  update_gauges();
}

}  // namespace colibri
