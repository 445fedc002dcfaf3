#include "rank/experts.h"

#include <algorithm>

#include "common/error.h"
#include "cpu/elementwise.h"
#include "cpu/linear.h"
#include "cpu/quant.h"

namespace colibri {

void mlp_forward(const MlpWeights& w, const float* x, int n, float* y) {
  if (w.quantized()) {
    kernels::quant_expert_ffn(w.quant.gate.view(), w.quant.up.view(), w.quant.down.view(), x, n, y);
    return;
  }
  const int64_t inter = w.gate.rows;
  std::vector<float> gate(size_t(n * inter)), up(size_t(n * inter));
  linear(w.gate, x, n, gate.data());
  linear(w.up, x, n, up.data());
  kernels::silu_mul(gate.data(), up.data(), n * inter);
  linear(w.down, gate.data(), n, y);
}

void LocalExperts::begin(int layer, const float* x, int n, const Routing& routing) {
  layer_ = layer;
  x_ = x;
  n_ = n;
  routing_ = &routing;
}

void LocalExperts::finish(float* out) {
  run_expert_pairs(weights_.layers[size_t(layer_)], config_.hidden_size, x_, n_,
                   routed_pairs(*routing_, n_), out);
}

void run_expert_pairs(const LayerWeights& lw, int hidden, const float* x, int n,
                      std::span<const RoutedPair> pairs, float* out) {
  const ExpertLookup lookup = [&lw](uint32_t e) -> const MlpWeights& {
    if (e >= lw.experts.size() || lw.experts[e].empty())
      fail("expert {} of this layer is routed here but not loaded", e);
    return lw.experts[e];
  };
  run_expert_pairs(lookup, hidden, x, n, pairs, out);
}

void run_expert_pairs(const ExpertLookup& expert_weights, int hidden, const float* x, int n,
                      std::span<const RoutedPair> pairs, float* out) {
  std::fill(out, out + size_t(n) * hidden, 0.0f);
  std::vector<const RoutedPair*> order(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) order[i] = &pairs[i];
  std::stable_sort(order.begin(), order.end(),
                   [](const RoutedPair* a, const RoutedPair* b) { return a->expert < b->expert; });
  std::vector<float> rows, result;
  for (size_t begin = 0; begin < order.size();) {
    const uint32_t e = order[begin]->expert;
    size_t end = begin;
    while (end < order.size() && order[end]->expert == e) ++end;
    const MlpWeights& weights = expert_weights(e);
    const size_t count = end - begin;
    rows.resize(count * size_t(hidden));
    for (size_t i = 0; i < count; ++i)
      std::copy_n(x + size_t(order[begin + i]->row) * hidden, hidden, &rows[i * size_t(hidden)]);
    result.resize(rows.size());
    mlp_forward(weights, rows.data(), int(count), result.data());
    for (size_t i = 0; i < count; ++i) {
      float* dst = out + size_t(order[begin + i]->row) * hidden;
      const float w = order[begin + i]->weight;
      for (int j = 0; j < hidden; ++j) dst[j] += w * result[i * size_t(hidden) + j];
    }
    begin = end;
  }
}

}  // namespace colibri
