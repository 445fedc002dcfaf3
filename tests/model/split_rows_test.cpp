// Row slices of a Matrix (what --split-linears gives each rank): every representation's slices
// compute the whole matrix's rows bit for bit, split_bounds cuts whole steps, linear() puts a
// split matrix's rows together, and a quantized MLP held as three matrices keeps its bits.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "coordinator/cpu_attention.h"
#include "cpu/quant.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/container.h"
#include "model/weights.h"
#include "moe/experts.h"

namespace colibri {
namespace {

std::vector<float> normal(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& e : v) e = dist(rng);
  return v;
}

Matrix f32_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.data = normal(rows * cols, seed);
  return m;
}

Matrix bf16_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  for (float v : normal(rows * cols, seed)) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    m.bf16.push_back(uint16_t(bits >> 16));
  }
  return m;
}

Matrix fp8_matrix(int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                  uint32_t seed) {
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 0x7e);  // E4M3 without NaN (0x7f), either sign
  for (int64_t i = 0; i < rows * cols; ++i)
    m.fp8.bits.push_back(uint8_t(byte(rng) | (rng() & 1 ? 0x80 : 0)));
  m.fp8.block_rows = block_rows;
  m.fp8.block_cols = block_cols;
  const int64_t scales =
      ((rows + block_rows - 1) / block_rows) * ((cols + block_cols - 1) / block_cols);
  for (int64_t i = 0; i < scales; ++i) m.fp8.scales.push_back(0.01f * float(i + 1));
  return m;
}

Matrix quant_matrix(kernels::QuantFormat format, int group_size, kernels::QuantLayout layout,
                    int64_t rows, int64_t cols, uint32_t seed) {
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  QuantMatrix& q = m.quant;
  q.format = format;
  q.group_size = group_size;
  q.rows = rows;
  q.cols = cols;
  q.data.resize(size_t(kernels::packed_bytes(format, rows, cols)));
  q.scales.resize(size_t(kernels::scale_count(format, rows, cols, group_size)));
  const std::vector<float> w = normal(rows * cols, seed);
  kernels::quantize(format, group_size, w.data(), rows, cols, q.data.data(), q.scales.data());
  set_layout(q, layout);
  return m;
}

struct Case {
  std::string name;
  Matrix m;
};

// 44 rows: 6 steps of 8 with a short last one (FP8: blocks of 8 rows and 16 columns).
std::vector<Case> cases() {
  const int64_t rows = 44, cols = 192;
  std::vector<Case> all;
  all.push_back({"f32", f32_matrix(rows, cols, 1)});
  all.push_back({"bf16", bf16_matrix(rows, cols, 2)});
  all.push_back({"fp8", fp8_matrix(rows, cols, 8, 16, 3)});
  for (auto layout : {kernels::QuantLayout::kRows, kernels::QuantLayout::kTiles}) {
    const std::string where = layout == kernels::QuantLayout::kTiles ? " tiles" : " rows";
    // kTiles needs rows a multiple of 8.
    const int64_t r = layout == kernels::QuantLayout::kTiles ? 48 : rows;
    all.push_back(
        {"int8-row" + where, quant_matrix(kernels::QuantFormat::kInt8Row, 0, layout, r, cols, 4)});
    all.push_back({"int4-g64" + where,
                   quant_matrix(kernels::QuantFormat::kInt4Grouped, 64, layout, r, cols, 5)});
  }
  return all;
}

std::vector<float> product(const Matrix& m, const std::vector<float>& x, int64_t n) {
  std::vector<float> y(size_t(n * m.rows), std::nanf(""));
  linear(m, x.data(), n, y.data());
  return y;
}

TEST(SplitRows, BoundsAreWholeStepsFromZeroToTheRows) {
  for (const Case& c : cases())
    for (int parts = 1; parts <= 6; ++parts) {
      SCOPED_TRACE(c.name + " parts " + std::to_string(parts));
      const std::vector<int64_t> bounds = split_bounds(c.m, parts);
      ASSERT_EQ(bounds.size(), size_t(parts) + 1);
      EXPECT_EQ(bounds.front(), 0);
      EXPECT_EQ(bounds.back(), c.m.rows);
      for (int p = 0; p < parts; ++p) {
        EXPECT_LT(bounds[size_t(p)], bounds[size_t(p) + 1]);
        EXPECT_EQ(bounds[size_t(p)] % row_slice_step(c.m), 0);
      }
    }
  // Fewer steps than parts: not split.
  EXPECT_TRUE(split_bounds(f32_matrix(44, 8, 1), 7).empty());
  EXPECT_TRUE(split_bounds(fp8_matrix(44, 16, 16, 16, 1), 4).empty());
}

