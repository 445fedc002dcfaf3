#include "oracle/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "cpu/elementwise.h"
#include "cpu/linear.h"

namespace colibri {

using kernels::dot_f32;
using kernels::linear_f32;

MlaAttention::MlaAttention(const ModelConfig& config, const Rope& rope) : c_(config), rope_(rope) {}

void MlaAttention::forward(int layer, const AttentionWeights& w, const float* x, int n, int start,
                           LayerKvCache& cache, KeySelection& selection, float* out) const {
  const double start_us = profiler_ ? profiler_->now_us() : 0;
  double indexer_us = 0;
  const int heads = c_.num_heads, dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim;
  const int dq = c_.qk_head_dim(), r = c_.kv_lora_rank, h = c_.hidden_size;

  std::vector<float> q(size_t(n) * heads * dq);  // [n, H, nope | rope]
  std::vector<float> q_lora;                     // [n, q_lora_rank], normalised; feeds the indexer
  if (c_.q_lora_rank > 0) {
    q_lora.resize(size_t(n) * c_.q_lora_rank);
    linear_f32(x, n, w.q_a_proj.data.data(), c_.q_lora_rank, h, q_lora.data());
    kernels::rms_norm(q_lora.data(), n, c_.q_lora_rank, w.q_a_norm.data(), c_.mla_norm_eps,
                      q_lora.data());
    linear_f32(q_lora.data(), n, w.q_b_proj.data.data(), int64_t(heads) * dq, c_.q_lora_rank,
               q.data());
  } else {
    linear_f32(x, n, w.q_proj.data.data(), int64_t(heads) * dq, h, q.data());
  }

  std::vector<float> kv_a(size_t(n) * (r + dr));  // [n, latent | k_rope]
  linear_f32(x, n, w.kv_a_proj.data.data(), r + dr, h, kv_a.data());
  for (int t = 0; t < n; ++t) {
    const int pos = start + t;
    float* row = &kv_a[size_t(t) * (r + dr)];
    kernels::rms_norm(row, 1, r, w.kv_a_norm.data(), c_.mla_norm_eps, row);
    rope_.apply(row + r, pos, c_.rope.interleave);
    cache.latent.insert(cache.latent.end(), row, row + r);
    cache.k_rope.insert(cache.k_rope.end(), row + r, row + r + dr);
    for (int head = 0; head < heads; ++head)
      rope_.apply(&q[(size_t(t) * heads + head) * dq + dn], pos, c_.rope.interleave);
  }

  if (w.indexer) {
    const double indexer_start_us = profiler_ ? profiler_->now_us() : 0;
    select_keys(*w.indexer, x, q_lora.data(), n, start, cache, selection);
    if (profiler_) {
      indexer_us = profiler_->now_us() - indexer_start_us;
      profiler_->add(Phase::kIndexer, layer, indexer_start_us, indexer_us);
    }
  }

  std::vector<float> heads_out(size_t(n) * heads * c_.v_head_dim);
  if (n == 1) {
    attend_absorbed(w, q.data(), n, start, cache, selection, heads_out.data());
  } else {
    attend_expanded(w, q.data(), n, start, cache, selection, heads_out.data());
  }
  linear_f32(heads_out.data(), n, w.o_proj.data.data(), h, int64_t(heads) * c_.v_head_dim, out);
  if (profiler_)
    profiler_->add(Phase::kAttention, layer, start_us, profiler_->now_us() - start_us - indexer_us);
}

std::vector<int> MlaAttention::visible_keys(const KeySelection& selection, int t, int pos) const {
  if (size_t(t) < selection.keys.size() && !selection.keys[size_t(t)].empty())
    return selection.keys[size_t(t)];
  std::vector<int> keys(size_t(pos) + 1);
  std::iota(keys.begin(), keys.end(), 0);
  return keys;
}

void MlaAttention::select_keys(const IndexerWeights& w, const float* x, const float* q_lora, int n,
                               int start, LayerKvCache& cache, KeySelection& selection) const {
  const int heads = c_.index_n_heads, dim = c_.index_head_dim;
  const int h = c_.hidden_size;
  std::vector<float> q(size_t(n) * heads * dim);
  linear_f32(q_lora, n, w.wq_b.data.data(), int64_t(heads) * dim, c_.q_lora_rank, q.data());
  std::vector<float> k(size_t(n) * dim);
  linear_f32(x, n, w.wk.data.data(), dim, h, k.data());
  kernels::layer_norm(k.data(), n, dim, w.k_norm_weight.data(), w.k_norm_bias.data(), 1e-6f,
                      k.data());
  std::vector<float> head_weights(size_t(n) * heads);
  linear_f32(x, n, w.weights_proj.data.data(), heads, h, head_weights.data());
  const float head_scale = 1.0f / std::sqrt(float(heads));
  for (float& v : head_weights) v *= head_scale;

  for (int t = 0; t < n; ++t) {
    const int pos = start + t;
    rope_.apply(&k[size_t(t) * dim], pos, c_.rope.interleave);  // rope on the FIRST dr dims
    for (int head = 0; head < heads; ++head)
      rope_.apply(&q[(size_t(t) * heads + head) * dim], pos, c_.rope.interleave);
  }
  cache.index_k.insert(cache.index_k.end(), k.begin(), k.end());

  const float score_scale = 1.0f / std::sqrt(float(dim));
  selection.keys.assign(size_t(n), {});
#pragma omp parallel for schedule(dynamic)
  for (int t = 0; t < n; ++t) {
    const int pos = start + t;
    if (pos + 1 <= c_.index_topk) continue;  // every visible key is selected
    std::vector<float> scores(size_t(pos) + 1);
    for (int s = 0; s <= pos; ++s) {
      float score = 0.0f;
      for (int head = 0; head < heads; ++head) {
        const float qk =
            dot_f32(&q[(size_t(t) * heads + head) * dim], &cache.index_k[size_t(s) * dim], dim);
        score += head_weights[size_t(t) * heads + head] * std::max(qk * score_scale, 0.0f);
      }
      scores[size_t(s)] = score;
    }
    std::vector<int> order(scores.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + c_.index_topk, order.end(), [&](int a, int b) {
      return scores[size_t(a)] > scores[size_t(b)] ||
             (scores[size_t(a)] == scores[size_t(b)] && a < b);
    });
    order.resize(size_t(c_.index_topk));
    std::sort(order.begin(), order.end());
    selection.keys[size_t(t)] = std::move(order);
  }
}

void MlaAttention::attend_expanded(const AttentionWeights& w, const float* q, int n, int start,
                                   const LayerKvCache& cache, const KeySelection& selection,
                                   float* heads_out) const {
  const int heads = c_.num_heads, dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim;
  const int dq = c_.qk_head_dim(), dv = c_.v_head_dim, r = c_.kv_lora_rank;
  const int tokens = start + n;
  const int kv_width = heads * (dn + dv);
  std::vector<float> kv(size_t(tokens) * kv_width);  // [tokens, H, k_nope | v]
  linear_f32(cache.latent.data(), tokens, w.kv_b_proj.data.data(), kv_width, r, kv.data());
  const float scale = c_.softmax_scale();

#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int t = 0; t < n; ++t) {
    for (int head = 0; head < heads; ++head) {
      const std::vector<int> keys = visible_keys(selection, t, start + t);
      const float* q_head = q + (size_t(t) * heads + head) * dq;
      std::vector<float> p(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        const size_t s = size_t(keys[i]);
        const float* k_nope = &kv[s * kv_width + size_t(head) * (dn + dv)];
        p[i] =
            scale * (dot_f32(q_head, k_nope, dn) + dot_f32(q_head + dn, &cache.k_rope[s * dr], dr));
      }
      kernels::softmax(p.data(), int64_t(p.size()));
      float* o = heads_out + (size_t(t) * heads + head) * dv;
      std::fill(o, o + dv, 0.0f);
      for (size_t i = 0; i < keys.size(); ++i) {
        const float* v = &kv[size_t(keys[i]) * kv_width + size_t(head) * (dn + dv) + dn];
        for (int j = 0; j < dv; ++j) o[j] += p[i] * v[j];
      }
    }
  }
}

