// MLA attention with the DSA lightning indexer on the CPU, over KvManager blocks. Every row, in
// prefill and decode alike, uses the absorbed form on the compressed cache (the query moved into
// latent space), so no key or value is ever expanded per head. Scratch memory grows to the
// largest call seen and is reused: a decode step allocates nothing.
#pragma once

#include <vector>

#include "common/profile.h"
#include "coordinator/attention_backend.h"
#include "coordinator/kv_manager.h"
#include "coordinator/rope.h"
#include "model/config.h"

namespace colibri {

class CpuAttention final : public AttentionBackend {
 public:
  CpuAttention(const ModelConfig& config, KvManager& kv, Profiler* profiler = nullptr);

  void begin(const Batch& batch) override;
  void forward(int layer, const AttentionWeights& w, const float* x, float* out) override;

 private:
  void project(int layer, const AttentionWeights& w, const float* x);
  void select_keys(int layer, const IndexerWeights& w, const float* x);
  void attend(int layer, const AttentionWeights& w);
  // Positions row t attends to: the indexer's choice or 0..pos.
  int keys_of(int t, const int** selected) const;

  const ModelConfig& c_;
  KvManager& kv_;
  Rope rope_;
  Profiler* profiler_;
  const Batch* batch_ = nullptr;
  int max_keys_ = 0;  // most positions any row of the batch sees

  // [n, ...] per call, grown only.
  std::vector<int> slot_;                 // [n] pool slot of each row
  std::vector<float> q_, q_lora_, kv_a_;  // [n, H, dq], [n, q_lora_rank], [n, r + dr]
  std::vector<float> heads_out_;          // [n, H, dv]
  std::vector<float> index_q_, index_k_, index_w_;
  std::vector<int> selected_;          // [n, index_topk] chosen positions, ascending
  std::vector<int> selected_count_;    // [n]; 0 = every visible position
  std::vector<float> scratch_;         // per thread: scores/probabilities, q_abs, o_latent
  std::vector<int> order_;             // per thread: [max_keys] indexer sort order
  std::vector<int32_t> key_slots_;     // per thread: [max_keys] a row's keys' cache slots
  std::vector<float> index_q_t_;       // [n, index dim, padded heads] queries transposed
  std::vector<float> index_w_padded_;  // [n, padded heads] head weights
};

}  // namespace colibri
