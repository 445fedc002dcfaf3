#include <gtest/gtest.h>

#include <cmath>

#include "model/config.h"
#include "model/rope.h"

namespace colibri {
namespace {

// Vectors from the fp64 derivation of transformers' _compute_yarn_parameters.
TEST(Rope, YarnInverseFrequenciesOfDeepseekV3) {
  RopeConfig rope;
  rope.theta = 10000;
  rope.yarn = true;
  rope.factor = 40;
  rope.original_max_position_embeddings = 4096;
  rope.beta_fast = 32;
  rope.beta_slow = 1;
  rope.mscale = 1;
  rope.mscale_all_dim = 1;
  const Rope r(rope, 64);
  EXPECT_NEAR(r.inv_freq()[0], 1.0, 1e-6);
  EXPECT_NEAR(r.inv_freq()[10] / 5.623413e-2, 1.0, 1e-5);
  EXPECT_NEAR(r.inv_freq()[23] / 3.333804e-5, 1.0, 1e-5);
  EXPECT_NEAR(r.inv_freq()[31] / 3.333804e-6, 1.0, 1e-5);
  EXPECT_FLOAT_EQ(r.attention_factor(), 1.0f);
}

TEST(Rope, YarnInverseFrequenciesOfKimiK2) {
  RopeConfig rope;
  rope.theta = 50000;
  rope.yarn = true;
  rope.factor = 32;
  rope.original_max_position_embeddings = 4096;
  rope.beta_fast = 1;
  rope.beta_slow = 1;
  rope.mscale = 1;
  rope.mscale_all_dim = 1;
  const Rope r(rope, 64);
  EXPECT_NEAR(r.inv_freq()[10] / 3.400728e-2, 1.0, 1e-5);
  EXPECT_NEAR(r.inv_freq()[23] / 1.310585e-5, 1.0, 1e-5);
  EXPECT_NEAR(r.inv_freq()[31] / 8.764413e-7, 1.0, 1e-5);
}

TEST(Rope, SoftmaxScaleIncludesYarnMscale) {
  ModelConfig c;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.rope.yarn = true;
  c.rope.factor = 40;
  c.rope.mscale_all_dim = 1;
  EXPECT_NEAR(c.softmax_scale(), 0.135233779, 1e-7);
  c.rope.factor = 32;
  EXPECT_NEAR(c.softmax_scale(), 0.130860800, 1e-7);
  c.rope.yarn = false;
  c.qk_nope_head_dim = 192;
  EXPECT_FLOAT_EQ(c.softmax_scale(), 0.0625f);
}

TEST(Rope, InterleavedAndHalfSplitPairDifferentDimensions) {
  RopeConfig rope;
  const Rope r(rope, 4);
  float interleaved[] = {1, 0, 0, 0};
  float half_split[] = {1, 0, 0, 0};
  r.apply(interleaved, 1, true);
  r.apply(half_split, 1, false);
  // Angle of pair 0 at position 1 is inv_freq[0] = 1 rad.
  EXPECT_NEAR(interleaved[0], std::cos(1.0), 1e-6);
  EXPECT_NEAR(interleaved[1], std::sin(1.0), 1e-6);  // partner of x0 is x1
  EXPECT_NEAR(half_split[0], std::cos(1.0), 1e-6);
  EXPECT_NEAR(half_split[2], std::sin(1.0), 1e-6);  // partner of x0 is x2
  EXPECT_EQ(half_split[1], 0.0f);
}

TEST(Rope, RotationPreservesNormAndRelativePosition) {
  RopeConfig rope;
  rope.theta = 100;
  const Rope r(rope, 8);
  float q[8] = {0.3f, -1.2f, 0.5f, 2.0f, -0.7f, 0.1f, 1.1f, -0.4f};
  float k[8] = {1.0f, 0.2f, -0.3f, 0.8f, 0.6f, -1.5f, 0.2f, 0.9f};
  auto dot_at = [&](int pq, int pk) {
    float a[8], b[8];
    std::copy(q, q + 8, a);
    std::copy(k, k + 8, b);
    r.apply(a, pq, true);
    r.apply(b, pk, true);
    float s = 0;
    for (int i = 0; i < 8; ++i) s += a[i] * b[i];
    return s;
  };
  EXPECT_NEAR(dot_at(7, 3), dot_at(104, 100), 1e-4);  // depends on pq - pk only
}

}  // namespace
}  // namespace colibri
