#include <gtest/gtest.h>

#include <cmath>

#include "moe/router.h"

namespace colibri {
namespace {

// Router with logit(e) = router row e · x where x = [1]: logits are the router weights.
struct RouterSetup {
  ModelConfig config;
  LayerWeights layer;
  RouterSetup(std::vector<float> logits, std::vector<float> bias, int groups, int topk_group,
              int k) {
    config.hidden_size = 1;
    config.n_routed_experts = int(logits.size());
    config.num_experts_per_tok = k;
    config.n_group = groups;
    config.topk_group = topk_group;
    config.norm_topk_prob = true;
    config.routed_scaling_factor = 2.5f;
    layer.router = Matrix{int64_t(logits.size()), 1, std::move(logits), {}, {}, {}, 0, {}, {}};
    layer.router_bias = std::move(bias);
  }
};

float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

TEST(Router, BiasSelectsButDoesNotWeigh) {
  // Expert 3 has the lowest score but a large bias: it is selected with its unbiased weight.
  RouterSetup s({2.0f, 1.0f, 0.5f, -3.0f}, {0.0f, 0.0f, 0.0f, 5.0f}, 1, 1, 2);
  const float x = 1.0f;
  const Routing r = route_tokens(s.config, s.layer, &x, 1);
  ASSERT_EQ(r.expert, (std::vector<int>{0, 3}));
  const float s0 = sigmoid(2.0f), s3 = sigmoid(-3.0f);
  EXPECT_NEAR(r.weight[0], s0 / (s0 + s3) * 2.5f, 1e-6f);
  EXPECT_NEAR(r.weight[1], s3 / (s0 + s3) * 2.5f, 1e-6f);
}

TEST(Router, GroupLimitedSelectionUsesTopTwoSums) {
  // 4 groups of 2. Group scores (sum of both): g0 = high single expert + low partner, g1 = two
  // moderately high experts. Keep 2 groups; the best single expert's group must lose to g1 and g2.
  RouterSetup s({4.0f, -4.0f, 1.0f, 1.0f, 0.8f, 0.8f, -2.0f, -2.0f}, std::vector<float>(8, 0.0f), 4,
                2, 3);
  const float x = 1.0f;
  const Routing r = route_tokens(s.config, s.layer, &x, 1);
  // Without groups the top 3 would include expert 0; with them only experts 2..5 are eligible.
  EXPECT_EQ(r.expert, (std::vector<int>{2, 3, 4}));
}

}  // namespace
}  // namespace colibri
