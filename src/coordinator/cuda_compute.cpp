#include "coordinator/cuda_compute.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "cuda/check.h"
#include "cuda/dsa_indexer.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/expert_ffn.cuh"
#include "cuda/gemm.h"
#include "cuda/mla_attention.cuh"
#include "cuda/norm.cuh"
#include "cuda/rope.cuh"
#include "cuda/router.cuh"
#include "model/rope.h"

namespace colibri {

namespace {

// A product weight [rows, cols] on the device, in the form device_weight_form gives it
// (gpu_staging.h): NVFP4 as stored (codes and E4M3 block scales, products by cuda::matrix_linear),
// BF16, or fp32 when the values loaded are not all BF16 values (an fp32 checkpoint: kept exact,
// products in fp32 without TF32).
struct DeviceMatrix {
  const uint16_t* bf16 = nullptr;
  const float* f32 = nullptr;
  cuda::DeviceMatrix nvfp4;  // its data is null unless the weight is NVFP4
  int64_t rows = 0, cols = 0;
  bool empty() const { return !bf16 && !f32 && !nvfp4.data; }
};

struct DeviceMlp {
  DeviceMatrix gate, up, down;
  bool empty() const { return gate.empty(); }
};

struct DeviceLayer {
  const float *input_norm = nullptr, *post_norm = nullptr;
  DeviceMatrix q_a, q_b, q_proj, kv_a, kv_b, o_proj;
  const float *q_a_norm = nullptr, *kv_a_norm = nullptr;
  bool indexer = false;
  DeviceMatrix wq_b, wk, weights_proj;
  const float *k_norm_weight = nullptr, *k_norm_bias = nullptr;
  bool moe = false;
  const float* router = nullptr;  // fp32 [experts, hidden]
  const float* router_bias = nullptr;
  DeviceMlp shared, dense;
  float *latent = nullptr, *k_rope = nullptr, *index_k = nullptr;  // [slots, ...]
};

}  // namespace

struct CudaCompute::Impl {
  std::vector<void*> allocations;
  uint64_t* bytes = nullptr;
  DeviceWeightBytes* weight_bytes = nullptr;
  std::unique_ptr<cuda::Blas> blas;
  DeviceMatrix embed;
  const float* final_norm = nullptr;
  DeviceMatrix lm_head;
  std::vector<DeviceLayer> layers;
  const float* inv_freq = nullptr;
  float attention_factor = 1.0f;
  int64_t max_cols = 0;  // widest input of any product
  int64_t max_out = 0;   // widest output of any product

  // Scratch, [max_rows, ...].
  float *h = nullptr, *normed = nullptr, *delta = nullptr, *shared = nullptr;
  uint16_t* act = nullptr;  // a product's input split in BF16 hi, lo [2, max_rows, max_cols]
  float* wide = nullptr;    // the split product's halves [2, max_rows, max_out]
  float *q = nullptr, *q_lora = nullptr, *kv_a = nullptr, *q_abs = nullptr, *heads_out = nullptr;
  float* o_latent = nullptr;
  float *index_q = nullptr, *index_k = nullptr, *index_w = nullptr;
  int *selected = nullptr, *selected_count = nullptr;
  float *gate = nullptr, *up = nullptr;
  float *router_logits = nullptr, *router_scratch = nullptr, *route_weight = nullptr;
  int* route_expert = nullptr;
  float* logits = nullptr;
  int* flags = nullptr;  // [2 * layers]: non-finite after attention, after the MLP
  // Per call, grown only.
  float* scores = nullptr;  // [n, max_keys]
  size_t scores_capacity = 0;
  int* rows = nullptr;  // tokens, row_pos, row_slot, row_seq, logit rows, blocks
  size_t rows_capacity = 0;
  int *tokens = nullptr, *row_pos = nullptr, *row_slot = nullptr, *row_seq = nullptr;
  int *logit_rows = nullptr, *blocks = nullptr;
  std::vector<int> staging;

  ~Impl() {
    blas.reset();
    for (void* p : allocations) cudaFree(p);
  }

