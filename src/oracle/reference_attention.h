// Multi-head latent attention (DeepSeek-V3 / GLM-5 MLA) with the DSA lightning indexer.
#pragma once

#include <vector>

#include "common/profile.h"
#include "model/config.h"
#include "model/rope.h"
#include "model/weights.h"
#include "oracle/reference_kv_cache.h"

namespace colibri {

// Keys each query row may attend to, chosen by the DSA indexer. An empty row list means all
// causally visible keys (the context does not exceed index_topk yet).
struct KeySelection {
  std::vector<std::vector<int>> keys;  // [n_rows][<= index_topk], ascending
};

class MlaAttention {
 public:
  MlaAttention(const ModelConfig& config, const Rope& rope);

  // x: [n, hidden], input_layernorm output of n new tokens at positions start.. start+n-1 where
  // start = number of tokens already in `cache`. Appends their latents to the cache and writes
  // out [n, hidden]. Prefill (n > 1) expands keys and values per head as transformers does;
  // decode (n == 1) uses the absorbed form directly on the compressed cache.
  // `selection` is read on shared-indexer layers and written on full ones.
  void forward(int layer, const AttentionWeights& w, const float* x, int n, int start,
               LayerKvCache& cache, KeySelection& selection, float* out) const;

  // Optional: attention and indexer times are recorded as separate phases.
  void set_profiler(Profiler* profiler) { profiler_ = profiler; }

  // Both forms are public so tests can compare them on the same inputs.
  void attend_expanded(const AttentionWeights& w, const float* q, int n, int start,
                       const LayerKvCache& cache, const KeySelection& selection,
                       float* heads_out) const;
  void attend_absorbed(const AttentionWeights& w, const float* q, int n, int start,
                       const LayerKvCache& cache, const KeySelection& selection,
                       float* heads_out) const;

 private:
  void select_keys(const IndexerWeights& w, const float* x, const float* q_lora, int n, int start,
                   LayerKvCache& cache, KeySelection& selection) const;
  // Key positions row t (at position start + t) may attend to.
  std::vector<int> visible_keys(const KeySelection& selection, int t, int pos) const;

  const ModelConfig& c_;
  const Rope& rope_;
  Profiler* profiler_ = nullptr;
};

}  // namespace colibri
