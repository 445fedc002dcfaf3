#include "rank/experts.h"

#include <algorithm>

#include "common/error.h"
#include "cpu/elementwise.h"
#include "cpu/linear.h"

namespace colibri {

void mlp_forward(const MlpWeights& w, const float* x, int n, float* y) {
  const int64_t inter = w.gate.rows, hidden = w.gate.cols;
  std::vector<float> gate(size_t(n * inter)), up(size_t(n * inter));
  kernels::linear_f32(x, n, w.gate.data.data(), inter, hidden, gate.data());
  kernels::linear_f32(x, n, w.up.data.data(), inter, hidden, up.data());
  kernels::silu_mul(gate.data(), up.data(), n * inter);
  kernels::linear_f32(gate.data(), n, w.down.data.data(), hidden, inter, y);
}

void LocalExperts::begin(int layer, const float* x, int n, const Routing& routing) {
  layer_ = layer;
  x_ = x;
  n_ = n;
  routing_ = &routing;
}

void LocalExperts::finish(float* out) {
  run_routed_experts(weights_.layers[size_t(layer_)], config_.hidden_size, x_, n_, *routing_, out);
}

void run_routed_experts(const LayerWeights& lw, int hidden, const float* x, int n,
                        const Routing& routing, float* out) {
  const int k = routing.top_k;
  std::fill(out, out + size_t(n) * hidden, 0.0f);
  std::vector<float> rows, result;
  for (int e = 0; e < int(lw.experts.size()); ++e) {
    std::vector<std::pair<int, float>> picked;  // (row, weight)
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < k; ++i)
        if (routing.expert[size_t(t) * k + i] == e) picked.emplace_back(t, routing.weight[size_t(t) * k + i]);
    if (picked.empty()) continue;
    const MlpWeights& expert = lw.experts[size_t(e)];
    if (expert.empty()) fail("expert {} of this layer is routed here but not loaded", e);
    rows.resize(picked.size() * hidden);
    for (size_t i = 0; i < picked.size(); ++i)
      std::copy_n(x + size_t(picked[i].first) * hidden, hidden, &rows[i * hidden]);
    result.resize(rows.size());
    mlp_forward(expert, rows.data(), int(picked.size()), result.data());
    for (size_t i = 0; i < picked.size(); ++i) {
      float* dst = out + size_t(picked[i].first) * hidden;
      for (int j = 0; j < hidden; ++j) dst[j] += picked[i].second * result[i * hidden + j];
    }
  }
}

}  // namespace colibri
