// MLA attention with the DSA lightning indexer on the CPU, over KvManager blocks. Every row, in
// prefill and decode alike, uses the absorbed form on the compressed cache (the query moved into
// latent space), so no key or value is ever expanded per head. Scratch memory grows to the
// largest call seen and is reused: a decode step allocates nothing.
#pragma once

#include <cstdint>
#include <vector>

#include "common/profile.h"
#include "coordinator/attention_backend.h"
#include "coordinator/kv_manager.h"
#include "model/config.h"
#include "model/rope.h"
#include "model/weights.h"

namespace colibri {

// The cache slots each row of a call attends to.
class KeySlots {
 public:
  virtual ~KeySlots() = default;
  // Writes row t's key slots, in position order, and returns how many.
  virtual int fill(int t, int32_t* slots) const = 0;
};

// The absorbed MLA attention of some heads over the compressed cache: each head's query moved
// into latent space by its rows of W_UK, attended over the cached latent and rope keys, its value
// moved out by its rows of W_UV. CpuAttention runs it for its heads, and a rank attending for
// others (tensor_parallel/split_linear.h) for theirs. Scratch grows to the largest call.
class MlaHeads {
 public:
  struct Call {
    int n = 0;                      // rows
    int heads = 0;                  // heads here: kv_b holds their rows, in head order
    const float* q = nullptr;       // head h of row t at (t * q_stride + h) * qk_head_dim
    int q_stride = 0;               // heads a row of q holds
    const Matrix* kv_b = nullptr;   // [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    const float* latent = nullptr;  // the cache by slot: [slots, kv_lora_rank]
    const float* k_rope = nullptr;  // [slots, qk_rope_head_dim]
    const KeySlots* keys = nullptr;
    int max_keys = 0;      // most keys of any row
    float* out = nullptr;  // head h of row t at (t * out_stride + h) * v_head_dim
    int out_stride = 0;
  };
  explicit MlaHeads(const ModelConfig& config) : c_(config) {}
  void run(const Call& call);

 private:
  const ModelConfig& c_;
  std::vector<float> scratch_;      // per thread: q_abs, probabilities, o_latent of a block
  std::vector<int32_t> key_slots_;  // per thread: [max_keys] a row's keys' cache slots
};

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
  // Sends the rows to the ranks attending for the other heads (w.remote_heads).
  void start_remote_heads(const AttentionWeights& w);
  class BatchKeys;

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
  MlaHeads heads_;
  // A call to the other heads' ranks: its rows, KV block tables and chosen positions.
  std::vector<RemoteHeads::Row> remote_rows_;
  std::vector<int32_t> remote_offsets_, remote_blocks_, remote_selected_, table_of_seq_;
};

}  // namespace colibri
