// The server's scheduler on a one-process engine over the embedded model: prefix reuse gives
// bitwise the logits of recomputing the prompt, batching many requests gives each the tokens it
// gets alone, stop strings cut the text, and the KV pool is back to empty afterwards.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "../engine/local_model.h"
#include "coordinator/cpu_attention.h"
#include "coordinator/scheduler.h"

namespace colibri {
namespace {

const std::filesystem::path kModel = COLIBRI_EMBEDDED_MODEL;

// The embedded model with a one-process engine, and its tokenizer.
struct LocalModel : testing::LocalModel {
  Tokenizer tokenizer = Tokenizer::load(kModel / "tokenizer.json");
  LocalModel() : testing::LocalModel(kModel) {}
};

LocalModel& model() {
  static LocalModel m;
  return m;
}

struct Outcome {
  std::vector<int> tokens;
  std::string text;
  std::string reasoning;
  std::vector<std::vector<float>> logits;  // one row per generated token
  ServeEvent finish;
};

// Submits `requests` at once and runs the scheduler until all are done (drain after submit).
// With `machine`, the step-cost model learns its times (and `shapes` the calls, in order).
std::vector<Outcome> run_all(const std::vector<ServeRequest>& requests, bool prefix_cache,
                             int max_batch_tokens = 64, double max_itl_s = 0,
                             std::function<double(const StepShape&)> machine = {},
                             std::vector<StepShape>* shapes = nullptr) {
  LocalModel& m = model();
  EngineOptions eo;
  eo.max_rows = 64;
  eo.max_seqs = 8;
  eo.kv_tokens = 4096;
  Engine engine(m.config, m.weights, m.placement, *m.dispatcher, eo);
  ServeMetrics metrics;
  SchedulerOptions so;
  so.max_batch_tokens = max_batch_tokens;
  so.prefix_cache = prefix_cache;
  so.max_itl_s = max_itl_s;
  Scheduler scheduler(engine, m.tokenizer, metrics, so);
  if (machine)
    scheduler.step_seconds = [&](const StepShape& s) {
      if (shapes) shapes->push_back(s);
      return machine(s);
    };
  std::map<const ServeJob*, size_t> index;
  std::vector<Outcome> out(requests.size());
  scheduler.on_logits = [&](const ServeJob& job, std::span<const float> row) {
    out[index.at(&job)].logits.emplace_back(row.begin(), row.end());
  };
  std::vector<std::shared_ptr<ServeJob>> jobs;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto job = std::make_shared<ServeJob>();
    job->request = requests[i];
    index[job.get()] = i;
    jobs.push_back(job);
    EXPECT_EQ(scheduler.submit(job), SubmitResult::kAccepted);
  }
  // drain() would end queued requests: drain once every job has finished.
  std::thread stopper([&] {
    for (const auto& job : jobs)
      while (!job->channel.ended()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    scheduler.drain();
  });
  scheduler.run();
  stopper.join();
  for (size_t i = 0; i < jobs.size(); ++i) {
    std::vector<ServeEvent> events;
    jobs[i]->channel.wait(events, std::chrono::milliseconds(0));
    for (const ServeEvent& e : events) {
      if (e.kind == ServeEvent::Kind::kDelta) {
        out[i].text += e.text;
        out[i].reasoning += e.reasoning;
        out[i].tokens.insert(out[i].tokens.end(), e.tokens.begin(), e.tokens.end());
      } else {
        out[i].finish = e;
      }
    }
  }
  const ServeGauges g = metrics.gauges();
  EXPECT_EQ(g.running, 0);
  EXPECT_EQ(g.kv_blocks_running, 0);
  return out;
}

ServeRequest greedy(const std::string& text, int max_tokens) {
  ServeRequest r;
  r.prompt = model().tokenizer.encode(text);
  r.max_tokens = max_tokens;
  return r;
}

// Bit for bit with the attention row by row (COLIBRI_BLOCKED_ATTENTION=0, ctest
// serve_scheduler_row_attention). Blocked, a row in a call of several takes the blocked path and
// alone (a decode step of one sequence) the row path: within 5e-5 (5e-6 seen).
void expect_same_logits(const std::vector<float>& a, const std::vector<float>& b,
                        const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  if (!attention_blocked()) {
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << what;
    return;
  }
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  EXPECT_LE(worst, 5e-5f) << what;
}

TEST(Scheduler, BatchedRequestsGetTheTokensTheyGetAlone) {
  std::vector<ServeRequest> requests;
  const char* prompts[] = {"And God said,",
                           "In the beginning God created the heaven and the earth.",
                           "The LORD is my shepherd;",
                           "Jesus wept.",
                           "And it came to pass",
                           "Blessed are the meek: for they shall inherit the earth."};
  for (size_t i = 0; i < std::size(prompts); ++i)
    requests.push_back(greedy(prompts[i], 6 + 3 * int(i)));
  const std::vector<Outcome> together = run_all(requests, false, 16);  // prompts span several steps
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::vector<Outcome> alone = run_all({requests[i]}, false);
    EXPECT_EQ(together[i].tokens, alone[0].tokens) << prompts[i];
    EXPECT_EQ(together[i].text, alone[0].text);
    ASSERT_EQ(together[i].logits.size(), alone[0].logits.size());
    for (size_t t = 0; t < alone[0].logits.size(); ++t)
      expect_same_logits(together[i].logits[t], alone[0].logits[t],
                         std::string(prompts[i]) + " token " + std::to_string(t));
    EXPECT_EQ(int(together[i].tokens.size()), requests[i].max_tokens);
    EXPECT_EQ(together[i].finish.finish, FinishReason::kLength);
  }
}

// --max-itl-ms on a synthetic machine (1 ms a call, 0.1 ms a row: the cost model learns these
// times, not the measured ones): a 300-token prompt that arrives with a short one is cut, once
// the short one decodes, into chunks whose time fits the bound; alone with no sequence decoding
// it would take every row. Tokens and logits are those of the unbounded run.
TEST(Scheduler, TheItlBoundCutsALongPromptWhileAStreamDecodes) {
  const auto machine = [](const StepShape& s) { return 1e-3 + 1e-4 * s.rows(); };
  const double bound = 3.05e-3;  // one decode row and 19 prompt rows: 3.0 ms; 20: 3.1 ms
  const int kMost = 19;
  ServeRequest stream = greedy("And God said,", 40);
  std::string text;
  while (model().tokenizer.encode(text).size() < 300)
    text +=
        "In the beginning God created the heaven and the earth. And the earth was without "
        "form, and void; and darkness was upon the face of the deep. ";
  ServeRequest long_prompt = greedy(text, 6);
  long_prompt.prompt.resize(300);
  const std::vector<ServeRequest> requests = {stream, long_prompt};

  std::vector<StepShape> unbounded_calls, bounded_calls;
  const std::vector<Outcome> unbounded = run_all(requests, false, 64, 0, machine, &unbounded_calls);
  const std::vector<Outcome> bounded = run_all(requests, false, 64, bound, machine, &bounded_calls);

  // Calls that carried decode and prompt rows.
  const auto shared = [](const std::vector<StepShape>& calls) {
    std::vector<StepShape> out;
    for (const StepShape& s : calls)
      if (s.decode_rows > 0 && s.prompt_rows > 0) out.push_back(s);
    return out;
  };
  const std::vector<StepShape> cut = shared(bounded_calls), whole = shared(unbounded_calls);
  ASSERT_FALSE(whole.empty());
  ASSERT_GE(cut.size(), size_t(240 / kMost)) << "the prompt was not cut into chunks";
  EXPECT_GT(cut.size(), whole.size());
  EXPECT_EQ(whole[0].prompt_rows, 63);  // unbounded: the budget but the decode row
  // The first call has no decode row: the whole budget (time to first token first).
  EXPECT_EQ(bounded_calls[0].decode_rows, 0);
  EXPECT_EQ(bounded_calls[0].prompt_rows, 64);
  // Once the model has timed three calls it knows the machine: every shared call fits the bound,
  // and the largest carries the most rows that fit.
  int most = 0;
  for (size_t i = 0; i < cut.size(); ++i) {
    EXPECT_GE(cut[i].prompt_rows, 1);
    if (i < 2) continue;  // calls 2 and 3 (call 1 had no decode row)
    EXPECT_LE(machine(cut[i]), bound) << "shared call " << i;
    most = std::max(most, cut[i].prompt_rows);
  }
  EXPECT_EQ(most, kMost);

  for (size_t r = 0; r < requests.size(); ++r) {
    EXPECT_EQ(bounded[r].tokens, unbounded[r].tokens) << "request " << r;
    ASSERT_EQ(bounded[r].logits.size(), unbounded[r].logits.size());
    for (size_t t = 0; t < bounded[r].logits.size(); ++t)
      expect_same_logits(bounded[r].logits[t], unbounded[r].logits[t],
                         "request " + std::to_string(r) + " token " + std::to_string(t));
  }
}

TEST(Scheduler, PrefixReuseGivesBitwiseTheLogitsOfRecomputation) {
  LocalModel& m = model();
  EngineOptions eo;
  eo.max_rows = 64;
  eo.max_seqs = 8;
  eo.kv_tokens = 4096;
  // Turn 1, then turn 2 whose prompt continues turn 1's prompt and reply.
  const ServeRequest first = greedy("In the beginning God created", 12);
  const std::vector<Outcome> turn1 = run_all({first}, false);
  ServeRequest second = first;
  second.prompt.insert(second.prompt.end(), turn1[0].tokens.begin(), turn1[0].tokens.end());
  const std::vector<int> more = m.tokenizer.encode(" And the earth was without form");
  second.prompt.insert(second.prompt.end(), more.begin(), more.end());
  second.max_tokens = 10;
  const std::vector<Outcome> fresh = run_all({second}, false);

  // One scheduler: turn 1, then turn 2 once turn 1 is done (its slot is cached by then).
  Engine engine2(m.config, m.weights, m.placement, *m.dispatcher, eo);
  ServeMetrics metrics;
  SchedulerOptions so;
  so.max_batch_tokens = 64;
  Scheduler scheduler(engine2, m.tokenizer, metrics, so);
  std::vector<std::vector<float>> logits2;
  auto job1 = std::make_shared<ServeJob>(), job2 = std::make_shared<ServeJob>();
  job1->request = first;
  job2->request = second;
  scheduler.on_logits = [&](const ServeJob& job, std::span<const float> row) {
    if (&job == job2.get()) logits2.emplace_back(row.begin(), row.end());
  };
  ASSERT_EQ(scheduler.submit(job1), SubmitResult::kAccepted);
  std::thread feeder([&] {
    while (!job1->channel.ended()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(scheduler.submit(job2), SubmitResult::kAccepted);
    while (!job2->channel.ended()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    scheduler.drain();
  });
  scheduler.run();
  feeder.join();
  std::vector<ServeEvent> events;
  job2->channel.wait(events, std::chrono::milliseconds(0));
  ASSERT_FALSE(events.empty());
  const ServeEvent& finish = events.back();
  ASSERT_EQ(finish.kind, ServeEvent::Kind::kFinish);
  // Everything turn 1 put in the KV cache is reused: its prompt and its reply but the last token.
  EXPECT_EQ(finish.cached_tokens, int(first.prompt.size() + turn1[0].tokens.size() - 1));
  ASSERT_EQ(logits2.size(), fresh[0].logits.size());
  ASSERT_FALSE(logits2.empty());
  for (size_t t = 0; t < logits2.size(); ++t)
    expect_same_logits(logits2[t], fresh[0].logits[t], "generated token " + std::to_string(t));
  EXPECT_GT(metrics.gauges().kv_blocks_cached, 0);
}

TEST(Scheduler, StopStringsCutTheTextAndEndWithStop) {
  const ServeRequest plain = greedy("And God said,", 24);
  const Outcome full = run_all({plain}, false)[0];
  ASSERT_GT(full.text.size(), 12u) << full.text;
  // A stop string from the middle of the greedy text: the reply is the text before it.
  const std::string stop = full.text.substr(full.text.size() / 2, 4);
  ServeRequest stopped = plain;
  stopped.stop_strings = {"never appears", stop};
  const Outcome cut = run_all({stopped}, false)[0];
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(cut.finish.finish, FinishReason::kStop);
  EXPECT_LT(cut.tokens.size(), full.tokens.size());
}

// The thinking block goes apart from the answer, split on its marker tokens. Markers taken from
// the greedy reply itself (its first token opens, a later one closes) make the expected texts
// the decoding of known token ranges; the markers are in neither text.
TEST(Scheduler, TheThinkingBlockIsSplitOffTheAnswerAtItsMarkers) {
  const Tokenizer& tok = model().tokenizer;
  const ServeRequest plain = greedy("And God said,", 24);
  const Outcome full = run_all({plain}, false)[0];
  ASSERT_EQ(full.tokens.size(), 24u);
  size_t close = 3;  // a token that first appears at index >= 3
  while (close < full.tokens.size() &&
         std::find(full.tokens.begin(), full.tokens.begin() + std::ptrdiff_t(close),
                   full.tokens[close]) != full.tokens.begin() + std::ptrdiff_t(close))
    ++close;
  ASSERT_LT(close, full.tokens.size()) << "no token first appears late enough";
  const auto decode = [&](size_t from, size_t to) {
    return tok.decode(std::span(full.tokens).subspan(from, to - from), true);
  };
  ServeRequest opened_by_reply = plain;  // the reply's first token opens the block
  opened_by_reply.think_open = full.tokens[0];
  opened_by_reply.think_close = full.tokens[close];
  ServeRequest opened_by_prompt = plain;  // the prompt opened it
  opened_by_prompt.think_open = -2;
  opened_by_prompt.think_close = full.tokens[close];
  opened_by_prompt.thinking_open = true;
  ServeRequest never_opened = plain;  // the first token is not the opening marker
  never_opened.think_open = full.tokens[close];
  never_opened.think_close = full.tokens[0];
  const std::vector<Outcome> out =
      run_all({opened_by_reply, opened_by_prompt, never_opened}, false);
  for (const Outcome& o : out) EXPECT_EQ(o.tokens, full.tokens);
  EXPECT_EQ(out[0].reasoning, decode(1, close));
  EXPECT_EQ(out[0].text, decode(close + 1, full.tokens.size()));
  EXPECT_EQ(out[1].reasoning, decode(0, close));
  EXPECT_EQ(out[1].text, decode(close + 1, full.tokens.size()));
  EXPECT_EQ(out[2].reasoning, "");
  EXPECT_EQ(out[2].text, full.text);
}

// Quantiles of a histogram as Prometheus' histogram_quantile reads them: linear within the
// bucket that holds the rank, the largest bound for the +Inf bucket, 0 when empty.
TEST(ServeMetrics, HistogramQuantileInterpolatesWithinItsBucket) {
  Histogram h({1, 2, 4});
  EXPECT_EQ(h.quantile(h.counts(), 0.5), 0);
  for (double v : {0.5, 1.5, 1.5, 3.0}) h.observe(v);  // buckets [1, 2, 1, 0]
  EXPECT_EQ(h.quantile(h.counts(), 0.25), 1.0);        // rank 1: the end of the first bucket
  EXPECT_EQ(h.quantile(h.counts(), 0.5), 1.5);         // rank 2: half way through (1, 2]
  EXPECT_EQ(h.quantile(h.counts(), 1.0), 4.0);
  EXPECT_EQ(h.quantile({0, 0, 0, 2}, 0.5), 4.0);  // only +Inf: the largest bound
  EXPECT_EQ(h.quantile({0, 2, 0, 0}, 0.5), 1.5);  // a difference of two readings
}

TEST(Scheduler, Utf8CompletePrefix) {
  const std::string euro = "a\xE2\x82\xAC";  // a€
  EXPECT_EQ(utf8_complete_prefix(euro, 4), 4u);
  EXPECT_EQ(utf8_complete_prefix(euro, 3), 1u);
  EXPECT_EQ(utf8_complete_prefix(euro, 2), 1u);
  EXPECT_EQ(utf8_complete_prefix(euro, 1), 1u);
  EXPECT_EQ(utf8_complete_prefix("", 0), 0u);
}

}  // namespace
}  // namespace colibri