  template <typename T>
  T* alloc(size_t count) {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    allocations.push_back(p);
    *bytes += count * sizeof(T);
    return static_cast<T*>(p);
  }
  void release(void* p) {
    if (!p) return;
    allocations.erase(std::find(allocations.begin(), allocations.end(), p));
    CHECK_CUDA(cudaFree(p));
  }
  template <typename T, typename Allocator>
  const T* upload(const std::vector<T, Allocator>& host) {
    T* p = alloc<T>(host.size());
    CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }
  // In the form device_weight_form gives (gpu_staging.h): NVFP4 as stored, else BF16 when that
  // is exact or the weight is not fp32 (BF16, FP8 and container weights are converted: keeping
  // int8 rows with their scales on the GPU is future work), else fp32. `widen`: never NVFP4 (the
  // embedding table, kv_b_proj).
  DeviceMatrix upload(const Matrix& w, bool widen = false) {
    if (w.empty()) return {};
    max_cols = std::max(max_cols, w.cols);
    max_out = std::max(max_out, w.rows);
    DeviceMatrix m;
    m.rows = w.rows;
    m.cols = w.cols;
    switch (device_weight_form(w, widen)) {
      case DeviceWeightForm::kNvfp4: {
        const uint8_t* codes = upload(w.nvfp4.codes);
        const uint8_t* scales = upload(w.nvfp4.scales);
        try {
          m.nvfp4 = cuda::device_matrix_nvfp4(w.rows, w.cols, codes, scales, w.nvfp4.global,
                                              "a coordinator weight");
        } catch (const std::invalid_argument& e) {
          fail("the CUDA coordinator: {}", e.what());
        }
        weight_bytes->nvfp4 += w.nvfp4.codes.size() + w.nvfp4.scales.size();
        break;
      }
      case DeviceWeightForm::kF32:
        m.f32 = upload(w.data);
        weight_bytes->f32 += 4 * w.data.size();
        break;
      case DeviceWeightForm::kBf16:
        m.bf16 = upload(matrix_to_bf16(w));
        weight_bytes->bf16 += 2 * uint64_t(w.rows) * uint64_t(w.cols);
        break;
    }
    return m;
  }
  DeviceMlp upload(const MlpWeights& w) {
    if (w.empty()) return {};
    if (w.quantized()) {
      // A container's quantized MLP: each matrix dequantized, then BF16.
      const auto as_matrix = [](const QuantMatrix& stored) {
        Matrix m;
        m.rows = stored.rows;
        m.cols = stored.cols;
        m.quant = stored;
        return m;
      };
      return {upload(as_matrix(w.quant.gate)), upload(as_matrix(w.quant.up)),
              upload(as_matrix(w.quant.down))};
    }
    return {upload(w.gate), upload(w.up), upload(w.down)};
  }