void MlaAttention::attend_absorbed(const AttentionWeights& w, const float* q, int n, int start,
                                   const LayerKvCache& cache, const KeySelection& selection,
                                   float* heads_out) const {
  const int heads = c_.num_heads, dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim;
  const int dq = c_.qk_head_dim(), dv = c_.v_head_dim, r = c_.kv_lora_rank;
  const float scale = c_.softmax_scale();

#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int t = 0; t < n; ++t) {
    for (int head = 0; head < heads; ++head) {
      const std::vector<int> keys = visible_keys(selection, t, start + t);
      const float* q_head = q + (size_t(t) * heads + head) * dq;
      const float* w_uk = &w.kv_b_proj.data[size_t(head) * (dn + dv) * r];  // [dn, r]
      const float* w_uv = w_uk + size_t(dn) * r;                            // [dv, r]
      // q_abs = W_UK^T q_nope: the query in latent space.
      std::vector<float> q_abs(size_t(r), 0.0f);
      for (int i = 0; i < dn; ++i)
        kernels::axpy_f32(q_head[i], w_uk + size_t(i) * r, q_abs.data(), r);
      std::vector<float> p(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        const size_t s = size_t(keys[i]);
        p[i] = scale * (dot_f32(q_abs.data(), &cache.latent[s * r], r) +
                        dot_f32(q_head + dn, &cache.k_rope[s * dr], dr));
      }
      kernels::softmax(p.data(), int64_t(p.size()));
      std::vector<float> o_latent(size_t(r), 0.0f);
      for (size_t i = 0; i < keys.size(); ++i)
        kernels::axpy_f32(p[i], &cache.latent[size_t(keys[i]) * r], o_latent.data(), r);
      float* o = heads_out + (size_t(t) * heads + head) * dv;
      for (int j = 0; j < dv; ++j) o[j] = dot_f32(w_uv + size_t(j) * r, o_latent.data(), r);
    }
  }
}

}  // namespace colibri
