// DeepSeek-V3 / GLM-5 routing: fp32 sigmoid scores, e_score_correction_bias for selection only,
// group-limited top-k (noaux_tc), optional renormalisation, routed_scaling_factor.
#pragma once

#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace colibri {

struct Routing {
  int top_k = 0;
  std::vector<int> expert;    // [n, top_k], ascending per row
  std::vector<float> weight;  // [n, top_k]
};

Routing route_tokens(const ModelConfig& config, const LayerWeights& layer, const float* x, int n);

}  // namespace colibri