  // y[n, rows] = x[n, cols] · W^T. BF16 weights take x as two BF16 rows (hi, lo) in one product
  // whose halves are summed: the weights are read once and x keeps 16 significant bits.
  // NVFP4 weights: cuda::matrix_linear, the codes widened in registers with fp32 activations.
  void linear(const DeviceMatrix& w, const float* x, int64_t n, float* y, cudaStream_t stream) {
    if (w.nvfp4.data) {
      cuda::matrix_linear(w.nvfp4, x, n, y, stream);
      return;
    }
    if (w.f32) {
      cuda::gemm_f32(*blas, x, n, w.f32, w.rows, w.cols, y);
      return;
    }
    cuda::split_bf16(x, n * w.cols, act, act + n * w.cols, stream);
    cuda::gemm_bf16(*blas, act, 2 * n, w.bf16, w.rows, w.cols, wide);
    cuda::add_halves(wide, n * w.rows, y, stream);
  }
  // Per head h < heads: y[t, h, :m] = x[t, h, :k] · op(W_h), W_h the rows of kv_b_proj from
  // row0 + h * head_rows ([k, m], or [m, k] read transposed). x [n, heads, ldx / heads] and
  // y [n, heads, ldy / heads]; BF16 weights take x split as in linear(). kv_b is BF16 or fp32
  // (uploaded widened).
  void heads_product(const DeviceMatrix& kv_b, int64_t row0, int64_t head_rows, bool transpose,
                     int64_t heads, int64_t n, int64_t m, int64_t k, const float* x, int64_t ldx,
                     float* y, int64_t ldy, cudaStream_t stream) {
    const int64_t ldw = kv_b.cols, stride_x = ldx / heads, stride_y = ldy / heads;
    if (kv_b.f32) {
      cuda::gemm_batched(*blas, false, heads, n, m, k, x, ldx, stride_x, kv_b.f32 + row0 * ldw, ldw,
                         head_rows * ldw, transpose, y, ldy, stride_y);
      return;
    }
    cuda::split_bf16(x, n * ldx, act, act + n * ldx, stream);
    cuda::gemm_batched(*blas, true, heads, 2 * n, m, k, act, ldx, stride_x, kv_b.bf16 + row0 * ldw,
                       ldw, head_rows * ldw, transpose, wide, ldy, stride_y);
    cuda::add_halves(wide, n * ldy, y, stream);
  }
  // y = down(silu(gate x) * up x).
  void mlp(const DeviceMlp& w, const float* x, int64_t n, float* y, cudaStream_t stream) {
    linear(w.gate, x, n, gate, stream);
    linear(w.up, x, n, up, stream);
    cuda::silu_mul(gate, up, n * w.gate.rows, stream);
    linear(w.down, gate, n, y, stream);
  }
};

CudaCompute::CudaCompute(const ModelConfig& config, const ModelWeights& weights, KvManager& kv,
                         int max_rows, int device, Profiler* /*profiler*/)
    : config_(config), kv_(kv), max_rows_(max_rows), device_(device), impl_(new Impl) {
  const ModelConfig& c = config;
  if (c.kv_lora_rank > cuda::kMlaMaxLatent)
    fail("the CUDA coordinator takes kv_lora_rank up to {}, not {}", cuda::kMlaMaxLatent,
         c.kv_lora_rank);
  if (c.num_experts_per_tok > cuda::kRouterMaxTopK || c.n_group > cuda::kRouterMaxGroups)
    fail("the CUDA router takes top-k up to {} and up to {} groups", cuda::kRouterMaxTopK,
         cuda::kRouterMaxGroups);
  CHECK_CUDA(cudaSetDevice(device));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  Impl& d = *impl_;
  d.bytes = &device_bytes_;
  d.weight_bytes = &weight_bytes_;
  d.blas = std::make_unique<cuda::Blas>(stream_);

  // Weights: NVFP4, BF16 or fp32 products, fp32 norms, biases and routers.
  // The embedding table is read by rows: BF16 when exact (a BF16 checkpoint), else fp32.
  d.embed = d.upload(weights.embed, true);
  d.final_norm = d.upload(weights.final_norm);
  d.lm_head = d.upload(weights.lm_head);
  const Rope rope(c.rope, c.qk_rope_head_dim);
  d.inv_freq = d.upload(rope.inv_freq());
  d.attention_factor = rope.attention_factor();
  const size_t slots = size_t(kv.capacity_tokens());
  int64_t max_inter = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = weights.layers[size_t(l)];
    DeviceLayer layer;
    layer.input_norm = d.upload(w.input_norm);
    layer.post_norm = d.upload(w.post_attention_norm);
    const AttentionWeights& a = w.attn;
    layer.q_a = d.upload(a.q_a_proj);
    layer.q_b = d.upload(a.q_b_proj);
    layer.q_proj = d.upload(a.q_proj);
    layer.kv_a = d.upload(a.kv_a_proj);
    layer.kv_b = d.upload(a.kv_b_proj, true);  // read per head by heads_product
    layer.o_proj = d.upload(a.o_proj);
    if (!a.q_a_norm.empty()) layer.q_a_norm = d.upload(a.q_a_norm);
    layer.kv_a_norm = d.upload(a.kv_a_norm);
    if (a.indexer) {
      layer.indexer = true;
      layer.wq_b = d.upload(a.indexer->wq_b);
      layer.wk = d.upload(a.indexer->wk);
      layer.weights_proj = d.upload(a.indexer->weights_proj);
      layer.k_norm_weight = d.upload(a.indexer->k_norm_weight);
      layer.k_norm_bias = d.upload(a.indexer->k_norm_bias);
      layer.index_k = d.alloc<float>(slots * size_t(c.index_head_dim));
    }
    layer.moe = w.is_moe;
    if (w.is_moe) {
      layer.router = d.upload(w.router.data);
      layer.router_bias = d.upload(w.router_bias);
      layer.shared = d.upload(w.shared_experts);
      if (!layer.shared.empty()) max_inter = std::max(max_inter, layer.shared.gate.rows);
    } else {
      layer.dense = d.upload(w.dense_mlp);
      max_inter = std::max(max_inter, layer.dense.gate.rows);
    }
    layer.latent = d.alloc<float>(slots * size_t(c.kv_lora_rank));
    layer.k_rope = d.alloc<float>(slots * size_t(c.qk_rope_head_dim));
    d.layers.push_back(layer);
  }

