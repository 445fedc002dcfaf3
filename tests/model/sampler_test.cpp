#include <gtest/gtest.h>

#include <map>

#include "common/error.h"
#include "model/sampler.h"

namespace colibri {
namespace {

TEST(Sampler, GreedyPicksArgmaxLowestIndexOnTies) {
  Sampler sampler({0.0f, 1.0f, 1});
  const std::vector<float> logits = {0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(sampler.sample(logits), 1);
}

TEST(Sampler, SameSeedSameTokens) {
  const std::vector<float> logits = {0.0f, 0.5f, 1.0f, 0.2f, 0.9f};
  Sampler a({1.0f, 1.0f, 42}), b({1.0f, 1.0f, 42}), c({1.0f, 1.0f, 43});
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
  Sampler sampler({1.0f, 0.8f, 9});
  std::map<int, int> counts;
  for (int i = 0; i < 4000; ++i) ++counts[sampler.sample(logits)];
  EXPECT_EQ(counts.count(2), 0u);
  EXPECT_EQ(counts.count(3), 0u);
  const double share0 = counts[0] / 4000.0;
  EXPECT_NEAR(share0, 0.64 / 0.88, 0.04);  // renormalised within the nucleus
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(Sampler({-1.0f, 1.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, 0.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, 1.5f, 0}), Error);
}

}  // namespace
}  // namespace colibri
