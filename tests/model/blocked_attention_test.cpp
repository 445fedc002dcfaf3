// Prompt chunks' blocked attention against the row-by-row path on random caches: the DSA
// indexer's choice bit for bit, MLA within a bound (online softmax and GEMM-shaped sums round
// differently), and the blocked results independent of the threads.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "coordinator/cpu_attention.h"
#include "coordinator/kv_manager.h"

namespace colibri {
namespace {

std::vector<float> normal(size_t count, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(count);
  for (float& x : v) x = dist(rng);
  return v;
}

// Odd sizes: 5 indexer heads (padded to 8), rank 40, and rows of three sequences whose KV blocks
// interleave in the pool.
ModelConfig odd_config() {
  ModelConfig c;
  c.num_layers = 1;
  c.max_position_embeddings = 4096;
  c.num_heads = 3;
  c.q_lora_rank = 8;
  c.kv_lora_rank = 40;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 12;
  c.index_topk = 100;
  c.index_n_heads = 5;
  c.index_head_dim = 20;
  c.indexer_is_full = {true};
  return c;
}

// Rows of five sequences: a row at position 20, a chunk of 110 rows at positions 40..149 (across
// index_topk, a chunk of the blocked MLA and its key blocks), 2 rows at 5..6, one row at 250, and
// a chunk of 3 rows at 300..302.
struct Rows {
  std::vector<BatchRow> rows;
  explicit Rows(KvManager& kv) {
    const int a = kv.open(), b = kv.open(), c = kv.open(), d = kv.open(), e = kv.open();
    for (int tokens = 16; tokens <= 304; tokens += 16) {  // blocks handed out in turn
      kv.reserve(a, std::min(tokens, 150));
      kv.reserve(b, std::min(tokens, 251));
      kv.reserve(c, tokens);
      kv.reserve(d, std::min(tokens, 21));
      kv.reserve(e, std::min(tokens, 7));
    }
    rows.push_back({0, d, 20, false});  // a decode row that sees every position
    for (int p = 40; p < 150; ++p) rows.push_back({0, a, p, false});
    for (int p = 5; p < 7; ++p) rows.push_back({0, e, p, false});
    rows.push_back({0, b, 250, false});
    for (int p = 300; p < 303; ++p) rows.push_back({0, c, p, false});
  }
  int n() const { return int(rows.size()); }
};

struct Selection {
  std::vector<int> selected, count;
};

Selection select(const ModelConfig& c, const KvManager& kv, const Rows& rows, bool by_rows) {
  const int padded = 8, dim = c.index_head_dim, n = rows.n();
  const std::vector<float> q_t = normal(size_t(n) * dim * padded, 3);
  std::vector<float> weights = normal(size_t(n) * padded, 4);
  for (int t = 0; t < n; ++t)
    for (int h = c.index_n_heads; h < padded; ++h) weights[size_t(t) * padded + h] = 0.0f;
  Selection s;
  s.selected.assign(size_t(n) * c.index_topk, -1);
  s.count.assign(size_t(n), -1);
  IndexerTopk topk;
  IndexerTopk::Call call;
  call.n = n;
  call.rows = rows.rows.data();
  call.kv = &kv;
  call.keys = kv.index_k(0);
  call.q_t = q_t.data();
  call.weights = weights.data();
  call.padded = padded;
  call.dim = dim;
  call.scale = 1.0f / std::sqrt(float(dim));
  call.topk = c.index_topk;
  call.selected = s.selected.data();
  call.count = s.count.data();
  topk.run(call, by_rows);
  return s;
}

void fill_cache(const ModelConfig& c, KvManager& kv) {
  const size_t slots = size_t(kv.capacity_tokens());
  const auto fill = [](float* p, const std::vector<float>& v) { std::copy(v.begin(), v.end(), p); };
  fill(kv.latent(0), normal(slots * c.kv_lora_rank, 5));
  fill(kv.k_rope(0), normal(slots * c.qk_rope_head_dim, 6));
  fill(kv.index_k(0), normal(slots * c.index_head_dim, 7));
}

TEST(BlockedAttention, IndexerChoosesTheRowPathsKeys) {
  const ModelConfig c = odd_config();
  KvManager kv(c, 1024, 5);
  const Rows rows(kv);
  fill_cache(c, kv);
  const int saved = omp_get_max_threads();
  for (const int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    omp_set_num_threads(threads);
    const Selection want = select(c, kv, rows, true), got = select(c, kv, rows, false);
    EXPECT_EQ(got.count, want.count);
    EXPECT_EQ(got.selected, want.selected);
    int dense = 0, sparse = 0;
    for (int t = 0; t < rows.n(); ++t) (want.count[size_t(t)] == 0 ? dense : sparse)++;
    EXPECT_GT(dense, 0);
    EXPECT_GT(sparse, 0);
  }
  omp_set_num_threads(saved);
}

// Row t's keys: every position through its own (count 0), or the indexer's choice.
class ChosenKeys final : public KeySlots {
 public:
  ChosenKeys(const KvManager& kv, const Rows& rows, const Selection& s, int topk)
      : kv_(kv), rows_(rows), s_(s), topk_(topk) {}
  int fill(int t, int32_t* slots) const override {
    const BatchRow& row = rows_.rows[size_t(t)];
    const int count = s_.count[size_t(t)];
    if (count == 0) {
      for (int p = 0; p <= row.pos; ++p) slots[p] = kv_.slot(row.seq, p);
      return row.pos + 1;
    }
    for (int i = 0; i < count; ++i)
      slots[i] = kv_.slot(row.seq, s_.selected[size_t(t) * topk_ + i]);
    return count;
  }
  int dense_through(int t, int* seq) const override {
    if (s_.count[size_t(t)] != 0) return -1;
    *seq = rows_.rows[size_t(t)].seq;
    return rows_.rows[size_t(t)].pos;
  }

