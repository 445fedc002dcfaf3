// Model weights, loaded from a Checkpoint with every shape checked against the config
// (model/weight_loader.cpp). Expert ranks load only the routed experts they own. Routed experts of
// a colibri container stay quantized in memory, and NVFP4 ones stay NVFP4; with
// LoadOptions::keep_stored (the engine) its projections, dense MLPs and shared experts also stay as
// stored (container int8/int4, BF16, FP8 or NVFP4: the formats of model/weight_format.h), run by
// their kernels. Otherwise (the reference) every other tensor is converted to fp32 at load.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/config.h"
#include "model/matrix.h"

namespace colibri {

// The heads of an MLA layer that other ranks attend for (tensor_parallel/split_linear.h):
// kv_b_proj keeps the rows of heads [0, local_heads) here, and every rank attending for others
// keeps a copy of the layer's compressed cache, which each call writes its rows to. Every head's
// values are computed with the bits one process gives them.
class RemoteHeads {
 public:
  struct Row {
    int32_t table = 0;     // the row's sequence: its blocks are blocks[offsets[table] ..]
    int32_t pos = 0;       // its position
    int32_t selected = 0;  // positions the indexer chose for it (in `selected`); 0: all of 0..pos
  };
  struct Call {
    int64_t n = 0;
    const Row* rows = nullptr;          // [n]
    const float* q = nullptr;           // [n, heads, qk_head_dim], rotated
    const float* cache_rows = nullptr;  // [n, kv_lora_rank + rope dim]: the rows' new cache rows
    const int32_t* offsets = nullptr;   // [tables + 1] into blocks
    int tables = 0;
    const int32_t* blocks = nullptr;    // each table's KV blocks, in position order
    const int32_t* selected = nullptr;  // the rows' chosen positions, row after row
  };
  virtual ~RemoteHeads() = default;
  // Sends the call to the ranks attending for the other heads, which start on them at once.
  virtual void start(const Call& call) = 0;
  // Waits for them and writes their heads [local_heads, heads) of out [n, heads, v_head_dim].
  virtual void finish(int64_t n, float* out) = 0;
};

// Head bounds of an MLA layer's attention split into `parts` (kv_b_proj cut by heads): parts + 1
// ascending values from 0 to the config's heads, or empty when kv_b cannot be cut at them (fewer
// heads than parts, or a head's rows not a multiple of row_slice_step).
std::vector<int> split_head_bounds(const ModelConfig& config, const Matrix& kv_b, int parts);

// The three matrices of a quantized expert, in the container's layout.
struct QuantMlp {
  QuantMatrix gate, up, down;  // [I, H], [I, H], [H, I]
};

// An MLP held either as fp32 matrices or (routed experts of a container) quantized.
struct MlpWeights {
  Matrix gate, up, down;  // [I, H], [I, H], [H, I]; empty when quantized
  QuantMlp quant;         // set instead of gate/up/down for a quantized expert
  bool quantized() const { return !quant.gate.empty(); }
  bool empty() const { return gate.empty() && !quantized(); }
  uint64_t bytes() const {
    return gate.bytes() + up.bytes() + down.bytes() + quant.gate.bytes() + quant.up.bytes() +
           quant.down.bytes();
  }
};

struct IndexerWeights {
  Matrix wq_b;                                    // [index_n_heads * index_head_dim, q_lora_rank]
  Matrix wk;                                      // [index_head_dim, hidden]
  Matrix weights_proj;                            // [index_n_heads, hidden]
  std::vector<float> k_norm_weight, k_norm_bias;  // LayerNorm [index_head_dim], eps 1e-6
};

struct AttentionWeights {
  Matrix q_a_proj;                            // [q_lora_rank, hidden]   (q_lora_rank > 0)
  std::vector<float> q_a_norm;                // [q_lora_rank]
  Matrix q_b_proj;                            // [H * qk_head_dim, q_lora_rank]
  Matrix q_proj;                              // [H * qk_head_dim, hidden]  (q_lora_rank == 0)
  Matrix kv_a_proj;                           // [kv_lora_rank + qk_rope_head_dim, hidden]
  std::vector<float> kv_a_norm;               // [kv_lora_rank]
  Matrix kv_b_proj;                           // [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
  Matrix o_proj;                              // [hidden, H * v_head_dim]
  std::optional<IndexerWeights> indexer;      // full DSA layers only
  int local_heads = 0;                        // with remote_heads: the heads attended for here
  std::shared_ptr<RemoteHeads> remote_heads;  // null: every head is attended for here
};

struct LayerWeights {
  std::vector<float> input_norm, post_attention_norm;  // [hidden]
  AttentionWeights attn;
  bool is_moe = false;
  MlpWeights dense_mlp;             // dense layers
  Matrix router;                    // [n_routed_experts, hidden]
  std::vector<float> router_bias;   // [n_routed_experts] e_score_correction_bias
  MlpWeights shared_experts;        // I = moe_intermediate_size * n_shared_experts
  std::vector<MlpWeights> experts;  // [n_routed_experts]; empty entries are owned elsewhere
};

// Multi-token-prediction layer (model.layers.{num_layers + i}): recognised and kept for later use.
struct MtpWeights {
  Matrix eh_proj;  // [hidden, 2 * hidden]
  std::vector<float> enorm, hnorm, head_norm;
  LayerWeights layer;
};

struct ModelWeights {
  Matrix embed;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;
  Matrix lm_head;  // [vocab, hidden]
  std::vector<MtpWeights> mtp;
};

// Bytes of the weights held in memory, by representation (norms and biases count as fp32).
struct WeightBytes {
  // fp8, quantized (int8/int4 containers), nvfp4: with their scales
  uint64_t f32 = 0, bf16 = 0, fp8 = 0, quantized = 0, nvfp4 = 0;
  uint64_t total() const { return f32 + bf16 + fp8 + quantized + nvfp4; }
};
WeightBytes weight_bytes(const ModelWeights& w);

struct LoadOptions {
  bool dense = true;  // embeddings, attention, routers, shared experts, dense MLPs, lm_head
  bool mtp = true;
  // Projections (attention, indexer, lm_head), dense MLPs and shared experts stay in their
  // stored precision when it is a container's int8/int4, BF16, FP8 E4M3 with column blocks a
  // multiple of 16, or NVFP4 (kv_b_proj: int8 rows or BF16 only, as the absorbed attention reads
  // it by rows; NVFP4 and FP8 ones are dequantized); embeddings, norms and routers are fp32.
  bool keep_stored = false;
  // Only the matrices split_targets lists and each layer's kv_b_proj, as `dense` with
  // keep_stored would load them (a rank that serves rows of split linears and attends for heads
  // cuts its share from them); no routed expert.
  bool split_targets_only = false;
  // Which routed experts to load; all when empty.
  std::function<bool(int layer, int expert)> owns_expert;
};

// Whether this model's FP8 weights stay FP8 in memory: the FP8 kernels need column blocks that
// are a multiple of 16 (128 x 128 when the config does not say).
bool fp8_kept_as_stored(const ModelConfig& config);

ModelWeights load_model_weights(const ModelConfig& config, const Checkpoint& checkpoint,
                                const LoadOptions& options = {});

// A matrix that tensor parallelism can split by output rows, and what to call it in errors.
struct SplitTarget {
  Matrix* matrix;
  int layer;  // -1: lm_head
  std::string name;
};
// The linears that go through linear() with a whole row's input, in an order every rank derives
// alike from the config: per layer q_a_proj (or q_proj), q_b_proj, kv_a_proj, o_proj, the
// indexer's wq_b, the dense MLP's gate, up and down projections; then lm_head. Not kv_b_proj,
// which the absorbed attention reads by rows, nor the indexer's wk and weights_proj (too small to
// pay for a round trip), nor the shared expert, which runs while the other ranks compute routed
// experts.
// A dense MLP held quantized for the fused expert kernel is held as its three matrices first.
std::vector<SplitTarget> split_targets(ModelWeights& w);

// A slice of a routed expert's intermediate dimension (--placement sliced): gate and up rows and
// down columns [begin, end). Over a partition of [0, moe_intermediate_size) the slices' outputs
// sum to the expert's, up to the order of that sum. end < 0: the whole expert.
struct ExpertSlice {
  int64_t begin = 0, end = -1;
  bool whole() const { return end < 0; }
};
// Slice bounds are multiples of this (int8 activation blocks, kTiles columns, the usual int4 groups
// and FP8 column blocks), or of a half of it down to 8 rows for experts too small for as many
// steps as slices; a bound inside a group or FP8 block is refused when the expert is cut.
inline constexpr int64_t kExpertSliceStep = 128;
// Bounds of one slice of [0, inter) per weight, in proportion to the weights (in whole steps, the
// last slice to inter): weights.size() + 1 ascending values. Fails when a slice would be empty.
std::vector<int64_t> expert_slice_bounds(int64_t inter, const std::vector<double>& weights);
// Rows [begin, end) of gate and up and columns [begin, end) of down, copied.
MlpWeights slice_expert(const MlpWeights& w, ExpertSlice slice);
// Fails unless `slice` lies within an expert of `inter` intermediate rows and, for an expert held
// in a container format, starts at a whole row tile.
void check_expert_slice(ExpertSlice slice, int64_t inter, bool quantized);

// One routed expert as stored (a container's int8/int4, BF16, NVFP4, or FP8 with column blocks a
// multiple of 16; fp32 otherwise), as the engine's load_model_weights holds it, or its `slice`.
// Thread-safe: the checkpoint is only read.
MlpWeights load_routed_expert(const ModelConfig& config, const Checkpoint& checkpoint, int layer,
                              int expert, ExpertSlice slice = {});

std::string layer_prefix(int layer);
std::string expert_prefix(int layer, int expert);

}  // namespace colibri