  // Scratch for max_rows rows.
  const size_t n = size_t(max_rows), hidden = size_t(c.hidden_size);
  const size_t heads = size_t(c.num_heads), r = size_t(c.kv_lora_rank);
  d.max_cols = std::max({d.max_cols, int64_t(c.num_heads) * c.qk_head_dim(),
                         int64_t(c.num_heads) * c.kv_lora_rank, max_inter});
  d.max_out = std::max(
      {d.max_out, int64_t(c.num_heads) * c.kv_lora_rank, int64_t(c.num_heads) * c.v_head_dim});
  d.h = d.alloc<float>(n * hidden);
  d.normed = d.alloc<float>(n * hidden);
  d.delta = d.alloc<float>(n * hidden);
  d.shared = d.alloc<float>(n * hidden);
  d.act = d.alloc<uint16_t>(2 * n * size_t(d.max_cols));
  d.wide = d.alloc<float>(2 * n * size_t(d.max_out));
  d.q = d.alloc<float>(n * heads * size_t(c.qk_head_dim()));
  d.q_lora = d.alloc<float>(n * size_t(std::max(c.q_lora_rank, 1)));
  d.kv_a = d.alloc<float>(n * (r + size_t(c.qk_rope_head_dim)));
  d.q_abs = d.alloc<float>(n * heads * r);
  d.o_latent = d.alloc<float>(n * heads * r);
  d.heads_out = d.alloc<float>(n * heads * size_t(c.v_head_dim));
  if (c.has_indexer()) {
    d.index_q = d.alloc<float>(n * size_t(c.index_n_heads) * size_t(c.index_head_dim));
    d.index_k = d.alloc<float>(n * size_t(c.index_head_dim));
    d.index_w = d.alloc<float>(n * size_t(c.index_n_heads));
    d.selected = d.alloc<int>(n * size_t(c.index_topk));
  }
  d.selected_count = d.alloc<int>(n);
  d.gate = d.alloc<float>(n * size_t(max_inter));
  d.up = d.alloc<float>(n * size_t(max_inter));
  const size_t experts = size_t(std::max(c.n_routed_experts, 1));
  d.router_logits = d.alloc<float>(n * experts);
  d.router_scratch = d.alloc<float>(n * 2 * experts);
  d.route_expert = d.alloc<int>(n * size_t(std::max(c.num_experts_per_tok, 1)));
  d.route_weight = d.alloc<float>(n * size_t(std::max(c.num_experts_per_tok, 1)));
  d.logits = d.alloc<float>(n * size_t(c.vocab_size));
  d.flags = d.alloc<int>(2 * size_t(c.num_layers));
  CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&normed_host_), n * hidden * sizeof(float)));
  CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&routed_host_), n * hidden * sizeof(float)));
}

