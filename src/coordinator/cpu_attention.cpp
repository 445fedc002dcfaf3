#include "coordinator/cpu_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string_view>

#include "common/error.h"
#include "cpu/elementwise.h"
#include "cpu/linear.h"

namespace colibri {

namespace {

// For t < n: y[t * r ..] += sum over i < count of alpha[t * a_stride + i] * kv_b_proj[row0 + i, :],
// in the rows' stored form (a format with WeightFormatRow::read_by_rows: fp32, BF16, or int8 with
// its row scale; the loader keeps its rows): axpy_rows, the same bits as one axpy per row and term.
void kv_b_axpy_rows(const Matrix& w, int64_t row0, int64_t count, const float* alpha,
                    int64_t a_stride, int64_t n, float* y) {
  const int64_t r = w.cols;
  kernels::AxpyRows a{alpha, a_stride, n, count, r, nullptr, y, r};
  switch (w.format()) {
    case WeightFormat::kF32:
      return kernels::axpy_rows_f32(a, w.data.data() + row0 * r);
    case WeightFormat::kBF16:
      return kernels::axpy_rows_bf16(a, w.bf16.data() + row0 * r);
    case WeightFormat::kInt8Row:
      a.x_scale = w.quant.scales.data() + row0;
      return kernels::axpy_rows_i8(a,
                                   reinterpret_cast<const int8_t*>(w.quant.data.data()) + row0 * r);
    case WeightFormat::kFp8Block:
    case WeightFormat::kNvfp4:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped:
      break;
  }
  fail("kv_b_proj held as {} cannot be read by rows", weight_format_name(w.format()));
}

// kv_b_proj[row, :] · x in the row's stored form.
float kv_b_dot(const Matrix& w, int64_t row, const float* x) {
  const int64_t r = w.cols;
  switch (w.format()) {
    case WeightFormat::kF32:
      return kernels::dot_f32(w.data.data() + row * r, x, r);
    case WeightFormat::kBF16:
      return kernels::dot_bf16(x, w.bf16.data() + row * r, r);
    case WeightFormat::kInt8Row:
      return w.quant.scales[size_t(row)] *
             kernels::dot_i8(reinterpret_cast<const int8_t*>(w.quant.data.data()) + row * r, x, r);
    case WeightFormat::kFp8Block:
    case WeightFormat::kNvfp4:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped:
      break;
  }
  fail("kv_b_proj held as {} cannot be read by rows", weight_format_name(w.format()));
}

}  // namespace

constexpr int kHeadBlock = 8;
// Keys per axpy_rows call, gathered by slot: their latent rows (2 KiB each at rank 512) stay in
// L2 across its column strips.
constexpr int kKeysPerAxpy = 64;

namespace {

template <typename T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace

CpuAttention::CpuAttention(const ModelConfig& config, KvManager& kv, Profiler* profiler)
    : c_(config),
      kv_(kv),
      rope_(config.rope, config.qk_rope_head_dim),
      profiler_(profiler),
      heads_(config) {}

void CpuAttention::begin(const Batch& batch) {
  batch_ = &batch;
  const int n = batch.size();
  grow(slot_, size_t(n));
  max_keys_ = 0;
  for (int t = 0; t < n; ++t) {
    const BatchRow& row = batch.rows[size_t(t)];
    slot_[size_t(t)] = kv_.slot(row.seq, row.pos);
    max_keys_ = std::max(max_keys_, row.pos + 1);
  }
  grow(selected_count_, size_t(n));
  std::fill_n(selected_count_.begin(), n, 0);
}

void CpuAttention::forward(int layer, const AttentionWeights& w, const float* x, float* out) {
  const double start_us = profiler_ ? profiler_->now_us() : 0;
  double indexer_us = 0;
  const int n = batch_->size();
  project(layer, w, x);
  if (w.indexer) {
    const double indexer_start_us = profiler_ ? profiler_->now_us() : 0;
    select_keys(layer, *w.indexer, x);
    if (profiler_) {
      indexer_us = profiler_->now_us() - indexer_start_us;
      profiler_->add(Phase::kIndexer, layer, indexer_start_us, indexer_us);
    }
  }
  attend(layer, w);
  linear(w.o_proj, heads_out_.data(), n, out);
  if (profiler_)
    profiler_->add(Phase::kAttention, layer, start_us, profiler_->now_us() - start_us - indexer_us);
}

void CpuAttention::project(int layer, const AttentionWeights& w, const float* x) {
  const int n = batch_->size(), heads = c_.num_heads, dn = c_.qk_nope_head_dim;
  const int dr = c_.qk_rope_head_dim, dq = c_.qk_head_dim(), r = c_.kv_lora_rank;
  grow(q_, size_t(n) * heads * dq);
  if (c_.q_lora_rank > 0) {
    grow(q_lora_, size_t(n) * c_.q_lora_rank);
    linear(w.q_a_proj, x, n, q_lora_.data());
    kernels::rms_norm(q_lora_.data(), n, c_.q_lora_rank, w.q_a_norm.data(), c_.mla_norm_eps,
                      q_lora_.data());
    linear(w.q_b_proj, q_lora_.data(), n, q_.data());
  } else {
    linear(w.q_proj, x, n, q_.data());
  }

  grow(kv_a_, size_t(n) * (r + dr));
  linear(w.kv_a_proj, x, n, kv_a_.data());
  float* latent = kv_.latent(layer);
  float* k_rope = kv_.k_rope(layer);
  for (int t = 0; t < n; ++t) {
    const int pos = batch_->rows[size_t(t)].pos;
    float* row = &kv_a_[size_t(t) * (r + dr)];
    kernels::rms_norm(row, 1, r, w.kv_a_norm.data(), c_.mla_norm_eps, row);
    rope_.apply(row + r, pos, c_.rope.interleave);
    const size_t slot = size_t(slot_[size_t(t)]);
    std::copy_n(row, r, latent + slot * r);
    std::copy_n(row + r, dr, k_rope + slot * dr);
    for (int head = 0; head < heads; ++head)
      rope_.apply(&q_[(size_t(t) * heads + head) * dq + dn], pos, c_.rope.interleave);
  }
}

void CpuAttention::select_keys(int layer, const IndexerWeights& w, const float* x) {
  const int n = batch_->size(), heads = c_.index_n_heads, dim = c_.index_head_dim;
  const int topk = c_.index_topk;
  if (c_.q_lora_rank == 0) fail("the DSA indexer needs q_lora_rank > 0");
  grow(index_q_, size_t(n) * heads * dim);
  grow(index_k_, size_t(n) * dim);
  grow(index_w_, size_t(n) * heads);
  linear(w.wq_b, q_lora_.data(), n, index_q_.data());
  linear(w.wk, x, n, index_k_.data());
  kernels::layer_norm(index_k_.data(), n, dim, w.k_norm_weight.data(), w.k_norm_bias.data(), 1e-6f,
                      index_k_.data());
  linear(w.weights_proj, x, n, index_w_.data());
  const float head_scale = 1.0f / std::sqrt(float(heads));
  for (int i = 0; i < n * heads; ++i) index_w_[size_t(i)] *= head_scale;

  float* keys = kv_.index_k(layer);
  if (!keys) fail("layer {} has indexer weights but no indexer cache", layer);
  for (int t = 0; t < n; ++t) {
    const int pos = batch_->rows[size_t(t)].pos;
    rope_.apply(&index_k_[size_t(t) * dim], pos, c_.rope.interleave);  // the FIRST dr dims
    for (int head = 0; head < heads; ++head)
      rope_.apply(&index_q_[(size_t(t) * heads + head) * dim], pos, c_.rope.interleave);
    std::copy_n(&index_k_[size_t(t) * dim], dim, keys + size_t(slot_[size_t(t)]) * dim);
  }

  grow(selected_, size_t(n) * topk);
  // Each row's queries transposed, [dim, padded heads], and its head weights, zero-padded to a
  // multiple of 8 heads (index_scores' layout).
  const int padded = (heads + 7) / 8 * 8;
  grow(index_q_t_, size_t(n) * dim * padded);
  grow(index_w_padded_, size_t(n) * padded);
  for (int t = 0; t < n; ++t) {
    float* q_t = &index_q_t_[size_t(t) * dim * padded];
    float* weights = &index_w_padded_[size_t(t) * padded];
    for (int head = 0; head < padded; ++head) {
      weights[head] = head < heads ? index_w_[size_t(t) * heads + head] : 0.0f;
      for (int d = 0; d < dim; ++d)
        q_t[size_t(d) * padded + head] =
            head < heads ? index_q_[(size_t(t) * heads + head) * dim + d] : 0.0f;
    }
  }
  IndexerTopk::Call call;
  call.n = n;
  call.rows = batch_->rows.data();
  call.kv = &kv_;
  call.keys = keys;
  call.q_t = index_q_t_.data();
  call.weights = index_w_padded_.data();
  call.padded = padded;
  call.dim = dim;
  call.scale = 1.0f / std::sqrt(float(dim));
  call.topk = topk;
  call.selected = selected_.data();
  call.count = selected_count_.data();
  topk_.run(call, !attention_blocked());
}

bool attention_blocked() {
  static const bool blocked = [] {
    const char* v = std::getenv("COLIBRI_BLOCKED_ATTENTION");
    if (!v || std::string_view(v) == "1") return true;
    if (std::string_view(v) == "0") return false;
    fail("COLIBRI_BLOCKED_ATTENTION='{}' must be 0 (off) or 1 (on)", v);
  }();
  return blocked;
}

// The top-k set under a strict order (score, then position) is unique: selecting it in linear
// time gives what a partial sort would, then it is sorted by position.
void IndexerTopk::choose(const Call& call, int t, const float* scores, int* order) const {
  const int visible = call.rows[t].pos + 1, topk = call.topk;
  std::iota(order, order + visible, 0);
  std::nth_element(order, order + (topk - 1), order + visible, [&](int a, int b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  std::sort(order, order + topk);
  std::copy_n(order, topk, call.selected + size_t(t) * topk);
  call.count[t] = topk;
}

void IndexerTopk::run(const Call& call, bool by_rows) {
  if (by_rows || call.n < 2) return run_by_rows(call);
  for (int t0 = 0; t0 < call.n;) {
    int t1 = t0 + 1;
    while (t1 < call.n && call.rows[t1].seq == call.rows[t0].seq) ++t1;
    if (t1 - t0 < 2) {
      Call one = call;
      one.n = 1;
      one.rows += t0;
      one.q_t += size_t(t0) * call.dim * call.padded;
      one.weights += size_t(t0) * call.padded;
      one.selected += size_t(t0) * call.topk;
      one.count += t0;
      run_by_rows(one);
    } else {
      run_blocked(call, t0, t1);
    }
    t0 = t1;
  }
}

void IndexerTopk::run_by_rows(const Call& call) {
  const int n = call.n, topk = call.topk;
  int max_keys = 0;
  for (int t = 0; t < n; ++t) max_keys = std::max(max_keys, call.rows[t].pos + 1);
  const int threads = omp_get_max_threads();
  grow(scores_, size_t(threads) * size_t(max_keys));
  grow(order_, size_t(threads) * size_t(max_keys));
  grow(slots_, size_t(threads) * size_t(max_keys));
  const auto visible = [&](int t) { return call.rows[t].pos + 1; };
  // Row t's index scores of positions [begin, end).
  const auto score = [&](int t, int begin, int end, float* scores) {
    const int seq = call.rows[t].seq;
    int32_t* slots = &slots_[size_t(omp_get_thread_num()) * max_keys];
    for (int s = begin; s < end; ++s) slots[s] = call.kv->slot(seq, s);
    const kernels::IndexQuery query{call.q_t + size_t(t) * call.dim * call.padded,
                                    call.weights + size_t(t) * call.padded, call.padded, call.dim,
                                    call.scale};
    kernels::index_scores(query, call.keys, slots + begin, end - begin, scores + begin);
  };
  if (n >= threads) {  // a row per thread
#pragma omp parallel for schedule(dynamic)
    for (int t = 0; t < n; ++t) {
      if (visible(t) <= topk) {  // every visible key is selected
        call.count[t] = 0;
        continue;
      }
      const int thread = omp_get_thread_num();
      float* scores = &scores_[size_t(thread) * max_keys];
      score(t, 0, visible(t), scores);
      choose(call, t, scores, &order_[size_t(thread) * max_keys]);
    }
    return;
  }
  // Fewer rows than threads (decode): each row's keys are split across the threads.
  for (int t = 0; t < n; ++t) {
    call.count[t] = 0;
    if (visible(t) <= topk) continue;
#pragma omp parallel
    {
      const int parts = omp_get_num_threads(), part = omp_get_thread_num();
      const int64_t begin = int64_t(visible(t)) * part / parts;
      const int64_t end = int64_t(visible(t)) * (part + 1) / parts;
      score(t, int(begin), int(end), scores_.data());
    }
    choose(call, t, scores_.data(), order_.data());
  }
}

// Rows of a block share the key blocks: kIndexRowBlock rows' queries (16 KB each on GLM-5's 32
// heads x 128) stay in L2 while each block of kIndexKeyBlock keys (128 KB) is read once for them
// all, instead of every row streaming the whole key cache.
constexpr int kIndexRowBlock = 16;
constexpr int kIndexKeyBlock = 256;

void IndexerTopk::run_blocked(const Call& call, int t0, int t1) {
  const int topk = call.topk, seq = call.rows[t0].seq;
  scored_.clear();
  int visible = 0;
  for (int t = t0; t < t1; ++t) {
    call.count[t] = 0;
    if (call.rows[t].pos + 1 <= topk) continue;  // every visible key is selected
    scored_.push_back(t);
    visible = std::max(visible, call.rows[t].pos + 1);
  }
  const int rows = int(scored_.size());
  if (rows == 0) return;
  grow(slots_, size_t(visible));
  grow(scores_, size_t(rows) * size_t(visible));
  const int threads = omp_get_max_threads();
  grow(order_, size_t(threads) * size_t(visible));
  for (int s = 0; s < visible; ++s) slots_[size_t(s)] = call.kv->slot(seq, s);
  const int key_blocks = (visible + kIndexKeyBlock - 1) / kIndexKeyBlock;
  const int row_blocks = (rows + kIndexRowBlock - 1) / kIndexRowBlock;
#pragma omp parallel
  {
    // A row block's key blocks in turn: the threads share its queries.
#pragma omp for schedule(dynamic)
    for (int task = 0; task < row_blocks * key_blocks; ++task) {
      const int r0 = task / key_blocks * kIndexRowBlock, b = task % key_blocks;
      const int r1 = std::min(rows, r0 + kIndexRowBlock), begin = b * kIndexKeyBlock;
      for (int i = r0; i < r1; ++i) {
        const int t = scored_[size_t(i)];
        const int end = std::min(call.rows[t].pos + 1, begin + kIndexKeyBlock);
        if (end <= begin) continue;
        const kernels::IndexQuery query{call.q_t + size_t(t) * call.dim * call.padded,
                                        call.weights + size_t(t) * call.padded, call.padded,
                                        call.dim, call.scale};
        kernels::index_scores(query, call.keys, slots_.data() + begin, end - begin,
                              &scores_[size_t(i) * visible + begin]);
      }
    }
#pragma omp for schedule(dynamic)
    for (int i = 0; i < rows; ++i)
      choose(call, scored_[size_t(i)], &scores_[size_t(i) * visible],
             &order_[size_t(omp_get_thread_num()) * visible]);
  }
}

int CpuAttention::keys_of(int t, const int** selected) const {
  const int count = selected_count_[size_t(t)];
  *selected = count > 0 ? &selected_[size_t(t) * c_.index_topk] : nullptr;
  return count > 0 ? count : batch_->rows[size_t(t)].pos + 1;
}

// Row t's keys from the KvManager: the indexer's choice or 0..pos.
class CpuAttention::BatchKeys final : public KeySlots {
 public:
  explicit BatchKeys(const CpuAttention& a) : a_(a) {}
  int fill(int t, int32_t* slots) const override {
    const int* selected = nullptr;
    const int count = a_.keys_of(t, &selected);
    const int seq = a_.batch_->rows[size_t(t)].seq;
    for (int i = 0; i < count; ++i) slots[i] = a_.kv_.slot(seq, selected ? selected[i] : i);
    return count;
  }
  int dense_through(int t, int* seq) const override {
    if (a_.selected_count_[size_t(t)] > 0) return -1;
    *seq = a_.batch_->rows[size_t(t)].seq;
    return a_.batch_->rows[size_t(t)].pos;
  }

 private:
  const CpuAttention& a_;
};

void CpuAttention::start_remote_heads(const AttentionWeights& w) {
  const int n = batch_->size();
  // Rows of one sequence are consecutive; a table per sequence, in the order they come.
  if (table_of_seq_.size() < size_t(kv_.max_seqs()))
    table_of_seq_.assign(size_t(kv_.max_seqs()), -1);
  remote_rows_.resize(size_t(n));
  remote_offsets_.assign(1, 0);
  remote_blocks_.clear();
  remote_selected_.clear();
  for (int t = 0; t < n; ++t) {
    const BatchRow& row = batch_->rows[size_t(t)];
    int32_t& table = table_of_seq_[size_t(row.seq)];
    if (table < 0) {
      table = int32_t(remote_offsets_.size() - 1);
      const std::span<const int> blocks = kv_.block_list(row.seq);
      remote_blocks_.insert(remote_blocks_.end(), blocks.begin(), blocks.end());
      remote_offsets_.push_back(int32_t(remote_blocks_.size()));
    }
    const int* selected = nullptr;
    const int count = keys_of(t, &selected);
    if (selected) remote_selected_.insert(remote_selected_.end(), selected, selected + count);
    remote_rows_[size_t(t)] = {table, row.pos, selected ? count : 0};
  }
  for (int t = 0; t < n; ++t) table_of_seq_[size_t(batch_->rows[size_t(t)].seq)] = -1;
  RemoteHeads::Call call;
  call.n = n;
  call.rows = remote_rows_.data();
  call.q = q_.data();
  call.cache_rows = kv_a_.data();
  call.offsets = remote_offsets_.data();
  call.tables = int(remote_offsets_.size() - 1);
  call.blocks = remote_blocks_.data();
  call.selected = remote_selected_.data();
  w.remote_heads->start(call);
}

void CpuAttention::attend(int layer, const AttentionWeights& w) {
  const int n = batch_->size(), heads = c_.num_heads, dv = c_.v_head_dim;
  grow(heads_out_, size_t(n) * heads * dv);
  if (w.remote_heads) start_remote_heads(w);
  const BatchKeys keys(*this);
  MlaHeads::Call call;
  call.n = n;
  call.heads = w.remote_heads ? w.local_heads : heads;
  call.q = q_.data();
  call.q_stride = heads;
  call.kv_b = &w.kv_b_proj;
  call.latent = kv_.latent(layer);
  call.k_rope = kv_.k_rope(layer);
  call.keys = &keys;
  call.max_keys = max_keys_;
  call.out = heads_out_.data();
  call.out_stride = heads;
  heads_.run(call, !attention_blocked());
  if (w.remote_heads) w.remote_heads->finish(n, heads_out_.data());
}

namespace {

// Rows [t0, ..) of another KeySlots.
class OffsetKeys final : public KeySlots {
 public:
  OffsetKeys(const KeySlots& keys, int t0) : keys_(keys), t0_(t0) {}
  int fill(int t, int32_t* slots) const override { return keys_.fill(t0_ + t, slots); }
  int dense_through(int t, int* seq) const override { return keys_.dense_through(t0_ + t, seq); }

 private:
  const KeySlots& keys_;
  int t0_;
};

}  // namespace

// A model of fewer heads than a vector of columns: a row of chosen keys alone fills too little of
// the blocked products, and the row path is faster there (bench/attention_depth_bench on the
// embedded model's 4 heads). The model's heads decide, not a call's (a rank's share of them).
constexpr int kMlaBlockedHeads = 16;

void MlaHeads::run(const Call& call, bool by_rows) {
  if (by_rows || call.n < 2) return run_by_rows(call);
  if (c_.num_heads >= kMlaBlockedHeads) return run_blocked(call);
  // Runs of rows alike (every position, or chosen keys) in turn, each on its path.
  int seq = 0;
  for (int t0 = 0; t0 < call.n;) {
    const bool dense = call.keys->dense_through(t0, &seq) >= 0;
    int t1 = t0 + 1;
    while (t1 < call.n && (call.keys->dense_through(t1, &seq) >= 0) == dense) ++t1;
    const OffsetKeys keys(*call.keys, t0);
    Call part = call;
    part.n = t1 - t0;
    part.q += size_t(t0) * call.q_stride * c_.qk_head_dim();
    part.out += size_t(t0) * call.out_stride * c_.v_head_dim;
    part.keys = &keys;
    if (dense && part.n > 1)
      run_blocked(part);
    else
      run_by_rows(part);
    t0 = t1;
  }
}

void MlaHeads::run_by_rows(const Call& call) {
  const int n = call.n, heads = call.heads, dn = c_.qk_nope_head_dim;
  const int dr = c_.qk_rope_head_dim, dq = c_.qk_head_dim(), dv = c_.v_head_dim;
  const int r = c_.kv_lora_rank, max_keys = call.max_keys;
  const float scale = c_.softmax_scale();
  const float* latent = call.latent;
  const float* k_rope = call.k_rope;
  const Matrix& kv_b = *call.kv_b;
  if (heads == 0) return;
  // Heads in blocks of up to 8, a block per thread: each key's latent row is read once per block,
  // not once per head (at 1024 keys a layer's latent rows are 2.4 MB, beyond L2).
  const int threads = omp_get_max_threads();
  const int block = std::min(kHeadBlock, (heads + threads - 1) / threads);
  const int blocks = (heads + block - 1) / block;
  // Per thread and head of the block: q_abs [n, r], probabilities [max_keys], o_latent [r].
  const size_t per_head = size_t(n) * r + size_t(max_keys) + size_t(r);
  grow(scratch_, size_t(threads) * size_t(block) * per_head);
  grow(key_slots_, size_t(threads) * size_t(max_keys));

  // A head's absorbed W_UK and W_UV (dn and dv rows of kv_b_proj) are read from memory once per
  // call; W_UK's product takes every row of the batch in one pass (axpy_rows). Each head's sums
  // run in the same order as one head at a time.
#pragma omp parallel for schedule(static)
  for (int b = 0; b < blocks; ++b) {
    const int h0 = b * block, nh = std::min(block, heads - h0);
    float* base = &scratch_[size_t(omp_get_thread_num()) * size_t(block) * per_head];
    float* q_abs_all = base;                              // [nh][n][r]
    float* p_all = q_abs_all + size_t(nh) * n * r;        // [nh][max_keys]
    float* o_latent_all = p_all + size_t(nh) * max_keys;  // [nh][r]
    int32_t* slots = &key_slots_[size_t(omp_get_thread_num()) * max_keys];
    // q_abs = W_UK^T q_nope for every row and head: the queries in latent space.
    std::fill_n(q_abs_all, size_t(nh) * n * r, 0.0f);
    for (int h = 0; h < nh; ++h)
      kv_b_axpy_rows(kv_b, int64_t(h0 + h) * (dn + dv), dn, call.q + size_t(h0 + h) * dq,
                     int64_t(call.q_stride) * dq, n, q_abs_all + size_t(h) * n * r);
    for (int t = 0; t < n; ++t) {
      const int count = call.keys->fill(t, slots);
      const float* q = call.q + (size_t(t) * call.q_stride + h0) * dq;
      // Each key's latent and rope rows against the block's heads (dot_f32_rows: one dot_f32 per
      // head, bit for bit, reading the key's rows once for several heads).
      const float* q_latent[kHeadBlock];
      const float* q_rope[kHeadBlock];
      for (int h = 0; h < nh; ++h) {
        q_latent[h] = q_abs_all + (size_t(h) * n + t) * r;
        q_rope[h] = q + size_t(h) * dq + dn;
      }
      for (int i = 0; i < count; ++i) {
        const size_t s = size_t(slots[i]);
        float by_latent[kHeadBlock], by_rope[kHeadBlock];
        kernels::dot_f32_rows(q_latent, nh, latent + s * r, r, by_latent);
        kernels::dot_f32_rows(q_rope, nh, k_rope + s * dr, dr, by_rope);
        for (int h = 0; h < nh; ++h)
          p_all[size_t(h) * max_keys + i] = scale * (by_latent[h] + by_rope[h]);
      }
      for (int h = 0; h < nh; ++h) kernels::softmax(p_all + size_t(h) * max_keys, count);
      // o_latent = sum of p * latent over the keys, kKeysPerAxpy keys in one axpy_rows (the bits
      // of one axpy per head and key, in key order).
      std::fill_n(o_latent_all, size_t(nh) * r, 0.0f);
      for (int i = 0; i < count; i += kKeysPerAxpy) {
        const int keys = std::min(kKeysPerAxpy, count - i);
        const kernels::AxpyRows a{p_all + i, max_keys,     nh, keys,     r,
                                  nullptr,   o_latent_all, r,  slots + i};
        kernels::axpy_rows_f32(a, latent);
      }
      for (int h = 0; h < nh; ++h) {
        // Rows of W_UV [dv, r] for this head in kv_b_proj.
        const int64_t uv_row = int64_t(h0 + h) * (dn + dv) + dn;
        float* o = call.out + (size_t(t) * call.out_stride + h0 + h) * dv;
        for (int j = 0; j < dv; ++j)
          o[j] = kv_b_dot(kv_b, uv_row + j, o_latent_all + size_t(h) * r);
      }
    }
  }
}

// Rows of a call taken together (q_abs and o_latent held for them), keys per block (latent rows
// 2 KiB each at rank 512: a block of 64 is 128 KiB, in L2 for both products), and the columns
// (rows x heads) an item aims for: its queries in latent space [kv_lora_rank, columns] and its
// o_latent [columns, kv_lora_rank] stay in L2 across the key blocks.
constexpr int kMlaChunkRows = 64;
constexpr int kMlaKeyBlock = 64;
constexpr int kMlaColumns = 128;

void MlaHeads::run_blocked(const Call& call) {
  const int n = call.n, heads = call.heads, dn = c_.qk_nope_head_dim;
  const int dr = c_.qk_rope_head_dim, dq = c_.qk_head_dim(), dv = c_.v_head_dim;
  const int r = c_.kv_lora_rank;
  const Matrix& kv_b = *call.kv_b;
  if (heads == 0) return;
  const int threads = omp_get_max_threads();
  const int chunk_rows = std::min(n, kMlaChunkRows);
  grow(q_abs_, size_t(heads) * chunk_rows * r);
  grow(o_latent_, size_t(heads) * chunk_rows * r);
  // Per thread: queries [r + dr, columns], scores [block, columns], probabilities [columns,
  // block], o [columns, r], running max and sum [columns], the block's latent and rope rows.
  const int columns = std::max(kMlaColumns, heads);
  const size_t per_thread = size_t(r + dr) * columns + 2 * size_t(kMlaKeyBlock) * columns +
                            size_t(columns) * r + 2 * size_t(columns) +
                            size_t(kMlaKeyBlock) * (r + dr);
  grow(scratch_, size_t(threads) * per_thread);
  grow(key_slots_, size_t(threads) * size_t(call.max_keys));
  grow(limits_, size_t(threads) * columns);

  for (int c0 = 0; c0 < n; c0 += chunk_rows) {
    const int chunk = std::min(chunk_rows, n - c0);
    // q_abs = W_UK^T q_nope for the chunk's rows, head by head: the bits of the row path.
#pragma omp parallel for schedule(dynamic)
    for (int h = 0; h < heads; ++h) {
      float* q_abs = &q_abs_[size_t(h) * chunk_rows * r];
      std::fill_n(q_abs, size_t(chunk) * r, 0.0f);
      kv_b_axpy_rows(kv_b, int64_t(h) * (dn + dv), dn,
                     call.q + (size_t(c0) * call.q_stride + h) * dq, int64_t(call.q_stride) * dq,
                     chunk, q_abs);
    }
    // Items: a row of chosen keys alone; rows of one sequence that see every position together,
    // up to kMlaColumns columns. Heads split further when there are fewer items than threads.
    items_.clear();
    for (int t = c0; t < c0 + chunk;) {
      int seq = -1, next_seq = -1;
      Item item{t, 1, 0, heads, call.keys->dense_through(t, &seq) >= 0};
      if (item.dense) {
        const int most = std::max(1, kMlaColumns / heads);
        while (t + item.rows < c0 + chunk && item.rows < most &&
               call.keys->dense_through(t + item.rows, &next_seq) >= 0 && next_seq == seq)
          ++item.rows;
      }
      items_.push_back(item);
      t += item.rows;
    }
    const int parts = std::min(heads, (threads + int(items_.size()) - 1) / int(items_.size()));
    if (parts > 1) {
      const size_t whole = items_.size();
      for (size_t i = 0; i < whole; ++i)
        for (int p = 0; p < parts; ++p) {
          Item part = items_[i];
          part.h0 = heads * p / parts;
          part.heads = heads * (p + 1) / parts - part.h0;
          if (p == 0)
            items_[i] = part;
          else
            items_.push_back(part);
        }
    }
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < int(items_.size()); ++i) {
      const int thread = omp_get_thread_num();
      attend_item(call, items_[size_t(i)], c0, chunk_rows, &scratch_[size_t(thread) * per_thread],
                  &key_slots_[size_t(thread) * size_t(call.max_keys)],
                  &limits_[size_t(thread) * columns]);
    }
    // out = W_UV o_latent, head by head: each row of W_UV read once for the chunk's rows.
#pragma omp parallel for schedule(dynamic)
    for (int h = 0; h < heads; ++h) {
      const int64_t uv_row = int64_t(h) * (dn + dv) + dn;
      const float* o_latent = &o_latent_[size_t(h) * chunk_rows * r];
      for (int j = 0; j < dv; ++j)
        for (int t = 0; t < chunk; ++t)
          call.out[(size_t(c0 + t) * call.out_stride + h) * dv + j] =
              kv_b_dot(kv_b, uv_row + j, o_latent + size_t(t) * r);
    }
  }
}

void MlaHeads::attend_item(const Call& call, const Item& item, int c0, int chunk, float* scratch,
                           int32_t* slots, int* limit) {
  const int dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim, dq = c_.qk_head_dim();
  const int r = c_.kv_lora_rank, nh = item.heads, m = item.rows * nh;
  const float scale = c_.softmax_scale();
  const int columns = std::max(kMlaColumns, call.heads);
  float* q_latent = scratch;                          // [r, m]
  float* q_rope = q_latent + size_t(r) * columns;     // [dr, m]
  float* s = q_rope + size_t(dr) * columns;           // [block, m] scores
  float* p = s + size_t(kMlaKeyBlock) * columns;      // [m, block] probabilities
  float* o = p + size_t(kMlaKeyBlock) * columns;      // [m, r]
  float* most = o + size_t(columns) * r;              // [m] running max
  float* sum = most + columns;                        // [m] running sum
  float* latent = sum + columns;                      // [block, r]
  float* k_rope = latent + size_t(kMlaKeyBlock) * r;  // [block, dr]
  // Column c = row j of the item, head h: its queries, transposed.
  for (int j = 0; j < item.rows; ++j) {
    const int t = item.t0 + j;
    int seq = 0;
    const int pos = item.dense ? call.keys->dense_through(t, &seq) : -1;
    for (int h = 0; h < nh; ++h) {
      const int c = j * nh + h, head = item.h0 + h;
      const float* qa = &q_abs_[(size_t(head) * chunk + (t - c0)) * r];
      const float* qr = call.q + (size_t(t) * call.q_stride + head) * dq + dn;
      for (int d = 0; d < r; ++d) q_latent[size_t(d) * m + c] = qa[d];
      for (int d = 0; d < dr; ++d) q_rope[size_t(d) * m + c] = qr[d];
      limit[c] = pos;
    }
  }
  // The keys: the last row's (a dense item's rows see a prefix of them).
  const int keys = call.keys->fill(item.t0 + item.rows - 1, slots);
  for (int c = 0; c < m; ++c) {
    if (!item.dense) limit[c] = keys - 1;
    most[c] = -std::numeric_limits<float>::infinity();
    sum[c] = 0.0f;
  }
  std::fill_n(o, size_t(m) * r, 0.0f);
  for (int k0 = 0; k0 < keys; k0 += kMlaKeyBlock) {
    const int kb = std::min(kMlaKeyBlock, keys - k0);
    for (int i = 0; i < kb; ++i) {
      const size_t slot = size_t(slots[k0 + i]);
      std::copy_n(call.latent + slot * r, r, latent + size_t(i) * r);
      std::copy_n(call.k_rope + slot * dr, dr, k_rope + size_t(i) * dr);
    }
    // s[i, c] = latent_i . q_latent[:, c] + rope_i . q_rope[:, c]
    std::fill_n(s, size_t(kb) * m, 0.0f);
    kernels::axpy_rows_f32({latent, r, kb, r, m, nullptr, s, m, nullptr, false}, q_latent);
    kernels::axpy_rows_f32({k_rope, dr, kb, dr, m, nullptr, s, m, nullptr, false}, q_rope);
    for (int c = 0; c < m; ++c) {
      const int visible = std::min(kb, limit[c] - k0 + 1);  // keys of the block column c sees
      float* pc = p + size_t(c) * kMlaKeyBlock;
      if (visible <= 0) {
        std::fill_n(pc, kb, 0.0f);
        continue;
      }
      float block_most = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < visible; ++i)
        block_most = std::max(block_most, scale * s[size_t(i) * m + c]);
      if (block_most > most[c]) {
        const float factor = std::exp(most[c] - block_most);  // 0 for the first block
        if (sum[c] != 0.0f) {
          float* oc = o + size_t(c) * r;
          for (int d = 0; d < r; ++d) oc[d] *= factor;
        }
        sum[c] *= factor;
        most[c] = block_most;
      }
      float total = 0.0f;
      for (int i = 0; i < visible; ++i) {
        pc[i] = std::exp(scale * s[size_t(i) * m + c] - most[c]);
        total += pc[i];
      }
      for (int i = visible; i < kb; ++i) pc[i] = 0.0f;
      sum[c] += total;
    }
    // o[c, :] += sum over the block's keys of p[c, i] * latent_i
    kernels::axpy_rows_f32({p, kMlaKeyBlock, m, kb, r, nullptr, o, r, nullptr, false}, latent);
  }
  for (int j = 0; j < item.rows; ++j)
    for (int h = 0; h < nh; ++h) {
      const int c = j * nh + h;
      const float inv = 1.0f / sum[c];
      float* out = &o_latent_[(size_t(item.h0 + h) * chunk + (item.t0 + j - c0)) * r];
      for (int d = 0; d < r; ++d) out[d] = o[size_t(c) * r + d] * inv;
    }
}

}  // namespace colibri
