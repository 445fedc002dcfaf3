// DeepSeek-V3 / GLM-5 routing: fp32 sigmoid scores, e_score_correction_bias for selection only,
// group-limited top-k (noaux_tc), optional renormalisation, routed_scaling_factor.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace colibri {

struct Routing {
  int top_k = 0;
  std::vector<int> expert;    // [n, top_k], ascending per row
  std::vector<float> weight;  // [n, top_k]
};

// One (row, expert, weight) of a routing; also the wire format of the exchange.
struct RoutedPair {
  uint32_t row;
  uint32_t expert;
  float weight;
};

std::vector<RoutedPair> routed_pairs(const Routing& routing, int n);

Routing route_tokens(const ModelConfig& config, const LayerWeights& layer, const float* x, int n);

}  // namespace colibri