 private:
  const KvManager& kv_;
  const Rows& rows_;
  const Selection& s_;
  int topk_;
};

// 17 heads: every row blocked; 3 heads: rows of chosen keys on the row path, bit for bit.
class BlockedMla : public ::testing::TestWithParam<int> {};

TEST_P(BlockedMla, MatchesTheRowPathWithinItsBound) {
  ModelConfig c = odd_config();
  c.num_heads = GetParam();
  KvManager kv(c, 1024, 5);
  const Rows rows(kv);
  fill_cache(c, kv);
  const Selection s = select(c, kv, rows, true);
  const ChosenKeys keys(kv, rows, s, c.index_topk);
  const int n = rows.n(), heads = c.num_heads, dq = c.qk_head_dim(), dv = c.v_head_dim;
  const std::vector<float> q = normal(size_t(n) * heads * dq, 8, 0.3f);
  Matrix kv_b;
  kv_b.rows = int64_t(heads) * (c.qk_nope_head_dim + dv);
  kv_b.cols = c.kv_lora_rank;
  kv_b.data = normal(size_t(kv_b.rows * kv_b.cols), 9, 0.3f);
  const auto run = [&](bool by_rows) {
    std::vector<float> out(size_t(n) * heads * dv, std::nanf(""));
    MlaHeads mla(c);
    MlaHeads::Call call;
    call.n = n;
    call.heads = heads;
    call.q = q.data();
    call.q_stride = heads;
    call.kv_b = &kv_b;
    call.latent = kv.latent(0);
    call.k_rope = kv.k_rope(0);
    call.keys = &keys;
    call.max_keys = 303;
    call.out = out.data();
    call.out_stride = heads;
    mla.run(call, by_rows);
    return out;
  };
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<float> want = run(true), blocked_one = run(false);
  omp_set_num_threads(3);
  const std::vector<float> blocked_three = run(false);
  omp_set_num_threads(saved);
  EXPECT_EQ(blocked_one, blocked_three) << "the blocked path depends on the threads";
  float worst = 0, largest = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(blocked_one[i])) << i;
    worst = std::max(worst, std::abs(blocked_one[i] - want[i]));
    largest = std::max(largest, std::abs(want[i]));
  }
  std::printf("blocked MLA against the row path: max |diff| %.3g, max |out| %.3g\n", worst,
              largest);
  EXPECT_GT(largest, 0.1f);
  EXPECT_LE(worst, 1e-5f * largest);
  if (c.num_heads < 16) {
    for (int t = 0; t < n; ++t) {
      if (s.count[size_t(t)] == 0) continue;
      for (int i = 0; i < heads * dv; ++i) {
        const size_t at = size_t(t) * heads * dv + size_t(i);
        ASSERT_EQ(blocked_one[at], want[at]) << "row " << t << " of chosen keys";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, BlockedMla, ::testing::Values(3, 17));

}  // namespace
}  // namespace colibri
