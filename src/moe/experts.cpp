#include "moe/experts.h"

#include <omp.h>

#include <algorithm>
#include <exception>

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

namespace {

// An expert's rows: pairs order[begin, end) (ascending expert), gathered into `rows`, run into
// `result`.
struct ExpertGroup {
  size_t begin, end;
  std::vector<float> rows, result;
};

// Each expert on one thread when every expert has few rows and each thread gets two or more:
// decode then reads each expert as one stream with no barrier inside the layer, instead of
// splitting every matrix across the threads with three barriers per expert.
constexpr size_t kFewRows = 4;

bool one_thread_per_expert(std::span<const ExpertGroup> groups) {
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads < 2 || groups.size() < 2 * size_t(threads)) return false;
  return std::all_of(groups.begin(), groups.end(),
                     [](const ExpertGroup& g) { return g.end - g.begin <= kFewRows; });
}

}  // namespace

void run_expert_pairs(const ExpertLookup& expert_weights, int hidden, const float* x, int n,
                      std::span<const RoutedPair> pairs, float* out) {
  std::fill(out, out + size_t(n) * hidden, 0.0f);
  std::vector<const RoutedPair*> order(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) order[i] = &pairs[i];
  std::stable_sort(order.begin(), order.end(),
                   [](const RoutedPair* a, const RoutedPair* b) { return a->expert < b->expert; });
  // Kept between calls (decode runs this every layer): the buffers keep their capacity.
  thread_local std::vector<ExpertGroup> group_buffers;
  size_t n_groups = 0;
  for (size_t begin = 0; begin < order.size(); ++n_groups) {
    size_t end = begin;
    while (end < order.size() && order[end]->expert == order[begin]->expert) ++end;
    if (n_groups == group_buffers.size()) group_buffers.emplace_back();
    group_buffers[n_groups].begin = begin;
    group_buffers[n_groups].end = end;
    begin = end;
  }
  const std::span<ExpertGroup> groups(group_buffers.data(), n_groups);
  const auto run = [&](ExpertGroup& g, const MlpWeights& weights) {
    const size_t count = g.end - g.begin;
    g.rows.resize(count * size_t(hidden));
    for (size_t i = 0; i < count; ++i)
      std::copy_n(x + size_t(order[g.begin + i]->row) * hidden, hidden,
                  &g.rows[i * size_t(hidden)]);
    g.result.resize(g.rows.size());
    mlp_forward(weights, g.rows.data(), int(count), g.result.data());
  };
  // Summed in ascending expert order either way, so the result does not depend on the split.
  const auto add = [&](ExpertGroup& g) {
    for (size_t i = 0; i < g.end - g.begin; ++i) {
      float* dst = out + size_t(order[g.begin + i]->row) * hidden;
      const float w = order[g.begin + i]->weight;
      for (int j = 0; j < hidden; ++j) dst[j] += w * g.result[i * size_t(hidden) + j];
    }
  };
  if (!one_thread_per_expert(groups)) {
    for (ExpertGroup& g : groups) {
      run(g, expert_weights(order[g.begin]->expert));
      add(g);
    }
    return;
  }
  // The lookups stay one at a time and in ascending order (an expert store reads misses then);
  // the first error stops the rest and is rethrown here.
  std::exception_ptr error;
  size_t next = 0;
#pragma omp parallel
  {
    omp_set_num_threads(1);  // the expert's kernels: this thread only, whatever OMP_NESTED says
    while (true) {
      ExpertGroup* g = nullptr;
      const MlpWeights* weights = nullptr;
#pragma omp critical(colibri_expert_lookup)
      if (!error && next < groups.size()) {
        g = &groups[next++];
        try {
          weights = &expert_weights(order[g->begin]->expert);
        } catch (...) {
          error = std::current_exception();
        }
      }
      if (weights == nullptr) break;
      try {
        run(*g, *weights);
      } catch (...) {
#pragma omp critical(colibri_expert_lookup)
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
  for (ExpertGroup& g : groups) add(g);
}

}  // namespace colibri