CudaCompute::~CudaCompute() {
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_);
  impl_.reset();
  cudaFreeHost(normed_host_);
  cudaFreeHost(routed_host_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaCompute::begin(const Batch& batch) {
  CHECK_CUDA(cudaSetDevice(device_));  // the calling thread's device (--serve calls from others)
  Impl& d = *impl_;
  batch_ = &batch;
  table_ = pack_block_table(batch, kv_);
  const int n = batch.size();
  // One upload: tokens, positions, slots, table rows, logit rows [n each], then the blocks.
  d.staging.resize(5 * size_t(n) + table_.blocks.size());
  int* s = d.staging.data();
  int logit_rows = 0;
  for (int t = 0; t < n; ++t) {
    s[t] = batch.rows[size_t(t)].token;
    if (batch.rows[size_t(t)].logits) s[4 * n + logit_rows++] = t;
  }
  std::copy(table_.row_pos.begin(), table_.row_pos.end(), s + n);
  std::copy(table_.row_slot.begin(), table_.row_slot.end(), s + 2 * n);
  std::copy(table_.row_seq.begin(), table_.row_seq.end(), s + 3 * n);
  std::copy(table_.blocks.begin(), table_.blocks.end(), s + 5 * n);
  if (d.staging.size() > d.rows_capacity) {
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    d.release(d.rows);
    d.rows_capacity = d.staging.size() * 2;
    d.rows = d.alloc<int>(d.rows_capacity);
  }
  CHECK_CUDA(
      cudaMemcpyAsync(d.rows, s, d.staging.size() * sizeof(int), cudaMemcpyHostToDevice, stream_));
  d.tokens = d.rows;
  d.row_pos = d.rows + n;
  d.row_slot = d.rows + 2 * n;
  d.row_seq = d.rows + 3 * n;
  d.logit_rows = d.rows + 4 * n;
  d.blocks = d.rows + 5 * n;
  if (config_.has_indexer()) {
    const size_t scores = size_t(n) * size_t(table_.max_keys);
    if (scores > d.scores_capacity) {
      CHECK_CUDA(cudaStreamSynchronize(stream_));
      d.release(d.scores);
      d.scores_capacity = scores;
      d.scores = d.alloc<float>(scores);
    }
  }
  CHECK_CUDA(cudaMemsetAsync(d.selected_count, 0, size_t(n) * sizeof(int), stream_));
  CHECK_CUDA(cudaMemsetAsync(d.flags, 0, 2 * size_t(config_.num_layers) * sizeof(int), stream_));
  cuda::embed(d.tokens, n, d.embed.bf16, d.embed.f32, config_.hidden_size, d.h, stream_);
}

void CudaCompute::attention(int l) {
  Impl& d = *impl_;
  const ModelConfig& c = config_;
  const DeviceLayer& w = d.layers[size_t(l)];
  const int n = batch_->size(), hidden = c.hidden_size, heads = c.num_heads;
  const int dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dq = c.qk_head_dim();
  const int dv = c.v_head_dim, r = c.kv_lora_rank;
  const bool interleave = c.rope.interleave;
  cuda::rms_norm(d.h, hidden, nullptr, n, hidden, w.input_norm, c.rms_norm_eps, d.normed, hidden,
                 stream_);

  // Queries, and this call's latent and rope keys into the cache.
  if (c.q_lora_rank > 0) {
    d.linear(w.q_a, d.normed, n, d.q_lora, stream_);
    cuda::rms_norm(d.q_lora, c.q_lora_rank, nullptr, n, c.q_lora_rank, w.q_a_norm, c.mla_norm_eps,
                   d.q_lora, c.q_lora_rank, stream_);
    d.linear(w.q_b, d.q_lora, n, d.q, stream_);
  } else {
    d.linear(w.q_proj, d.normed, n, d.q, stream_);
  }
  d.linear(w.kv_a, d.normed, n, d.kv_a, stream_);
  cuda::rms_norm(d.kv_a, r + dr, nullptr, n, r, w.kv_a_norm, c.mla_norm_eps, d.kv_a, r + dr,
                 stream_);
  cuda::rope(d.kv_a + r, n, 1, r + dr, 0, dr, d.row_pos, d.inv_freq, d.attention_factor, interleave,
             stream_);
  cuda::store_rows(d.kv_a, n, r + dr, r, d.row_slot, w.latent, stream_);
  cuda::store_rows(d.kv_a + r, n, r + dr, dr, d.row_slot, w.k_rope, stream_);
  cuda::rope(d.q + dn, n, heads, int64_t(heads) * dq, dq, dr, d.row_pos, d.inv_freq,
             d.attention_factor, interleave, stream_);

  // The indexer's choice of keys (kept for the shared indexer layers that follow).
  if (w.indexer) {
    if (c.q_lora_rank == 0) fail("the DSA indexer needs q_lora_rank > 0");
    const int ih = c.index_n_heads, dim = c.index_head_dim;
    d.linear(w.wq_b, d.q_lora, n, d.index_q, stream_);
    d.linear(w.wk, d.normed, n, d.index_k, stream_);
    cuda::layer_norm(d.index_k, n, dim, w.k_norm_weight, w.k_norm_bias, 1e-6f, d.index_k, stream_);
    d.linear(w.weights_proj, d.normed, n, d.index_w, stream_);
    cuda::rope(d.index_k, n, 1, dim, 0, dr, d.row_pos, d.inv_freq, d.attention_factor, interleave,
               stream_);
    cuda::rope(d.index_q, n, ih, int64_t(ih) * dim, dim, dr, d.row_pos, d.inv_freq,
               d.attention_factor, interleave, stream_);
    cuda::store_rows(d.index_k, n, dim, dim, d.row_slot, w.index_k, stream_);
    cuda::IndexerScores s;
    s.q = d.index_q;
    s.w = d.index_w;
    s.keys = w.index_k;
    s.kv = {d.blocks, d.row_seq, d.row_pos, table_.max_blocks, table_.block_tokens};
    s.n = n;
    s.heads = ih;
    s.dim = dim;
    s.topk = c.index_topk;
    s.score_scale = 1.0f / std::sqrt(float(dim));
    s.head_scale = 1.0f / std::sqrt(float(ih));
    s.scores = d.scores;
    s.max_keys = table_.max_keys;
    cuda::indexer_scores(s, stream_);
    cuda::indexer_topk(d.scores, n, table_.max_keys, d.row_pos, c.index_topk, d.selected,
                       d.selected_count, stream_);
  }

  // Absorbed attention: q_abs = W_UK^T q_nope per head, attend over the latents, W_UV o_latent.
  const int64_t head_rows = dn + dv;  // one head's rows of kv_b_proj: W_UK [dn, r], W_UV [dv, r]
  d.heads_product(w.kv_b, 0, head_rows, false, heads, n, r, dn, d.q, int64_t(heads) * dq, d.q_abs,
                  int64_t(heads) * r, stream_);
  cuda::MlaAttend a;
  a.q_abs = d.q_abs;
  a.q = d.q;
  a.latent = w.latent;
  a.k_rope = w.k_rope;
  a.kv = {d.blocks, d.row_seq, d.row_pos, table_.max_blocks, table_.block_tokens};
  if (c.has_indexer()) {
    a.selected = d.selected;
    a.selected_count = d.selected_count;
    a.topk = c.index_topk;
  }
  a.n = n;
  a.heads = heads;
  a.r = r;
  a.dr = dr;
  a.dq = dq;
  a.dn = dn;
  a.scale = c.softmax_scale();
  a.out = d.o_latent;
  cuda::mla_attend(a, stream_);
  d.heads_product(w.kv_b, dn, head_rows, true, heads, n, dv, r, d.o_latent, int64_t(heads) * r,
                  d.heads_out, int64_t(heads) * dv, stream_);
  d.linear(w.o_proj, d.heads_out, n, d.delta, stream_);

  cuda::add(d.h, d.delta, int64_t(n) * hidden, stream_);
  cuda::flag_non_finite(d.h, int64_t(n) * hidden, d.flags + 2 * l, stream_);
  cuda::rms_norm(d.h, hidden, nullptr, n, hidden, w.post_norm, c.rms_norm_eps, d.normed, hidden,
                 stream_);
}

Routing CudaCompute::route(int l) {
  Impl& d = *impl_;
  const ModelConfig& c = config_;
  const DeviceLayer& w = d.layers[size_t(l)];
  const int n = batch_->size(), k = c.num_experts_per_tok;
  cuda::gemm_f32(*d.blas, d.normed, n, w.router, c.n_routed_experts, c.hidden_size,
                 d.router_logits);
  cuda::RouterArgs a;
  a.logits = d.router_logits;
  a.bias = w.router_bias;
  a.n = n;
  a.experts = c.n_routed_experts;
  a.groups = c.n_group;
  a.topk_group = c.topk_group;
  a.top_k = k;
  a.norm_topk_prob = c.norm_topk_prob;
  a.routed_scaling_factor = float(c.routed_scaling_factor);
  a.scratch = d.router_scratch;
  a.expert = d.route_expert;
  a.weight = d.route_weight;
  cuda::route(a, stream_);
  Routing routing;
  routing.top_k = k;
  routing.expert.resize(size_t(n) * k);
  routing.weight.resize(size_t(n) * k);
  CHECK_CUDA(cudaMemcpyAsync(routing.expert.data(), d.route_expert, routing.expert.size() * 4,
                             cudaMemcpyDeviceToHost, stream_));
  CHECK_CUDA(cudaMemcpyAsync(routing.weight.data(), d.route_weight, routing.weight.size() * 4,
                             cudaMemcpyDeviceToHost, stream_));
  CHECK_CUDA(cudaStreamSynchronize(stream_));
  return routing;
}

ConstView CudaCompute::normed(Device where) {
  const size_t values = size_t(batch_->size()) * config_.hidden_size;
  if (where == Device::kCuda) {
    // The dispatcher reads them on its own stream: they must be written by then.
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    return {impl_->normed, ElemType::kF32, Device::kCuda, values};
  }
  CHECK_CUDA(cudaMemcpyAsync(normed_host_, impl_->normed, values * sizeof(float),
                             cudaMemcpyDeviceToHost, stream_));
  CHECK_CUDA(cudaStreamSynchronize(stream_));
  return host_f32(normed_host_, values);
}

View CudaCompute::routed(Device where) {
  const size_t values = size_t(batch_->size()) * config_.hidden_size;
  routed_on_device_ = where == Device::kCuda;
  if (routed_on_device_) return {impl_->delta, ElemType::kF32, Device::kCuda, values};
  return host_f32(routed_host_, values);
}

void CudaCompute::shared_expert(int l) {
  Impl& d = *impl_;
  const DeviceLayer& w = d.layers[size_t(l)];
  if (!w.shared.empty()) d.mlp(w.shared, d.normed, batch_->size(), d.shared, stream_);
}

void CudaCompute::add_moe(int l) {
  Impl& d = *impl_;
  const DeviceLayer& w = d.layers[size_t(l)];
  const int64_t values = int64_t(batch_->size()) * config_.hidden_size;
  if (!routed_on_device_)  // else the combine wrote d.delta, and finished before it returned
    CHECK_CUDA(cudaMemcpyAsync(d.delta, routed_host_, size_t(values) * sizeof(float),
                               cudaMemcpyHostToDevice, stream_));
  if (w.shared.empty())
    cuda::add(d.h, d.delta, values, stream_);
  else
    cuda::add_sum(d.h, d.delta, d.shared, values, stream_);
  cuda::flag_non_finite(d.h, values, d.flags + 2 * l + 1, stream_);
  // The combine writes routed_host_ again next layer: the upload must be done by then.
  CHECK_CUDA(cudaStreamSynchronize(stream_));
}

void CudaCompute::dense_mlp(int l) {
  Impl& d = *impl_;
  const int64_t values = int64_t(batch_->size()) * config_.hidden_size;
  d.mlp(d.layers[size_t(l)].dense, d.normed, batch_->size(), d.delta, stream_);
  cuda::add(d.h, d.delta, values, stream_);
  cuda::flag_non_finite(d.h, values, d.flags + 2 * l + 1, stream_);
}

std::vector<float> CudaCompute::logits(const Batch& batch) {
  Impl& d = *impl_;
  const ModelConfig& c = config_;
  const int rows = batch.logit_rows(), hidden = c.hidden_size;
  cuda::rms_norm(d.h, hidden, d.logit_rows, rows, hidden, d.final_norm, c.rms_norm_eps, d.normed,
                 hidden, stream_);
  d.linear(d.lm_head, d.normed, rows, d.logits, stream_);
  std::vector<float> logits(size_t(rows) * c.vocab_size);
  std::vector<int> flags(2 * size_t(c.num_layers));
  CHECK_CUDA(cudaMemcpyAsync(logits.data(), d.logits, logits.size() * sizeof(float),
                             cudaMemcpyDeviceToHost, stream_));
  CHECK_CUDA(cudaMemcpyAsync(flags.data(), d.flags, flags.size() * sizeof(int),
                             cudaMemcpyDeviceToHost, stream_));
  CHECK_CUDA(cudaStreamSynchronize(stream_));
  for (int l = 0; l < c.num_layers; ++l)
    for (int step = 0; step < 2; ++step)
      if (flags[size_t(2 * l + step)])
        fail("layer {}: {} made the residual stream non-finite (on the GPU)", l,
             step == 0                   ? "attention"
             : c.layer_is_moe[size_t(l)] ? "the experts"
                                         : "the dense MLP");
  return logits;
}

}  // namespace colibri