TEST(SplitRows, EverySliceGivesTheWholeMatrixsRows) {
  for (const Case& c : cases())
    for (int64_t n : {int64_t(1), int64_t(5)}) {
      const std::vector<float> x = normal(n * c.m.cols, 9);
      const std::vector<float> whole = product(c.m, x, n);
      for (int parts : {2, 3, 5}) {
        const std::vector<int64_t> bounds = split_bounds(c.m, parts);
        for (int p = 0; p < parts; ++p) {
          const int64_t r0 = bounds[size_t(p)], r1 = bounds[size_t(p) + 1];
          SCOPED_TRACE(c.name + " n=" + std::to_string(n) + " rows " + std::to_string(r0) + ".." +
                       std::to_string(r1));
          const Matrix slice = slice_rows(c.m, r0, r1);
          EXPECT_EQ(slice.rows, r1 - r0);
          const std::vector<float> part = product(slice, x, n);
          std::vector<float> want;
          for (int64_t t = 0; t < n; ++t)
            want.insert(want.end(), whole.begin() + t * c.m.rows + r0,
                        whole.begin() + t * c.m.rows + r1);
          EXPECT_EQ(part, want);
        }
      }
    }
}

TEST(SplitRows, ASliceNotOfWholeStepsIsRefused) {
  const Matrix m = f32_matrix(44, 16, 1);
  EXPECT_THROW(slice_rows(m, 4, 16), Error);
  EXPECT_THROW(slice_rows(m, 0, 12), Error);
  EXPECT_THROW(slice_rows(m, 8, 8), Error);
  EXPECT_THROW(slice_rows(m, 40, 48), Error);
  EXPECT_EQ(slice_rows(m, 40, 44).rows, 4);
  const Matrix fp8 = fp8_matrix(64, 16, 16, 16, 1);
  EXPECT_THROW(slice_rows(fp8, 8, 32), Error);
  EXPECT_EQ(slice_rows(fp8, 16, 48).fp8.scales.size(), 2u);
}

// The other parts' rows computed in this process from their slices, as the serving ranks do.
class LocalRows final : public RemoteRows {
 public:
  LocalRows(const Matrix& whole, std::vector<int64_t> bounds) : bounds_(std::move(bounds)) {
    for (size_t p = 1; p + 1 < bounds_.size(); ++p)
      slices_.push_back(slice_rows(whole, bounds_[p], bounds_[p + 1]));
  }
  void start(const float* x, int64_t n) override {
    x_ = x;
    ++starts;
    EXPECT_GT(n, 0);
  }
  float* local_buffer(int64_t n) override {
    local_.assign(size_t(n * bounds_[1]), std::nanf(""));
    return local_.data();
  }
  void finish(const float* local, int64_t n, float* y) override {
    const int64_t rows = bounds_.back();
    for (int64_t t = 0; t < n; ++t) std::copy_n(local + t * bounds_[1], bounds_[1], y + t * rows);
    for (size_t p = 0; p < slices_.size(); ++p) {
      const int64_t r0 = bounds_[p + 1], r1 = bounds_[p + 2];
      std::vector<float> theirs(size_t(n * (r1 - r0)));
      linear(slices_[p], x_, n, theirs.data());
      for (int64_t t = 0; t < n; ++t)
        std::copy_n(theirs.data() + t * (r1 - r0), r1 - r0, y + t * rows + r0);
    }
  }
  int starts = 0;

 private:
  std::vector<int64_t> bounds_;
  std::vector<Matrix> slices_;
  std::vector<float> local_;
  const float* x_ = nullptr;
};

TEST(SplitRows, LinearOfASplitMatrixPutsItsRowsTogether) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::vector<int64_t> bounds = split_bounds(c.m, 3);
    auto remote = std::make_shared<LocalRows>(c.m, bounds);
    Matrix split = slice_rows(c.m, 0, bounds[1]);
    split.rows = c.m.rows;
    split.local_rows = bounds[1];
    split.remote = remote;
    EXPECT_EQ(split.held_rows(), bounds[1]);
    const std::vector<float> x = normal(3 * c.m.cols, 11);
    EXPECT_EQ(product(split, x, 3), product(c.m, x, 3));
    EXPECT_EQ(remote->starts, 1);
  }
}

