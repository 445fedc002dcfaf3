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
  // Where row t attends to every position 0..pos of a sequence (fill gives their slots in
  // position order): pos, and the sequence in *seq. Else -1 (the default).
  virtual int dense_through(int /*t*/, int* /*seq*/) const { return -1; }
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
  // by_rows: each row reads its keys on its own, per block of heads, the softmax over all of them
  // at once (a call of one row always takes it). Otherwise keys are read in blocks for a group
  // of rows and heads at a time (GEMM-shaped products, online softmax): rows of one sequence
  // that see every position share the blocks, and a row of chosen keys reads them once for all
  // its heads. Each row and head's result depends only on its own keys, not on the batch, the
  // grouping or the threads. On a model of fewer than 16 heads, rows of chosen keys take the row
  // path.
  void run(const Call& call, bool by_rows);

 private:
  void run_by_rows(const Call& call);
  void run_blocked(const Call& call);
  // Rows and heads that share their keys.
  struct Item {
    int t0 = 0, rows = 1;  // rows [t0, t0 + rows) of the call
    int h0 = 0, heads = 0;
    bool dense = false;  // rows of one sequence, each seeing positions 0..its pos
  };
  // limit: [columns] per column, the last index of the keys it sees.
  void attend_item(const Call& call, const Item& item, int c0, int chunk, float* scratch,
                   int32_t* slots, int* limit);

  const ModelConfig& c_;
  std::vector<float> scratch_;           // per thread: q_abs, probabilities, o_latent of a block
  std::vector<int32_t> key_slots_;       // per thread: [max_keys] a row's keys' cache slots
  std::vector<float> q_abs_, o_latent_;  // blocked: [heads, rows of a chunk, kv_lora_rank]
  std::vector<Item> items_;
  std::vector<int> limits_;  // per thread: [columns]
};

// The DSA indexer's choice of keys for the rows of a call: each row's index scores of every
// position it sees (kernels::index_scores), then its `topk` best under (score, then the lower
// position), in position order. A row that sees `topk` positions or fewer gets count 0: every
// position. Rows of one sequence (consecutive, as in a Batch) are scored together, their keys
// read in blocks once for a block of rows; each score is the bits of the row-by-row path.
class IndexerTopk {
 public:
  struct Call {
    int n = 0;
    const BatchRow* rows = nullptr;  // seq and pos of each row: row t sees positions 0..pos
    const KvManager* kv = nullptr;
    const float* keys = nullptr;     // the indexer's key cache by slot: [slots, dim]
    const float* q_t = nullptr;      // row t's queries at t * dim * padded: [dim, padded]
    const float* weights = nullptr;  // row t's head weights at t * padded
    int padded = 0;                  // heads, zero-padded to a multiple of 8
    int dim = 0;
    float scale = 0;
    int topk = 0;
    int* selected = nullptr;  // [n, topk] chosen positions, ascending
    int* count = nullptr;     // [n] keys chosen; 0 = every position the row sees
  };
  // by_rows: each row reads every key on its own (a call of one row always takes it).
  void run(const Call& call, bool by_rows);

 private:
  void run_by_rows(const Call& call);
  // Rows [t0, t1) of one sequence.
  void run_blocked(const Call& call, int t0, int t1);
  // Row t's top-k of scores[0, visible).
  void choose(const Call& call, int t, const float* scores, int* order) const;

  std::vector<float> scores_;   // by rows: per thread [max visible]; blocked: [rows, visible]
  std::vector<int> order_;      // per thread: [max visible]
  std::vector<int32_t> slots_;  // by rows: per thread [max visible]; blocked: [visible]
  std::vector<int> scored_;     // blocked: the rows that need scores
};

// True unless COLIBRI_BLOCKED_ATTENTION=0: prompt chunks take the blocked paths.
bool attention_blocked();

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
  std::vector<float> index_q_t_;       // [n, index dim, padded heads] queries transposed
  std::vector<float> index_w_padded_;  // [n, padded heads] head weights
  MlaHeads heads_;
  IndexerTopk topk_;
  // A call to the other heads' ranks: its rows, KV block tables and chosen positions.
  std::vector<RemoteHeads::Row> remote_rows_;
  std::vector<int32_t> remote_offsets_, remote_blocks_, remote_selected_, table_of_seq_;
};

}  // namespace colibri
