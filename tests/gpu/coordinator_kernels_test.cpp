// The CUDA coordinator's kernels, each against its CPU oracle: kernels/cpu (norms, elementwise,
// linear), Rope::apply, route_tokens, and CpuAttention's absorbed attention and indexer selection
// written out over a KvManager block table. Each bound is stated where it is checked. Skips
// without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/buffer.h"
#include "common/dtype.h"
#include "coordinator/gpu_staging.h"
#include "coordinator/kv_manager.h"
#include "cpu/elementwise.h"
#include "cpu/linear.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/dsa_indexer.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/gemm.h"
#include "cuda/mla_attention.cuh"
#include "cuda/norm.cuh"
#include "cuda/rope.cuh"
#include "cuda/router.cuh"
#include "model/rope.h"
#include "moe/router.h"

namespace colibri {
namespace {

// A device copy of a host vector; read() brings it back.
template <typename T>
class Dev {
 public:
  explicit Dev(size_t count) : count_(count) {
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<size_t>(count, 1) * sizeof(T)));
    CHECK_CUDA(cudaMemset(p_, 0xff, std::max<size_t>(count, 1) * sizeof(T)));  // NaN / -1
  }
  explicit Dev(const std::vector<T>& host) : Dev(host.size()) {
    CHECK_CUDA(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  T* get() { return p_; }
  std::vector<T> read() const {
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> host(count_);
    CHECK_CUDA(cudaMemcpy(host.data(), p_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* p_ = nullptr;
  size_t count_;
};

std::vector<float> random_vector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

class CoordinatorKernels : public testing::Test {
 protected:
  void SetUp() override {
    std::string why_none;
    if (cuda::device_count(&why_none) == 0) GTEST_SKIP() << "no CUDA device: " << why_none;
  }
};

// fp32 sums in another order: within 1e-5 of the row's scale.
TEST_F(CoordinatorKernels, NormsMatchTheCpu) {
  const int n = 5, d = 300;
  const std::vector<float> x = random_vector(size_t(n) * d, 1, 3.0f), w = random_vector(d, 2);
  const std::vector<float> b = random_vector(d, 3);
  std::vector<float> rms(x.size()), ln(x.size());
  kernels::rms_norm(x.data(), n, d, w.data(), 1e-6f, rms.data());
  kernels::layer_norm(x.data(), n, d, w.data(), b.data(), 1e-6f, ln.data());
  Dev<float> dx(x), dw(w), db(b), dy(x.size()), dz(x.size());
  // Gathered rows in reverse order, as the lm_head's final norm takes them.
  const std::vector<int> rows = {4, 3, 2, 1, 0};
  Dev<int> drows(rows);
  cuda::rms_norm(dx.get(), d, drows.get(), n, d, dw.get(), 1e-6f, dy.get(), d, nullptr);
  cuda::layer_norm(dx.get(), n, d, dw.get(), db.get(), 1e-6f, dz.get(), nullptr);
  const std::vector<float> gpu_rms = dy.read(), gpu_ln = dz.read();
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      EXPECT_NEAR(gpu_rms[size_t(t) * d + i], rms[size_t(rows[size_t(t)]) * d + i], 1e-5f);
      EXPECT_NEAR(gpu_ln[size_t(t) * d + i], ln[size_t(t) * d + i], 1e-5f);
    }
}

TEST_F(CoordinatorKernels, ElementwiseMatchTheCpu) {
  const size_t count = 1000;
  const std::vector<float> a = random_vector(count, 4, 4.0f), b = random_vector(count, 5);
  Dev<float> da(a), db(b), dy(a), dz(a), dg(a);
  cuda::add(dy.get(), db.get(), int64_t(count), nullptr);
  cuda::add_sum(dz.get(), da.get(), db.get(), int64_t(count), nullptr);
  cuda::silu_mul(dg.get(), db.get(), int64_t(count), nullptr);
  Dev<uint16_t> dhi(count), dlo(count);
  cuda::split_bf16(da.get(), int64_t(count), dhi.get(), dlo.get(), nullptr);
  std::vector<float> halves(a);
  halves.insert(halves.end(), b.begin(), b.end());
  Dev<float> dhalves(halves), dsum(count);
  cuda::add_halves(dhalves.get(), int64_t(count), dsum.get(), nullptr);
  std::vector<float> silu = a;
  kernels::silu_mul(silu.data(), b.data(), int64_t(count));
  const std::vector<float> y = dy.read(), z = dz.read(), g = dg.read();
  const std::vector<uint16_t> hi = dhi.read(), lo = dlo.read();
  const std::vector<float> sum = dsum.read();
  for (size_t i = 0; i < count; ++i) {
    EXPECT_EQ(y[i], a[i] + b[i]);  // one IEEE add: exact
    EXPECT_EQ(z[i], a[i] + (a[i] + b[i]));
    EXPECT_NEAR(g[i], silu[i], 1e-6f * (1 + std::fabs(silu[i])));  // expf vs std::exp
    EXPECT_EQ(hi[i], f32_to_bf16(a[i]));
    EXPECT_EQ(lo[i], f32_to_bf16(a[i] - bf16_to_f32(hi[i])));
    // hi + lo: 16 significant bits of a.
    EXPECT_NEAR(bf16_to_f32(hi[i]) + bf16_to_f32(lo[i]), a[i], std::ldexp(std::fabs(a[i]), -16));
    EXPECT_EQ(sum[i], a[i] + b[i]);
  }
  // Embedding gather: exact widening of BF16.
  const int hidden = 16;
  std::vector<uint16_t> table(size_t(10) * hidden);
  for (size_t i = 0; i < table.size(); ++i) table[i] = f32_to_bf16(a[i]);
  const std::vector<int> tokens = {7, 0, 9, 7};
  Dev<uint16_t> dtable(table);
  Dev<int> dtokens(tokens);
  Dev<float> dh2(tokens.size() * hidden);
  cuda::embed(dtokens.get(), int64_t(tokens.size()), dtable.get(), nullptr, hidden, dh2.get(),
              nullptr);
  const std::vector<float> embedded = dh2.read();
  for (size_t t = 0; t < tokens.size(); ++t)
    for (int j = 0; j < hidden; ++j)
      EXPECT_EQ(embedded[t * hidden + size_t(j)],
                bf16_to_f32(table[size_t(tokens[t]) * hidden + size_t(j)]));
  // The non-finite flag: clear on finite values, set by one NaN.
  Dev<int> flag(std::vector<int>{0});
  cuda::flag_non_finite(da.get(), int64_t(count), flag.get(), nullptr);
  EXPECT_EQ(flag.read()[0], 0);
  std::vector<float> bad = a;
  bad[count / 2] = std::nanf("");
  Dev<float> dbad(bad);
  cuda::flag_non_finite(dbad.get(), int64_t(count), flag.get(), nullptr);
  EXPECT_EQ(flag.read()[0], 1);
}

// cosf/sinf and std::cos/std::sin of the same float angle: each within an ulp or two.
TEST_F(CoordinatorKernels, RopeMatchesRopeApply) {
  RopeConfig config;
  config.theta = 10000;
  config.yarn = true;
  config.factor = 40;
  config.original_max_position_embeddings = 4096;
  config.mscale = 1;
  config.mscale_all_dim = 1;
  for (const bool interleave : {true, false}) {
    const int dim = 64, heads = 3, n = 4;
    const Rope rope(config, dim);
    const std::vector<int> pos = {0, 1, 777, 40000};
    std::vector<float> x = random_vector(size_t(n) * heads * dim, 6);
    Dev<float> dx(x), dfreq(rope.inv_freq());
    Dev<int> dpos(pos);
    cuda::rope(dx.get(), n, heads, int64_t(heads) * dim, dim, dim, dpos.get(), dfreq.get(),
               rope.attention_factor(), interleave, nullptr);
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < heads; ++h)
        rope.apply(&x[(size_t(t) * heads + h) * dim], pos[size_t(t)], interleave);
    const std::vector<float> gpu = dx.read();
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(gpu[i], x[i], 2e-5f) << i;
  }
}

// BF16 operands, fp32 accumulation: against the CPU's fp32 product of the same BF16 values,
// within 1e-5 of sum |x||w| (summation order only).
TEST_F(CoordinatorKernels, GemmsMatchTheCpuOnBf16Operands) {
  const int n = 3, rows = 70, cols = 96;
  std::vector<float> x = random_vector(size_t(n) * cols, 7),
                     w = random_vector(size_t(rows) * cols, 8);
  std::vector<uint16_t> xb(x.size()), wb(w.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_f32(xb[i] = f32_to_bf16(x[i]));
  for (size_t i = 0; i < w.size(); ++i) w[i] = bf16_to_f32(wb[i] = f32_to_bf16(w[i]));
  std::vector<float> y(size_t(n) * rows);
  kernels::linear_f32(x.data(), n, w.data(), rows, cols, y.data());
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  {
    cuda::Blas blas(stream);
    Dev<uint16_t> dx(xb), dw(wb);
    Dev<float> dy(y.size()), dxf(x), dwf(w), dyf(y.size());
    cuda::gemm_bf16(blas, dx.get(), n, dw.get(), rows, cols, dy.get());
    cuda::gemm_f32(blas, dxf.get(), n, dwf.get(), rows, cols, dyf.get());
    const std::vector<float> gpu = dy.read(), gpu_f32 = dyf.read();
    for (size_t i = 0; i < y.size(); ++i) {
      EXPECT_NEAR(gpu[i], y[i], 1e-5f * cols);
      EXPECT_NEAR(gpu_f32[i], y[i], 1e-5f * cols);
    }
    // Per-head products as MLA's absorbed form runs them: heads of q [n, heads, dq] (first dn)
    // times rows of a [heads * (dn + dv), r] matrix, and back through the dv rows transposed.
    const int heads = 4, dn = 8, dv = 6, dq = 12, r = 16;
    std::vector<float> q = random_vector(size_t(n) * heads * dq, 9),
                       kvb = random_vector(size_t(heads) * (dn + dv) * r, 10);
    std::vector<uint16_t> qb(q.size()), kvbb(kvb.size());
    for (size_t i = 0; i < q.size(); ++i) q[i] = bf16_to_f32(qb[i] = f32_to_bf16(q[i]));
    for (size_t i = 0; i < kvb.size(); ++i) kvb[i] = bf16_to_f32(kvbb[i] = f32_to_bf16(kvb[i]));
    Dev<uint16_t> dq_(qb), dkvb(kvbb);
    Dev<float> dabs(size_t(n) * heads * r);
    cuda::gemm_batched(blas, true, heads, n, r, dn, dq_.get(), int64_t(heads) * dq, dq, dkvb.get(),
                       r, int64_t(dn + dv) * r, false, dabs.get(), int64_t(heads) * r, r);
    std::vector<uint16_t> lat(size_t(n) * heads * r);
    for (size_t i = 0; i < lat.size(); ++i) lat[i] = qb[i % qb.size()];
    Dev<uint16_t> dlat(lat);
    Dev<float> dout(size_t(n) * heads * dv);
    cuda::gemm_batched(blas, true, heads, n, dv, r, dlat.get(), int64_t(heads) * r, r,
                       dkvb.get() + int64_t(dn) * r, r, int64_t(dn + dv) * r, true, dout.get(),
                       int64_t(heads) * dv, dv);
    const std::vector<float> abs_gpu = dabs.read(), out_gpu = dout.read();
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < r; ++j) {
          float expect = 0;
          for (int i = 0; i < dn; ++i)
            expect +=
                q[(size_t(t) * heads + h) * dq + i] * kvb[(size_t(h) * (dn + dv) + i) * r + j];
          EXPECT_NEAR(abs_gpu[(size_t(t) * heads + h) * r + j], expect, 1e-5f * dn);
        }
        for (int j = 0; j < dv; ++j) {
          float expect = 0;
          for (int i = 0; i < r; ++i)
            expect += bf16_to_f32(lat[(size_t(t) * heads + h) * r + i]) *
                      kvb[(size_t(h) * (dn + dv) + dn + j) * r + i];
          EXPECT_NEAR(out_gpu[(size_t(t) * heads + h) * dv + j], expect, 1e-5f * r);
        }
      }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
}

// Exact: the same sigmoid inputs (router logits from the CPU), the same tie order. Weights
// within 1e-6 relative (expf vs std::exp).
TEST_F(CoordinatorKernels, RouterMatchesRouteTokens) {
  for (const int groups : {1, 4}) {
    ModelConfig c;
    c.hidden_size = 32;
    c.n_routed_experts = 64;
    c.num_experts_per_tok = 6;
    c.n_group = groups;
    c.topk_group = groups > 1 ? 2 : 1;
    c.norm_topk_prob = true;
    c.routed_scaling_factor = 2.5f;
    LayerWeights layer;
    layer.router.rows = c.n_routed_experts;
    layer.router.cols = c.hidden_size;
    layer.router.data = random_vector(size_t(c.n_routed_experts) * c.hidden_size, 11);
    layer.router_bias = random_vector(size_t(c.n_routed_experts), 12, 0.1f);
    const int n = 37;
    const std::vector<float> x = random_vector(size_t(n) * c.hidden_size, 13);
    const Routing expect = route_tokens(c, layer, x.data(), n);
    std::vector<float> logits(size_t(n) * c.n_routed_experts);
    kernels::linear_f32(x.data(), n, layer.router.data.data(), c.n_routed_experts, c.hidden_size,
                        logits.data());
    Dev<float> dlogits(logits), dbias(layer.router_bias), scratch(logits.size() * 2);
    Dev<int> dexpert(expect.expert.size());
    Dev<float> dweight(expect.weight.size());
    cuda::RouterArgs a;
    a.logits = dlogits.get();
    a.bias = dbias.get();
    a.n = n;
    a.experts = c.n_routed_experts;
    a.groups = c.n_group;
    a.topk_group = c.topk_group;
    a.top_k = c.num_experts_per_tok;
    a.norm_topk_prob = c.norm_topk_prob;
    a.routed_scaling_factor = c.routed_scaling_factor;
    a.scratch = scratch.get();
    a.expert = dexpert.get();
    a.weight = dweight.get();
    cuda::route(a, nullptr);
    EXPECT_EQ(dexpert.read(), expect.expert) << groups << " groups";
    const std::vector<float> weight = dweight.read();
    for (size_t i = 0; i < weight.size(); ++i)
      EXPECT_NEAR(weight[i], expect.weight[i], 1e-6f * std::fabs(expect.weight[i]));
  }
}

// A KV pool with two sequences whose blocks interleave, as the engine's batches have them.
struct TwoSequences {
  ModelConfig config;
  std::unique_ptr<KvManager> kv;
  Batch batch;
  BlockTable table;
  explicit TwoSequences(int len_a, int len_b) {
    config.kv_lora_rank = 32;
    config.qk_rope_head_dim = 16;
    config.num_layers = 1;
    config.max_position_embeddings = 4096;
    config.layer_is_moe = {false};
    kv = std::make_unique<KvManager>(config, 2048, 2, 4);
    const int a = kv->open(), b = kv->open();
    for (int step = 4; step <= std::max(len_a, len_b); step += 4) {  // interleave the blocks
      kv->reserve(a, std::min(step, len_a));
      kv->reserve(b, std::min(step, len_b));
    }
    // The last rows of each: two of a (prefill), one of b (decode).
    batch.add(a, 0, len_a - 2, true);
    batch.add(a, 0, len_a - 1, true);
    batch.add(b, 0, len_b - 1, true);
    table = pack_block_table(batch, *kv);
  }
};

// fp32 scores and online softmax against CpuAttention's two-pass softmax: within 1e-5 relative
// plus 1e-6 (exp and summation order).
TEST_F(CoordinatorKernels, MlaAttendMatchesTheCpuLoop) {
  TwoSequences s(37, 21);
  const int n = s.batch.size(), heads = 3, r = 32, dr = 16, dn = 8, dq = dn + dr;
  const int slots = s.kv->capacity_tokens(), topk = 5;
  const float scale = 0.3f;
  const std::vector<float> q_abs = random_vector(size_t(n) * heads * r, 14);
  const std::vector<float> q = random_vector(size_t(n) * heads * dq, 15);
  const std::vector<float> latent = random_vector(size_t(slots) * r, 16);
  const std::vector<float> k_rope = random_vector(size_t(slots) * dr, 17);
  // Row 0 attends to a chosen few positions; the others to all of theirs.
  std::vector<int> selected(size_t(n) * topk, -1), count(size_t(n), 0);
  for (int i = 0; i < topk; ++i) selected[size_t(i)] = 3 * i + 1;
  count[0] = topk;
  Dev<float> dqa(q_abs), dq_(q), dlat(latent), dkr(k_rope);
  Dev<int> dblocks(s.table.blocks), dseq(s.table.row_seq), dpos(s.table.row_pos);
  Dev<int> dsel(selected), dcount(count);
  Dev<float> dout(size_t(n) * heads * r);
  cuda::MlaAttend a;
  a.q_abs = dqa.get();
  a.q = dq_.get();
  a.latent = dlat.get();
  a.k_rope = dkr.get();
  a.kv = {dblocks.get(), dseq.get(), dpos.get(), s.table.max_blocks, s.table.block_tokens};
  a.selected = dsel.get();
  a.selected_count = dcount.get();
  a.topk = topk;
  a.n = n;
  a.heads = heads;
  a.r = r;
  a.dr = dr;
  a.dq = dq;
  a.dn = dn;
  a.scale = scale;
  a.out = dout.get();
  cuda::mla_attend(a, nullptr);
  const std::vector<float> out = dout.read();
  for (int t = 0; t < n; ++t) {
    const BatchRow& row = s.batch.rows[size_t(t)];
    const int keys = count[size_t(t)] > 0 ? count[size_t(t)] : row.pos + 1;
    for (int h = 0; h < heads; ++h) {
      std::vector<float> p(static_cast<size_t>(keys)), o(static_cast<size_t>(r), 0.0f);
      for (int i = 0; i < keys; ++i) {
        const size_t slot =
            size_t(s.kv->slot(row.seq, count[size_t(t)] > 0 ? selected[size_t(i)] : i));
        p[size_t(i)] =
            scale *
            (kernels::dot_f32(&q_abs[(size_t(t) * heads + h) * r], &latent[slot * r], r) +
             kernels::dot_f32(&q[(size_t(t) * heads + h) * dq + dn], &k_rope[slot * dr], dr));
      }
      kernels::softmax(p.data(), keys);
      for (int i = 0; i < keys; ++i) {
        const size_t slot =
            size_t(s.kv->slot(row.seq, count[size_t(t)] > 0 ? selected[size_t(i)] : i));
        kernels::axpy_f32(p[size_t(i)], &latent[slot * r], o.data(), r);
      }
      for (int j = 0; j < r; ++j) {
        const float gpu = out[(size_t(t) * heads + h) * r + j];
        EXPECT_NEAR(gpu, o[size_t(j)], 1e-5f * std::fabs(o[size_t(j)]) + 1e-6f)
            << "row " << t << " head " << h << " dim " << j;
      }
    }
  }
}

// Indexer scores within 1e-5 relative of the CPU's (summation order); the top-k exact on given
// scores, ties included (equal scores go to the lower position, as the CPU's strict order).
TEST_F(CoordinatorKernels, IndexerScoresAndTopkMatchTheCpu) {
  TwoSequences s(40, 9);
  const int n = s.batch.size(), heads = 4, dim = 32, topk = 8, dr = 16;
  (void)dr;
  const int slots = s.kv->capacity_tokens(), max_keys = s.table.max_keys;
  const std::vector<float> q = random_vector(size_t(n) * heads * dim, 18);
  const std::vector<float> w = random_vector(size_t(n) * heads, 19);
  const std::vector<float> keys = random_vector(size_t(slots) * dim, 20);
  Dev<float> dq_(q), dw(w), dkeys(keys), dscores(size_t(n) * max_keys);
  Dev<int> dblocks(s.table.blocks), dseq(s.table.row_seq), dpos(s.table.row_pos);
  cuda::IndexerScores a;
  a.q = dq_.get();
  a.w = dw.get();
  a.keys = dkeys.get();
  a.kv = {dblocks.get(), dseq.get(), dpos.get(), s.table.max_blocks, s.table.block_tokens};
  a.n = n;
  a.heads = heads;
  a.dim = dim;
  a.topk = topk;
  a.score_scale = 1.0f / std::sqrt(float(dim));
  a.head_scale = 1.0f / std::sqrt(float(heads));
  a.scores = dscores.get();
  a.max_keys = max_keys;
  cuda::indexer_scores(a, nullptr);
  const std::vector<float> scores = dscores.read();
  for (int t = 0; t < n; ++t) {
    const BatchRow& row = s.batch.rows[size_t(t)];
    if (row.pos + 1 <= topk) continue;
    for (int p = 0; p <= row.pos; ++p) {
      const float* key = &keys[size_t(s.kv->slot(row.seq, p)) * dim];
      float expect = 0;
      for (int h = 0; h < heads; ++h) {
        const float qk = kernels::dot_f32(&q[(size_t(t) * heads + h) * dim], key, dim);
        expect += w[size_t(t) * heads + h] * a.head_scale * std::max(qk * a.score_scale, 0.0f);
      }
      EXPECT_NEAR(scores[size_t(t) * max_keys + p], expect, 1e-5f * (1 + std::fabs(expect)));
    }
  }

  // Top-k on host-made scores: distinct values in row 0, many ties (and -0 / +0) in row 1; row
  // 2 sees fewer than topk positions.
  std::vector<float> given(size_t(n) * max_keys, 0.0f);
  std::mt19937 rng(21);
  for (int p = 0; p < max_keys; ++p) {
    given[size_t(p)] = std::uniform_real_distribution<float>(-1, 1)(rng);
    given[size_t(max_keys) + p] = p % 3 == 0 ? 0.5f : (p % 3 == 1 ? -0.0f : 0.0f);
  }
  const std::vector<int> pos = {39, 38, 8};
  Dev<float> dgiven(given);
  Dev<int> dpos2(pos), dsel(size_t(n) * topk), dcount(static_cast<size_t>(n));
  cuda::indexer_topk(dgiven.get(), n, max_keys, dpos2.get(), topk, dsel.get(), dcount.get(),
                     nullptr);
  const std::vector<int> sel = dsel.read(), count = dcount.read();
  for (int t = 0; t < n; ++t) {
    const int visible = pos[size_t(t)] + 1;
    if (visible <= topk) {
      EXPECT_EQ(count[size_t(t)], 0);
      continue;
    }
    ASSERT_EQ(count[size_t(t)], topk);
    const float* row_scores = &given[size_t(t) * max_keys];
    std::vector<int> order(static_cast<size_t>(visible));
    std::iota(order.begin(), order.end(), 0);
    std::nth_element(order.begin(), order.begin() + (topk - 1), order.end(), [&](int x, int y) {
      return row_scores[x] > row_scores[y] || (row_scores[x] == row_scores[y] && x < y);
    });
    std::sort(order.begin(), order.begin() + topk);
    const std::vector<int> got(sel.begin() + t * topk, sel.begin() + (t + 1) * topk);
    EXPECT_EQ(got, std::vector<int>(order.begin(), order.begin() + topk)) << "row " << t;
  }
}

}  // namespace
}  // namespace colibri