// A container MLP held for the fused kernel and the same bytes as three matrices (how
// split_targets holds a dense MLP): the same bits, whatever activations the kernels take.
TEST(SplitRows, AQuantizedMlpAsMatricesKeepsItsBits) {
  const int64_t hidden = 128, inter = 192;
  const kernels::QuantActivations saved = kernels::quant_activations_selected();
  for (auto format : {kernels::QuantFormat::kInt8Row, kernels::QuantFormat::kInt4Grouped})
    for (auto activations : {kernels::QuantActivations::kF32, kernels::QuantActivations::kInt8,
                             kernels::QuantActivations::kMixed}) {
      SCOPED_TRACE(std::to_string(int(format)) + " activations " +
                   std::to_string(int(activations)));
      kernels::set_quant_activations(activations);
      const int gs = format == kernels::QuantFormat::kInt4Grouped ? 64 : 0;
      const auto layout = kernels::QuantLayout::kTiles;
      MlpWeights fused;
      fused.quant.gate = quant_matrix(format, gs, layout, inter, hidden, 21).quant;
      fused.quant.up = quant_matrix(format, gs, layout, inter, hidden, 22).quant;
      fused.quant.down = quant_matrix(format, gs, layout, hidden, inter, 23).quant;
      ModelWeights w;
      w.layers.resize(1);
      w.layers[0].dense_mlp = fused;
      const std::vector<SplitTarget> targets = split_targets(w);
      const MlpWeights& held = w.layers[0].dense_mlp;
      ASSERT_FALSE(held.quantized());
      ASSERT_EQ(targets.size(), 3u);
      EXPECT_EQ(targets[0].matrix, &held.gate);
      EXPECT_EQ(held.gate.rows, inter);
      EXPECT_EQ(held.down.cols, inter);
      for (int n : {1, 4}) {
        const std::vector<float> x = normal(n * hidden, 24);
        std::vector<float> want(size_t(n * hidden)), got(want.size(), std::nanf(""));
        mlp_forward(fused, x.data(), n, want.data());
        mlp_forward(held, x.data(), n, got.data());
        EXPECT_EQ(got, want) << "n=" << n;
      }
    }
  kernels::set_quant_activations(saved);
}

bool same_matrix(const Matrix& a, const Matrix& b) {
  return a.rows == b.rows && a.cols == b.cols && a.data == b.data && a.bf16 == b.bf16 &&
         a.fp8.bits == b.fp8.bits && a.fp8.scales == b.fp8.scales && a.quant.data == b.quant.data &&
         a.quant.scales == b.quant.scales && a.quant.format == b.quant.format &&
         a.quant.layout == b.quant.layout;
}

// What a serving rank loads (split_targets_only) is what the coordinator's split_targets lists:
// the same matrices in the same order, and nothing else.
TEST(SplitRows, ARankThatServesRowsLoadsTheSplitMatricesAndKvBOnly) {
  for (const char* fixture : {"glm5", "glm52", "dsv3", "kimi"}) {
    SCOPED_TRACE(fixture);
    const auto dir = std::filesystem::path(COLIBRI_TEST_DATA) / "parity" / fixture / "model";
    const ModelConfig config = load_model_config(dir);
    const Checkpoint checkpoint(dir, config.fp8_block);
    LoadOptions coordinator;
    coordinator.keep_stored = true;
    coordinator.owns_expert = [](int, int) { return false; };
    LoadOptions server;
    server.dense = false;
    server.mtp = false;
    server.keep_stored = true;
    server.split_targets_only = true;
    ModelWeights all = load_model_weights(config, checkpoint, coordinator);
    ModelWeights only = load_model_weights(config, checkpoint, server);
    const uint64_t all_bytes = weight_bytes(all).total(), only_bytes = weight_bytes(only).total();
    const std::vector<SplitTarget> want = split_targets(all), got = split_targets(only);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_GT(got.size(), size_t(config.num_layers));
    uint64_t target_bytes = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].name, want[i].name);
      EXPECT_TRUE(same_matrix(*got[i].matrix, *want[i].matrix)) << want[i].name;
      target_bytes += want[i].matrix->bytes();
    }
    // And kv_b_proj, whose rows are cut by heads.
    for (size_t l = 0; l < all.layers.size(); ++l) {
      EXPECT_TRUE(same_matrix(only.layers[l].attn.kv_b_proj, all.layers[l].attn.kv_b_proj))
          << "layer " << l << " kv_b_proj";
      target_bytes += all.layers[l].attn.kv_b_proj.bytes();
    }
    EXPECT_EQ(only_bytes, target_bytes) << "loaded more than the split matrices";
    const bool splits_indexer = std::any_of(want.begin(), want.end(), [](const SplitTarget& t) {
      return t.name.find("indexer.wq_b") != std::string::npos;
    });
    EXPECT_EQ(splits_indexer, config.has_indexer());
    EXPECT_LT(only_bytes, all_bytes);
  }
}

