// MLA's compressed KV cache: per token and layer only the normalised latent (kv_lora_rank) and
// the rotated shared rope key (qk_rope_head_dim), plus the DSA indexer key on full indexer layers.
#pragma once

#include <vector>

#include "model/config.h"

namespace colibri {

struct LayerKvCache {
  std::vector<float> latent;   // [tokens, kv_lora_rank]
  std::vector<float> k_rope;   // [tokens, qk_rope_head_dim], RoPE applied
  std::vector<float> index_k;  // [tokens, index_head_dim], full indexer layers only
};

class KvCache {
 public:
  explicit KvCache(const ModelConfig& config) : layers_(size_t(config.num_layers)) {}

  int length() const { return length_; }
  // Called once per forward, after every layer appended its rows.
  void advance(int tokens) { length_ += tokens; }
  LayerKvCache& layer(int l) { return layers_[size_t(l)]; }
  void clear() {
    for (auto& l : layers_) l = LayerKvCache{};
    length_ = 0;
  }

 private:
  std::vector<LayerKvCache> layers_;
  int length_ = 0;
};

}  // namespace colibri
