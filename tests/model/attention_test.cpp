// The absorbed MLA form (decode) must equal the expanded form (prefill, as transformers computes
// it) on the same cache, with and without DSA key selection.
#include <gtest/gtest.h>

#include <random>

#include "oracle/reference_attention.h"

namespace colibri {
namespace {

Matrix random_matrix(std::mt19937& rng, int64_t rows, int64_t cols, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  Matrix m{rows, cols, std::vector<float>(size_t(rows * cols)), {}, {}, {}, 0, {}, {}};
  for (float& v : m.data) v = normal(rng);
  return m;
}

struct TinyMla {
  ModelConfig config;
  AttentionWeights weights;
  TinyMla() {
    config.hidden_size = 48;
    config.num_heads = 3;
    config.q_lora_rank = 0;
    config.kv_lora_rank = 24;
    config.qk_nope_head_dim = 16;
    config.qk_rope_head_dim = 8;
    config.v_head_dim = 12;
    config.num_layers = 1;
    std::mt19937 rng(7);
    weights.q_proj = random_matrix(rng, 3 * 24, 48, 0.3f);
    weights.kv_a_proj = random_matrix(rng, 24 + 8, 48, 0.3f);
    weights.kv_a_norm.assign(24, 1.0f);
    weights.kv_b_proj = random_matrix(rng, 3 * (16 + 12), 24, 0.3f);
    weights.o_proj = random_matrix(rng, 48, 3 * 12, 0.3f);
  }
};

TEST(MlaAttention, AbsorbedEqualsExpanded) {
  TinyMla s;
  const Rope rope(s.config.rope, s.config.qk_rope_head_dim);
  const MlaAttention attention(s.config, rope);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const int tokens = 9;
  std::vector<float> x(size_t(tokens) * 48);
  for (float& v : x) v = normal(rng);
  LayerKvCache cache;
  KeySelection selection;
  std::vector<float> out(x.size());
  attention.forward(0, s.weights, x.data(), tokens, 0, cache, selection, out.data());
  ASSERT_EQ(cache.latent.size(), size_t(tokens) * 24);

  std::vector<float> q(size_t(3 * 24));
  for (float& v : q) v = normal(rng);
  for (const bool sparse : {false, true}) {
    KeySelection keys;
    if (sparse) keys.keys = {{0, 2, 3, 7}};
    // Query at the last position attends over the whole cache.
    std::vector<float> expanded(3 * 12), absorbed(3 * 12);
    attention.attend_expanded(s.weights, q.data(), 1, tokens - 1, cache, keys, expanded.data());
    attention.attend_absorbed(s.weights, q.data(), 1, tokens - 1, cache, keys, absorbed.data());
    float max_abs = 0.0f;
    for (size_t i = 0; i < expanded.size(); ++i) {
      EXPECT_NEAR(expanded[i], absorbed[i], 1e-5f) << "sparse=" << sparse << " i=" << i;
      max_abs = std::max(max_abs, std::abs(expanded[i]));
    }
    EXPECT_GT(max_abs, 1e-2f) << "outputs are vacuously small";
  }
}

TEST(MlaAttention, DecodeEqualsPrefillOfTheSameTokens) {
  TinyMla s;
  const Rope rope(s.config.rope, s.config.qk_rope_head_dim);
  const MlaAttention attention(s.config, rope);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  const int tokens = 6;
  std::vector<float> x(size_t(tokens) * 48);
  for (float& v : x) v = normal(rng);

  LayerKvCache prefill_cache;
  KeySelection selection;
  std::vector<float> prefill(x.size()), decode(x.size());
  attention.forward(0, s.weights, x.data(), tokens, 0, prefill_cache, selection, prefill.data());
  LayerKvCache decode_cache;
  for (int t = 0; t < tokens; ++t)
    attention.forward(0, s.weights, &x[size_t(t) * 48], 1, t, decode_cache, selection,
                      &decode[size_t(t) * 48]);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(prefill[i], decode[i], 1e-4f) << i;
  EXPECT_EQ(prefill_cache.latent, decode_cache.latent);
}

}  // namespace
}  // namespace colibri