// Row t's keys: all of 0..pos or every third position, each at a scattered cache slot.
class ScatteredKeys final : public KeySlots {
 public:
  ScatteredKeys(int slots, const std::vector<int>& pos) : slots_(slots), pos_(pos) {}
  int fill(int t, int32_t* slots) const override {
    int count = 0;
    for (int p = 0; p <= pos_[size_t(t)]; p += (t % 2 ? 3 : 1)) slots[count++] = slot(t, p);
    return count;
  }
  int slot(int t, int p) const { return (p * 7 + t * 13) % slots_; }

 private:
  int slots_;
  const std::vector<int>& pos_;
};

// Split by heads (what --split-linears gives each rank of the attention): two parts of the heads,
// each with kv_b_proj's rows of its heads, give the bits of all the heads in one call, for each
// form the absorbed attention reads kv_b_proj in, on one thread and on several, row by row and
// blocked.
TEST(SplitHeads, TwoPartsOfTheHeadsGiveTheWholeCallsBits) {
  ModelConfig c;
  c.num_heads = 6;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 24;
  c.kv_lora_rank = 64;
  const int heads = c.num_heads, dq = c.qk_head_dim(), dv = c.v_head_dim;
  const int per_head = c.qk_nope_head_dim + c.v_head_dim, slots = 97, n = 4;
  const std::vector<int> pos{0, 12, 40, 41};
  const ScatteredKeys keys(slots, pos);
  const std::vector<float> q = normal(int64_t(n) * heads * dq, 11);
  const std::vector<float> latent = normal(int64_t(slots) * c.kv_lora_rank, 12);
  const std::vector<float> k_rope = normal(int64_t(slots) * c.qk_rope_head_dim, 13);
  const int64_t kv_rows = int64_t(heads) * per_head;
  std::vector<Case> forms;
  forms.push_back({"f32", f32_matrix(kv_rows, c.kv_lora_rank, 14)});
  forms.push_back({"bf16", bf16_matrix(kv_rows, c.kv_lora_rank, 15)});
  forms.push_back(
      {"int8-row", quant_matrix(kernels::QuantFormat::kInt8Row, 0, kernels::QuantLayout::kRows,
                                kv_rows, c.kv_lora_rank, 16)});
  const std::vector<int> bounds = split_head_bounds(c, forms[0].m, 2);
  ASSERT_EQ(bounds, (std::vector<int>{0, 3, 6}));
  EXPECT_TRUE(split_head_bounds(c, forms[0].m, 7).empty()) << "more parts than heads";
  // Runs heads [h0, h1) with kv_b's rows of them, into out's heads h0.. (row stride: all heads).
  bool by_rows = true;
  const auto run = [&](const Matrix& kv_b, int h0, int h1, std::vector<float>& out) {
    MlaHeads mla(c);
    MlaHeads::Call call;
    call.n = n;
    call.heads = h1 - h0;
    call.q = q.data() + size_t(h0) * dq;
    call.q_stride = heads;
    const Matrix rows = slice_rows(kv_b, int64_t(h0) * per_head, int64_t(h1) * per_head);
    call.kv_b = &rows;
    call.latent = latent.data();
    call.k_rope = k_rope.data();
    call.keys = &keys;
    call.max_keys = 42;
    call.out = out.data() + size_t(h0) * dv;
    call.out_stride = heads;
    mla.run(call, by_rows);
  };
  for (const Case& form : forms)
    for (int round = 0; round < 4; ++round) {
      const int threads = round % 2 ? 3 : 1;
      by_rows = round < 2;
      SCOPED_TRACE(form.name + ", threads " + std::to_string(threads) +
                   (by_rows ? ", by rows" : ""));
      const int before = omp_get_max_threads();
      omp_set_num_threads(threads);
      std::vector<float> whole(size_t(n) * heads * dv, std::nanf("")), parts = whole;
      run(form.m, 0, heads, whole);
      run(form.m, bounds[0], bounds[1], parts);
      run(form.m, bounds[1], bounds[2], parts);
      omp_set_num_threads(before);
      for (float v : whole) ASSERT_TRUE(std::isfinite(v));
      EXPECT_EQ(0, std::memcmp(whole.data(), parts.data(), whole.size() * sizeof(float)));
    }
}

}  // namespace
}  // namespace colibri

