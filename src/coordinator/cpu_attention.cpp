#include "coordinator/cpu_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numeric>

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
  const int threads = omp_get_max_threads();
  grow(scratch_, size_t(threads) * size_t(max_keys_));
  grow(order_, size_t(threads) * size_t(max_keys_));
  grow(key_slots_, size_t(threads) * size_t(max_keys_));
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
  const float score_scale = 1.0f / std::sqrt(float(dim));
  const auto visible = [&](int t) { return batch_->rows[size_t(t)].pos + 1; };
  // Row t's index scores of positions [begin, end).
  const auto score = [&](int t, int begin, int end, float* scores) {
    const int seq = batch_->rows[size_t(t)].seq;
    int32_t* slots = &key_slots_[size_t(omp_get_thread_num()) * max_keys_];
    for (int s = begin; s < end; ++s) slots[s] = kv_.slot(seq, s);
    const kernels::IndexQuery query{&index_q_t_[size_t(t) * dim * padded],
                                    &index_w_padded_[size_t(t) * padded], padded, dim, score_scale};
    kernels::index_scores(query, keys, slots + begin, end - begin, scores + begin);
  };
  // The top-k set under a strict order (score, then position) is unique: selecting it in linear
  // time gives what a partial sort would, then it is sorted by position.
  const auto choose = [&](int t, const float* scores, int* order) {
    std::iota(order, order + visible(t), 0);
    std::nth_element(order, order + (topk - 1), order + visible(t), [&](int a, int b) {
      return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    });
    std::sort(order, order + topk);
    std::copy_n(order, topk, &selected_[size_t(t) * topk]);
    selected_count_[size_t(t)] = topk;
  };
  if (n >= threads) {  // a row per thread
#pragma omp parallel for schedule(dynamic)
    for (int t = 0; t < n; ++t) {
      if (visible(t) <= topk) {  // every visible key is selected
        selected_count_[size_t(t)] = 0;
        continue;
      }
      const int thread = omp_get_thread_num();
      float* scores = &scratch_[size_t(thread) * max_keys_];
      score(t, 0, visible(t), scores);
      choose(t, scores, &order_[size_t(thread) * max_keys_]);
    }
    return;
  }
  // Fewer rows than threads (decode): each row's keys are split across the threads.
  for (int t = 0; t < n; ++t) {
    selected_count_[size_t(t)] = 0;
    if (visible(t) <= topk) continue;
#pragma omp parallel
    {
      const int parts = omp_get_num_threads(), part = omp_get_thread_num();
      const int64_t begin = int64_t(visible(t)) * part / parts;
      const int64_t end = int64_t(visible(t)) * (part + 1) / parts;
      score(t, int(begin), int(end), scratch_.data());
    }
    choose(t, scratch_.data(), order_.data());
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
  heads_.run(call);
  if (w.remote_heads) w.remote_heads->finish(n, heads_out_.data());
}

void MlaHeads::run(const Call& call) {
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

}  // namespace colibri
