#include <gtest/gtest.h>

#include <limits>
#include <map>

#include "common/error.h"
#include "model/sampler.h"

namespace colibri {
namespace {

SamplingParams sampling(float temperature, uint64_t seed, float top_p = 1.0f) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

TEST(Sampler, GreedyPicksArgmaxLowestIndexOnTies) {
  Sampler sampler(sampling(0.0f, 1, 1.0f));
  const std::vector<float> logits = {0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(sampler.sample(logits), 1);
}

TEST(Sampler, SameSeedSameTokens) {
  const std::vector<float> logits = {0.0f, 0.5f, 1.0f, 0.2f, 0.9f};
  Sampler a(sampling(1.0f, 42, 1.0f)), b(sampling(1.0f, 42, 1.0f)), c(sampling(1.0f, 43, 1.0f));
  std::vector<int> ta, tb, tc;
  for (int i = 0; i < 64; ++i) {
    ta.push_back(a.sample(logits));
    tb.push_back(b.sample(logits));
    tc.push_back(c.sample(logits));
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
}

TEST(Sampler, TopPKeepsOnlyTheNucleus) {
  // Probabilities ~ {0.64, 0.24, 0.09, 0.03}: top_p 0.8 keeps the first two tokens only.
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  Sampler sampler(sampling(1.0f, 9, 0.8f));
  std::map<int, int> counts;
  for (int i = 0; i < 4000; ++i) ++counts[sampler.sample(logits)];
  EXPECT_EQ(counts.count(2), 0u);
  EXPECT_EQ(counts.count(3), 0u);
  const double share0 = counts[0] / 4000.0;
  EXPECT_NEAR(share0, 0.64 / 0.88, 0.04);  // renormalised within the nucleus
}

TEST(Sampler, TopKAndMinPCutTheTail) {
  // Probabilities ~ {0.64, 0.24, 0.09, 0.03}.
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  SamplingParams k2 = sampling(1.0f, 5);
  k2.top_k = 2;
  SamplingParams min_p = sampling(1.0f, 5);
  min_p.min_p = 0.2f;  // keeps e^-1 = 0.37 of the top one, drops e^-2 = 0.14
  for (const SamplingParams& params : {k2, min_p}) {
    Sampler sampler(params);
    std::map<int, int> counts;
    for (int i = 0; i < 4000; ++i) ++counts[sampler.sample(logits)];
    EXPECT_EQ(counts.count(2) + counts.count(3), 0u);
    EXPECT_NEAR(counts[0] / 4000.0, 0.64 / 0.88, 0.04);
  }
  SamplingParams k1 = sampling(5.0f, 5);  // hot, but one candidate
  k1.top_k = 1;
  Sampler one(k1);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(one.sample(logits), 0);
}

TEST(Sampler, LogitBiasMovesGreedyAndBansATokenWhenSampling) {
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  SamplingParams greedy = sampling(0.0f, 0);
  greedy.logit_bias = {{2, 2.5f}};
  EXPECT_EQ(Sampler(greedy).sample(logits), 2);
  SamplingParams banned = sampling(1.0f, 3);
  banned.logit_bias = {{0, -100.0f}};
  Sampler sampler(banned);
  for (int i = 0; i < 1000; ++i) EXPECT_NE(sampler.sample(logits), 0);
}

// Greedy with penalties: a generated token's logit falls, so that the next best takes over.
TEST(Sampler, PenaltiesLowerWhatWasGeneratedOrPrompted) {
  const std::vector<float> logits = {3.0f, 2.5f, 1.0f, -1.0f};
  SamplingParams frequency = sampling(0.0f, 0);
  frequency.frequency_penalty = 0.3f;  // 3.0 - 0.3n vs 2.5 - 0.3m: 0, 0, 1, 0, 1, 0, 1, ...
  Sampler f(frequency);
  std::vector<int> tokens;
  for (int i = 0; i < 5; ++i) tokens.push_back(f.sample(logits));
  EXPECT_EQ(tokens, (std::vector<int>{0, 0, 1, 0, 1}));
  SamplingParams presence = sampling(0.0f, 0);
  presence.presence_penalty = 0.6f;  // once each: 3.0 - 0.6 < 2.5, then 2.4 > 1.9
  Sampler p(presence);
  tokens.clear();
  for (int i = 0; i < 4; ++i) tokens.push_back(p.sample(logits));
  EXPECT_EQ(tokens, (std::vector<int>{0, 1, 0, 0}));
  // Repetition: 3.0 / 2 < 2.5 for a prompt token; a negative logit is multiplied.
  SamplingParams repetition = sampling(0.0f, 0);
  repetition.repetition_penalty = 2.0f;
  const int prompt[] = {0, 0, 3};
  Sampler r(repetition, prompt);
  EXPECT_EQ(r.sample(logits), 1);
  EXPECT_EQ(r.sample(logits), 0);  // 1 is generated now: 2.5 / 2 = 1.25 < 3.0 / 2
  const std::vector<float> negative = {-1.0f, -1.5f};
  const int none[] = {1};
  Sampler n(repetition, none);
  EXPECT_EQ(n.sample(negative), 0);  // -1.5 * 2 = -3
}

// A grammar's mask: tokens at -inf are never sampled, whatever the temperature and nucleus, even
// when a single token is left.
TEST(Sampler, MaskedTokensAreNeverSampled) {
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  std::vector<float> logits(1000, kNever);
  logits[17] = -5.0f;
  logits[900] = -5.0f;
  for (float temperature : {0.0f, 0.7f, 1.0f, 2.0f})
    for (float top_p : {0.5f, 1.0f}) {
      Sampler sampler(sampling(temperature, 9, top_p));
      for (int i = 0; i < 200; ++i) {
        const int token = sampler.sample(logits);
        EXPECT_TRUE(token == 17 || token == 900) << token;
      }
    }
  std::vector<float> one(1000, kNever);
  one[999] = 3.0f;
  Sampler sampler(sampling(1.0f, 3, 1.0f));
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sampler.sample(one), 999);
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler(sampling(-1.0f, 0, 1.0f)), Error);
  EXPECT_THROW(Sampler(sampling(1.0f, 0, 0.0f)), Error);
  EXPECT_THROW(Sampler(sampling(1.0f, 0, 1.5f)), Error);
  SamplingParams bad = sampling(1.0f, 0);
  bad.top_k = -1;
  EXPECT_THROW((Sampler(bad)), Error);
  bad = sampling(1.0f, 0);
  bad.min_p = 1.5f;
  EXPECT_THROW((Sampler(bad)), Error);
  bad = sampling(1.0f, 0);
  bad.repetition_penalty = 0.0f;
  EXPECT_THROW((Sampler(bad)), Error);
}

}  // namespace
}  // namespace colibri