// --placement sliced: an expert cut along its intermediate dimension (gate and up rows, down
// columns); its slices' outputs sum to the expert's.
namespace colibri {
namespace {

TEST(SliceExperts, BoundsFollowTheWeightsInWholeSteps) {
  EXPECT_EQ(expert_slice_bounds(2048, {6, 10}), (std::vector<int64_t>{0, 768, 2048}));
  EXPECT_EQ(expert_slice_bounds(1408, {1, 1}), (std::vector<int64_t>{0, 768, 1408}));
  EXPECT_EQ(expert_slice_bounds(2048, {1, 1, 2}), (std::vector<int64_t>{0, 512, 1024, 2048}));
  // Too few steps of 128 for the slices: halved, down to 8 rows.
  EXPECT_EQ(expert_slice_bounds(16, {1, 2}), (std::vector<int64_t>{0, 8, 16}));
  EXPECT_EQ(expert_slice_bounds(192, {1, 1}), (std::vector<int64_t>{0, 128, 192}));
  // A slice would be empty: refused, naming the sizes.
  for (const std::vector<double>& weights :
       {std::vector<double>{1, 1, 1}, std::vector<double>{0, 1}, std::vector<double>{1, 100}}) {
    try {
      expert_slice_bounds(16, weights);
      ADD_FAILURE() << "no error for " << weights.size() << " slices";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("16 intermediate rows"), std::string::npos) << e.what();
    }
  }
}

MlpWeights expert_of(const std::string& kind, int64_t hidden, int64_t inter) {
  MlpWeights w;
  if (kind == "f32" || kind == "bf16") {
    const auto make = kind == "f32" ? f32_matrix : bf16_matrix;
    w.gate = make(inter, hidden, 31);
    w.up = make(inter, hidden, 32);
    w.down = make(hidden, inter, 33);
    return w;
  }
  const bool int8 = kind.rfind("int8", 0) == 0;
  const auto format = int8                 ? kernels::QuantFormat::kInt8Row
                      : kind == "int4-row" ? kernels::QuantFormat::kInt4Row
                                           : kernels::QuantFormat::kInt4Grouped;
  const int gs = format == kernels::QuantFormat::kInt4Grouped ? 64 : 0;
  const auto layout = kind.find("tiles") != std::string::npos ? kernels::QuantLayout::kTiles
                                                              : kernels::QuantLayout::kRows;
  w.quant.gate = quant_matrix(format, gs, layout, inter, hidden, 34).quant;
  w.quant.up = quant_matrix(format, gs, layout, inter, hidden, 35).quant;
  w.quant.down = quant_matrix(format, gs, layout, hidden, inter, 36).quant;
  return w;
}

TEST(SliceExperts, SlicesSumToTheWholeExpert) {
  const int64_t hidden = 128, inter = 320;
  const kernels::QuantActivations saved = kernels::quant_activations_selected();
  for (const std::string kind :
       {"f32", "bf16", "int8-row", "int8-row tiles", "int4-row", "int4-g64", "int4-g64 tiles"})
    for (auto activations : {kernels::QuantActivations::kF32, kernels::QuantActivations::kInt8})
      for (const std::vector<int64_t>& bounds :
           {std::vector<int64_t>{0, 128, 320}, std::vector<int64_t>{0, 64, 192, 320}}) {
        SCOPED_TRACE(kind + " activations " + std::to_string(int(activations)) + " slices " +
                     std::to_string(bounds.size() - 1));
        kernels::set_quant_activations(activations);
        const MlpWeights whole = expert_of(kind, hidden, inter);
        for (int n : {1, 3}) {
          const std::vector<float> x = normal(n * hidden, 37);
          std::vector<float> want(size_t(n * hidden)), sum(want.size(), 0.0f), part(want.size());
          mlp_forward(whole, x.data(), n, want.data());
          for (size_t i = 0; i + 1 < bounds.size(); ++i) {
            const MlpWeights s = slice_expert(whole, {bounds[i], bounds[i + 1]});
            const int64_t rows = bounds[i + 1] - bounds[i];
            EXPECT_EQ(s.quantized(), whole.quantized());
            EXPECT_EQ(s.quantized() ? s.quant.gate.rows : s.gate.rows, rows);
            EXPECT_EQ(s.quantized() ? s.quant.down.cols : s.down.cols, rows);
            EXPECT_EQ(s.quantized() ? s.quant.down.rows : s.down.rows, hidden);
            // Each slice is about its share of the bytes.
            EXPECT_LT(s.bytes(), whole.bytes() * uint64_t(rows + 64) / uint64_t(inter));
            mlp_forward(s, x.data(), n, part.data());
            for (size_t j = 0; j < sum.size(); ++j) sum[j] += part[j];
          }
          // The same products; only the sum over the intermediate dimension is split, and with
          // int8 activations the slices quantize the same 64-input blocks of h (bounds at
          // multiples of 64).
          float scale = 0, worst = 0;
          for (size_t j = 0; j < want.size(); ++j) {
            scale = std::max(scale, std::abs(want[j]));
            worst = std::max(worst, std::abs(sum[j] - want[j]));
          }
          EXPECT_GT(scale, 0.0f);
          EXPECT_LE(worst, 1e-5f * scale) << "n=" << n;
        }
      }
  kernels::set_quant_activations(saved);
}

TEST(SliceExperts, ACutInsideAGroupOrABlockIsRefused) {
  const auto message = [](const MlpWeights& w, ExpertSlice slice) {
    try {
      slice_expert(w, slice);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const MlpWeights grouped = expert_of("int4-g64", 128, 192);
  EXPECT_NE(message(grouped, {32, 192}).find("do not start a group of 64"), std::string::npos)
      << message(grouped, {32, 192});
  EXPECT_EQ(message(grouped, {64, 192}), "no error");
  EXPECT_EQ(message(grouped, {0, 32}), "no error");  // a short last group keeps its scale
  MlpWeights fp8;                                    // blocks of 8 rows and 16 columns
  fp8.gate = fp8_matrix(32, 64, 8, 16, 41);
  fp8.up = fp8_matrix(32, 64, 8, 16, 42);
  fp8.down = fp8_matrix(64, 32, 8, 16, 43);
  EXPECT_NE(message(fp8, {8, 32}).find("FP8 matrix do not start a block of 16"), std::string::npos)
      << message(fp8, {8, 32});
  EXPECT_EQ(message(fp8, {16, 32}), "no error");
  // Rows out of the expert, or a slice of none.
  EXPECT_NE(message(grouped, {128, 256}).find("192 intermediate rows"), std::string::npos);
  EXPECT_NE(message(grouped, {64, 64}).find("192 intermediate rows"), std::string::npos);
}

// load_routed_expert with a slice: the slice of what it loads whole, and a cut it refuses names
// the expert.
TEST(SliceExperts, TheLoaderCutsTheSliceAndNamesTheExpertItRefuses) {
  for (const char* fixture : {"glm52", "dsv3"}) {
    SCOPED_TRACE(fixture);
    const auto dir = std::filesystem::path(COLIBRI_TEST_DATA) / "parity" / fixture / "model";
    const ModelConfig config = load_model_config(dir);
    const Checkpoint checkpoint(dir, config.fp8_block);
    int layer = 0;
    while (!config.layer_is_moe[size_t(layer)]) ++layer;
    const MlpWeights whole = load_routed_expert(config, checkpoint, layer, 3);
    try {
      const MlpWeights s = load_routed_expert(config, checkpoint, layer, 3, {8, 16});
      EXPECT_EQ(s.gate.rows, 8);
      EXPECT_EQ(s.down.cols, 8);
      EXPECT_TRUE(same_matrix(s.up, slice_rows(whole.up, 8, 16)));
      EXPECT_EQ(std::string(fixture), "glm52");
    } catch (const Error& e) {
      // dsv3's experts are FP8 in blocks of 128 rows and columns: a slice from row 8 is refused.
      EXPECT_EQ(std::string(fixture), "dsv3") << e.what();
      const std::string message = e.what();
      EXPECT_NE(message.find(expert_prefix(layer, 3)), std::string::npos) << message;
      EXPECT_NE(message.find("whole 128-row steps"), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace colibri
