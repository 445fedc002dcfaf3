// The server's step-cost model and its choice of prompt rows (--max-itl-ms), on synthetic timings
// given to it: what it fits, what it ignores, and the rows it picks at every edge.
#include <gtest/gtest.h>

#include <vector>

#include "coordinator/step_cost.h"

namespace colibri {
namespace {

// A machine whose calls cost exactly `truth`.
const StepCostFit kTruth{2e-3, 1e-4, 5e-5};

StepShape shape(int decode, int prompt, double attended) {
  StepShape s;
  s.decode_rows = decode;
  s.prompt_rows = prompt;
  s.attended = attended;
  return s;
}

// Decode-only calls of 1 to 8 sequences and prompt chunks of 16 to 512 rows at several depths,
// timed by `truth`.
StepCostModel trained(const StepCostFit& truth = kTruth) {
  StepCostModel m;
  for (int round = 0; round < 4; ++round) {
    for (int d = 1; d <= 8; ++d) {
      const StepShape s = shape(d, 0, d * (100.0 + 300 * round));
      m.observe(s, truth.predict(s));
    }
    for (int p : {16, 64, 256, 512}) {
      const StepShape s = shape(round, p, attended_keys(1000 * round, p));
      m.observe(s, truth.predict(s));
    }
  }
  return m;
}

TEST(StepCost, AttendedKeysSumPositionsPlusOne) {
  EXPECT_EQ(attended_keys(0, 1), 1);
  EXPECT_EQ(attended_keys(0, 4), 1 + 2 + 3 + 4);
  EXPECT_EQ(attended_keys(10, 3), 11 + 12 + 13);
  EXPECT_EQ(attended_keys(7, 0), 0);
}

TEST(StepCost, AnEmptyModelPredictsNothing) {
  const StepCostModel m;
  EXPECT_EQ(m.observations(), 0);
  EXPECT_EQ(m.largest_rows(), 0);
  EXPECT_EQ(m.predict(shape(4, 100, 1e5)), 0);
}

TEST(StepCost, ExactTimingsGiveTheirCoefficients) {
  const StepCostModel m = trained();
  EXPECT_NEAR(m.fit().fixed_s, kTruth.fixed_s, 1e-6);
  EXPECT_NEAR(m.fit().row_s, kTruth.row_s, 1e-8);
  EXPECT_NEAR(m.fit().kilo_key_s, kTruth.kilo_key_s, 1e-8);
  EXPECT_LT(m.mean_abs_error_s(), 1e-6);
  const StepShape unseen = shape(3, 300, attended_keys(2500, 300));
  EXPECT_NEAR(m.predict(unseen), kTruth.predict(unseen), 1e-5);
}

// One call in eight stretched tenfold (a descheduled thread): the fit stays within 2 %.
TEST(StepCost, StretchedCallsCountLittle) {
  StepCostModel m;
  int k = 0;
  for (int round = 0; round < 4; ++round)
    for (int rows : {1, 2, 3, 5, 8, 16, 40, 100, 256, 512}) {
      const StepShape s = shape(1, rows - 1, attended_keys(200 * round, rows));
      m.observe(s, kTruth.predict(s) * (++k % 8 == 0 ? 10 : 1));
    }
  for (const StepShape& s : {shape(1, 0, 500), shape(2, 254, attended_keys(700, 256))})
    EXPECT_NEAR(m.predict(s), kTruth.predict(s), 0.02 * kTruth.predict(s));
}

// Times that fall with the rows would make a least-squares slope negative: it is held at 0.
TEST(StepCost, CoefficientsStayNonNegative) {
  StepCostModel m;
  for (int round = 0; round < 3; ++round)
    for (int rows : {1, 4, 16, 64}) m.observe(shape(rows, 0, rows), 0.01 - 1e-4 * rows);
  EXPECT_GE(m.fit().fixed_s, 0);
  EXPECT_GE(m.fit().row_s, 0);
  EXPECT_GE(m.fit().kilo_key_s, 0);
  EXPECT_GT(m.predict(shape(1, 0, 1)), 0);
  EXPECT_LE(m.predict(shape(1, 0, 1)), m.predict(shape(1, 100, 1e4)));
}

// Thousands of decode-only calls keep the large calls' octaves: the fit still knows them.
TEST(StepCost, DecodeCallsDoNotPushOutTheLargeOnes) {
  StepCostModel m = trained();
  for (int i = 0; i < 5000; ++i) {
    const StepShape s = shape(1 + i % 2, 0, 2000);
    m.observe(s, kTruth.predict(s));
  }
  EXPECT_EQ(m.largest_rows(), 512 + 3);
  EXPECT_LE(m.observations(), StepCostModel::kOctaves * StepCostModel::kPerOctave);
  const StepShape chunk = shape(2, 256, attended_keys(3000, 256));
  EXPECT_NEAR(m.predict(chunk), kTruth.predict(chunk), 1e-5);
}

// The machine slows down twofold: once every octave has seen kPerOctave new calls, the fit is
// the new machine's.
TEST(StepCost, FollowsTheMachinesSpeed) {
  StepCostModel m = trained();
  const StepCostFit slower{2 * kTruth.fixed_s, 2 * kTruth.row_s, 2 * kTruth.kilo_key_s};
  for (int i = 0; i < StepCostModel::kPerOctave; ++i) {
    for (int rows : {1, 2, 4, 8, 16, 32, 64, 128, 256, 512}) {
      const StepShape s = shape(1, rows, attended_keys(100 * i, rows));
      m.observe(s, slower.predict(s));
    }
  }
  const StepShape s = shape(4, 100, attended_keys(500, 100));
  EXPECT_NEAR(m.predict(s), slower.predict(s), 1e-5);
}

// ---- the choice of prompt rows ---------------------------------------------------------------

TEST(ChunkChoice, WithoutDecodeRowsAPromptTakesTheWholeBudget) {
  const StepCostModel m = trained();
  const std::vector<PromptWork> prompts = {{0, 2000}};
  const ChunkChoice c = choose_prompt_rows(m, StepShape{}, prompts, 256, 1e-6, 16);
  EXPECT_EQ(c.prompt_rows, 256);
  EXPECT_FALSE(c.cut);
  EXPECT_NEAR(c.predicted_s, kTruth.predict(shape(0, 256, attended_keys(0, 256))), 1e-5);
}

TEST(ChunkChoice, WithoutABoundAPromptTakesTheWholeBudget) {
  const StepCostModel m = trained();
  const std::vector<PromptWork> prompts = {{0, 2000}};
  const ChunkChoice c = choose_prompt_rows(m, shape(4, 0, 4000), prompts, 252, 0, 16);
  EXPECT_EQ(c.prompt_rows, 252);
  EXPECT_FALSE(c.cut);
}

// The most rows whose predicted call fits the bound: one more would not.
TEST(ChunkChoice, TheBoundCutsThePromptRows) {
  const StepCostModel m = trained();
  const StepShape decode = shape(4, 0, 4 * 800);
  const std::vector<PromptWork> prompts = {{0, 2000}};
  const double bound = 0.015;
  const ChunkChoice c = choose_prompt_rows(m, decode, prompts, 252, bound, 16);
  ASSERT_TRUE(c.cut);
  ASSERT_GT(c.prompt_rows, 16);
  ASSERT_LT(c.prompt_rows, 252);
  const auto call = [&](int rows) {
    StepShape s = decode;
    s.prompt_rows = rows;
    s.attended += attended_keys(0, rows);
    return kTruth.predict(s);
  };
  EXPECT_LE(call(c.prompt_rows), bound + 1e-6);
  EXPECT_GT(call(c.prompt_rows + 1), bound - 1e-6);
  EXPECT_NEAR(c.predicted_s, call(c.prompt_rows), 1e-5);
}

// A bound below a decode-only call: the prompt still gets min_rows a call.
TEST(ChunkChoice, ABoundBelowADecodeCallLeavesTheLeastRows) {
  const StepCostModel m = trained();
  const StepShape decode = shape(8, 0, 8 * 500);
  ASSERT_GT(m.predict(decode), 1e-3);
  const std::vector<PromptWork> prompts = {{0, 2000}};
  const ChunkChoice c = choose_prompt_rows(m, decode, prompts, 248, 1e-3, 16);
  EXPECT_EQ(c.prompt_rows, 16);
  EXPECT_TRUE(c.cut);
  // A prompt with fewer tokens left than min_rows takes what it has.
  const std::vector<PromptWork> short_prompt = {{40, 5}};
  EXPECT_EQ(choose_prompt_rows(m, decode, short_prompt, 248, 1e-3, 16).prompt_rows, 5);
}

// One huge prompt: never beyond the budget; deep in it the attended keys leave fewer rows.
TEST(ChunkChoice, AHugePromptGetsFewerRowsDeepInIt) {
  const StepCostModel m = trained();
  const StepShape decode = shape(1, 0, 100);
  const std::vector<PromptWork> start = {{0, 100000}}, deep = {{10000, 90000}};
  const ChunkChoice loose = choose_prompt_rows(m, decode, start, 255, 1.0, 16);
  EXPECT_EQ(loose.prompt_rows, 255);
  EXPECT_FALSE(loose.cut);
  const ChunkChoice near = choose_prompt_rows(m, decode, start, 255, 0.02, 16);
  const ChunkChoice far = choose_prompt_rows(m, decode, deep, 255, 0.02, 16);
  EXPECT_TRUE(near.cut);
  EXPECT_LT(far.prompt_rows, near.prompt_rows);
  EXPECT_GE(far.prompt_rows, 16);
  EXPECT_LE(far.predicted_s, 0.02 + 1e-6);
}

// Several prompts take rows in order, each at its own depth; no rows are invented.
TEST(ChunkChoice, SeveralPromptsShareTheRowsInOrder) {
  const StepCostModel m = trained();
  const StepShape decode = shape(2, 0, 2 * 300);
  const std::vector<PromptWork> prompts = {{500, 10}, {0, 30}, {0, 5000}};
  const ChunkChoice c = choose_prompt_rows(m, decode, prompts, 254, 0.012, 4);
  ASSERT_GT(c.prompt_rows, 40) << "the bound leaves room past the first two prompts";
  ASSERT_TRUE(c.cut);
  const StepShape expected = shape(2, c.prompt_rows,
                                   2 * 300 + attended_keys(500, 10) + attended_keys(0, 30) +
                                       attended_keys(0, c.prompt_rows - 40));
  EXPECT_NEAR(c.predicted_s, m.predict(expected), 1e-9);
  // Fewer tokens waiting than the budget: all of them, none more.
  const std::vector<PromptWork> few = {{0, 3}, {9, 4}};
  EXPECT_EQ(choose_prompt_rows(m, decode, few, 254, 1.0, 4).prompt_rows, 7);
  EXPECT_EQ(choose_prompt_rows(m, decode, {}, 254, 1.0, 4).prompt_rows, 0);
}

// A model that has timed only small calls does not trust its fit far beyond them: twice its
// largest call at most, and it learns larger ones as it goes.
TEST(ChunkChoice, AModelThatTimedOnlySmallCallsDoublesItsWayUp) {
  StepCostModel m;
  for (int d = 1; d <= 4; ++d) {
    const StepShape s = shape(d, 0, d * 100.0);
    m.observe(s, kTruth.predict(s));
  }
  const StepShape decode = shape(4, 0, 400);
  const std::vector<PromptWork> prompts = {{0, 2000}};
  EXPECT_EQ(choose_prompt_rows(m, decode, prompts, 252, 1.0, 2).prompt_rows, 4);
  const StepShape bigger = shape(4, 12, 400 + attended_keys(0, 12));
  m.observe(bigger, kTruth.predict(bigger));
  EXPECT_EQ(choose_prompt_rows(m, decode, prompts, 252, 1.0, 2).prompt_rows, 2 * 16 - 4);
}

TEST(ChunkChoice, MinPromptRowsIsASixteenthOfTheBatch) {
  EXPECT_EQ(min_prompt_rows(256), 16);
  EXPECT_EQ(min_prompt_rows(64), 4);
  EXPECT_EQ(min_prompt_rows(17), 1);
  EXPECT_EQ(min_prompt_rows(1), 1);
}

}  // namespace
}  // namespace colibri
