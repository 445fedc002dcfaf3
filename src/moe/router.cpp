#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "cpu/linear.h"

namespace colibri {

std::vector<RoutedPair> routed_pairs(const Routing& routing, int n) {
  std::vector<RoutedPair> pairs;
  pairs.reserve(size_t(n) * routing.top_k);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < routing.top_k; ++i)
      pairs.push_back({uint32_t(t), uint32_t(routing.expert[size_t(t) * routing.top_k + i]),
                       routing.weight[size_t(t) * routing.top_k + i]});
  return pairs;
}

Routing route_tokens(const ModelConfig& c, const LayerWeights& layer, const float* x, int n) {
  const int experts = c.n_routed_experts, k = c.num_experts_per_tok;
  const int groups = c.n_group, per_group = experts / groups;
  std::vector<float> logits(size_t(n) * experts);
  kernels::linear_f32(x, n, layer.router.data.data(), experts, c.hidden_size, logits.data());

  Routing routing;
  routing.top_k = k;
  routing.expert.resize(size_t(n) * k);
  routing.weight.resize(size_t(n) * k);
  std::vector<float> score(experts), choice(experts), group_score(groups);
  std::vector<int> order(std::max(experts, groups));
  for (int t = 0; t < n; ++t) {
    for (int e = 0; e < experts; ++e) {
      score[size_t(e)] = 1.0f / (1.0f + std::exp(-logits[size_t(t) * experts + e]));
      choice[size_t(e)] = score[size_t(e)] + layer.router_bias[size_t(e)];
    }
    const auto by_choice_desc = [&](const std::vector<float>& v) {
      return [&v](int a, int b) {
        return v[size_t(a)] > v[size_t(b)] || (v[size_t(a)] == v[size_t(b)] && a < b);
      };
    };
    if (groups > 1) {
      // Group score = sum of the two best biased scores in the group; keep topk_group groups.
      for (int g = 0; g < groups; ++g) {
        const float* begin = &choice[size_t(g) * per_group];
        float best = -std::numeric_limits<float>::infinity(), second = best;
        for (int i = 0; i < per_group; ++i) {
          if (begin[i] > best) {
            second = best;
            best = begin[i];
          } else if (begin[i] > second) {
            second = begin[i];
          }
        }
        group_score[size_t(g)] = best + second;
      }
      std::iota(order.begin(), order.begin() + groups, 0);
      std::partial_sort(order.begin(), order.begin() + c.topk_group, order.begin() + groups,
                        by_choice_desc(group_score));
      std::vector<bool> kept(size_t(groups), false);
      for (int i = 0; i < c.topk_group; ++i) kept[size_t(order[size_t(i)])] = true;
      for (int e = 0; e < experts; ++e)
        if (!kept[size_t(e / per_group)])
          choice[size_t(e)] = -std::numeric_limits<float>::infinity();
    }
    std::iota(order.begin(), order.begin() + experts, 0);
    std::partial_sort(order.begin(), order.begin() + k, order.begin() + experts,
                      by_choice_desc(choice));
    std::sort(order.begin(), order.begin() + k);
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) sum += score[size_t(order[size_t(i)])];
    const float denominator = c.norm_topk_prob ? sum + 1e-20f : 1.0f;
    for (int i = 0; i < k; ++i) {
      const int e = order[size_t(i)];
      routing.expert[size_t(t) * k + i] = e;
      routing.weight[size_t(t) * k + i] = score[size_t(e)] / denominator * c.routed_scaling_factor;
    }
  }
  return routing;
}

}  // namespace colibri
