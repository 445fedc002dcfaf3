// Rotary position embedding for the rope slice of MLA and indexer heads, with YaRN.
#pragma once

#include <vector>

#include "model/config.h"

namespace colibri {

class Rope {
 public:
  Rope(const RopeConfig& config, int dim);

  // Rotates x[0, dim) for position `pos`. interleave: pairs (x[2i], x[2i+1]) (GPT-J, DeepSeek and
  // GLM-5 checkpoints); otherwise pairs (x[i], x[i + dim/2]) (NeoX).
  void apply(float* x, int pos, bool interleave) const;

  const std::vector<float>& inv_freq() const { return inv_freq_; }
  float attention_factor() const { return attention_factor_; }

 private:
  int dim_;
  std::vector<float> inv_freq_;    // [dim / 2], float32 as transformers computes it
  float attention_factor_ = 1.0f;  // multiplies cos and sin
};

}  // namespace colibri
