// The embedded model (models/glm5-tiny-kjv) against transformers: reference-forward logits on
// held-out windows, teacher-forced perplexity of a held-out text, and the chat template's ids.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <set>

#include "../engine/scoped_activations.h"
#include "common/dtype.h"
#include "coordinator/chat.h"
#include "cpu/linear.h"
#include "embedded_goldens.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/score.h"
#include "model/weights.h"
#include "oracle/reference_model.h"
#include "tokenizer/tokenizer.h"

namespace colibri {
namespace {

using namespace embedded;

struct Model {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;
  ModelWeights weights;
};

const Model& model() {
  static const std::unique_ptr<Model> m = [] {
    auto loaded = std::make_unique<Model>();
    loaded->config = load_model_config(kModelDir);
    loaded->checkpoint = std::make_unique<Checkpoint>(kModelDir, loaded->config.fp8_block);
    loaded->weights = load_model_weights(loaded->config, *loaded->checkpoint);
    return loaded;
  }();
  return *m;
}

const std::vector<Window>& windows() {
  static const std::vector<Window> w = read_windows();
  return w;
}

// The goldens must be able to catch a wrong forward: real logits, windows within index_topk (no
// DSA ties), margins that make argmax equality meaningful, a book boundary inside one window.
TEST(EmbeddedGoldens, AreNotTrivial) {
  const ModelConfig& config = model().config;
  ASSERT_EQ(windows().size(), 3u);
  std::set<size_t> lengths;
  bool crosses_book = false;
  for (const Window& w : windows()) {
    ASSERT_EQ(w.logits.shape.size(), 2u) << w.start;
    EXPECT_EQ(w.logits.shape[0], int64_t(w.ids.size())) << w.start;
    EXPECT_EQ(w.logits.shape[1], config.vocab_size) << w.start;
    EXPECT_LE(int(w.ids.size()), config.index_topk)
        << w.start << ": DSA ties could decide the logits";
    EXPECT_GE(w.ids.size(), 16u) << w.start;
    const auto [lo, hi] = std::minmax_element(w.logits.data.begin(), w.logits.data.end());
    EXPECT_GT(*hi - *lo, 10.0f) << w.start << ": golden logits are nearly constant";
    lengths.insert(w.ids.size());
    for (int id : w.ids)
      crosses_book |= id == config.generation.eos_token_ids.at(0);  // <|endoftext|>
  }
  EXPECT_EQ(lengths.size(), windows().size())
      << "windows of distinct lengths catch row/shape mix-ups";
  EXPECT_TRUE(crosses_book) << "no window holds <|endoftext|>";
  const auto meta = read_json(kDataDir / "windows.json");
  EXPECT_GE(meta.at("min_top1_top2_gap").get<double>(), 10 * kMaxLogitError);
}

TEST(EmbeddedParity, WindowLogitsMatchTransformers) {
  ReferenceModel reference(model().config, model().weights);
  float max_error = 0;
  for (const Window& w : windows()) {
    KvCache cache(model().config);
    const std::vector<float> logits = reference.forward(w.ids, cache);
    const LogitComparison c = compare_logits(logits, w.logits);
    EXPECT_EQ(logits.size(), w.logits.data.size()) << w.start;
    EXPECT_LE(c.max_abs_error, kMaxLogitError) << w.start;
    EXPECT_EQ(c.argmax_mismatches, 0) << w.start << ": first at position " << c.first_mismatch;
    std::printf("[%s, %zu tokens] max |logit error| = %.3g\n", w.start.c_str(), w.ids.size(),
                c.max_abs_error);
    max_error = std::max(max_error, c.max_abs_error);
  }
  RecordProperty("max_abs_error", std::to_string(max_error));
}

// The same windows through the KV cache: half prefilled, then one token per call.
TEST(EmbeddedParity, IncrementalDecodeMatchesTransformers) {
  ReferenceModel reference(model().config, model().weights);
  for (const Window& w : windows()) {
    KvCache cache(model().config);
    const std::span<const int> ids(w.ids);
    const size_t half = ids.size() / 2;
    std::vector<float> logits = reference.forward(ids.first(half), cache);
    for (size_t i = half; i < ids.size(); ++i) {
      const std::vector<float> row = reference.forward(ids.subspan(i, 1), cache);
      logits.insert(logits.end(), row.begin(), row.end());
    }
    const LogitComparison c = compare_logits(logits, w.logits);
    EXPECT_EQ(logits.size(), w.logits.data.size()) << w.start;
    EXPECT_LE(c.max_abs_error, kMaxLogitError) << w.start;
    EXPECT_EQ(c.argmax_mismatches, 0) << w.start << ": first at position " << c.first_mismatch;
  }
}

// Positions beyond index_topk select keys by DSA index score, where exact ties make the choice
// implementation-defined; the perplexity bound absorbs that (tools/make_embedded_goldens.py).
TEST(EmbeddedParity, HeldOutPerplexityMatchesTransformers) {
  const auto golden = read_json(kDataDir / "score.json");
  const Tokenizer tokenizer = Tokenizer::load(kModelDir / "tokenizer.json");
  const std::vector<int> ids = tokenizer.encode(read_text(kDataDir / "heldout.txt"), false);
  ASSERT_EQ(ids, golden.at("ids").get<std::vector<int>>()) << "heldout.txt encodes differently";
  ASSERT_GT(int(ids.size()), 4 * model().config.index_topk)
      << "the score would not reach DSA selection";

  ReferenceModel reference(model().config, model().weights);
  KvCache cache(model().config);
  const ScoreResult score =
      score_tokens(reference_forward(reference, cache), model().config.vocab_size, ids,
                   256);  // default --max-rows
  ASSERT_EQ(score.nll.size(), ids.size() - 1);
  // transformers with colibri-node's rule for tied index scores (the lower position first).
  const double want = golden.at("lowest_position_ties").at("perplexity").get<double>();
  const double relative = std::abs(score.perplexity - want) / want;
  EXPECT_LE(relative, kMaxPerplexityRelError)
      << "perplexity " << score.perplexity << " vs transformers " << want;
  // A model that learned nothing scores about the vocabulary size; this one much better.
  EXPECT_LT(score.perplexity, model().config.vocab_size / 8.0);
  std::printf("perplexity %.4f (transformers %.4f), relative difference %.3g over %zu tokens\n",
              score.perplexity, want, relative, score.nll.size());
  RecordProperty("relative_perplexity_error", std::to_string(relative));
}

TEST(EmbeddedChat, TemplateIdsMatchTransformers) {
  const auto golden = read_json(kDataDir / "chat.json");
  const Tokenizer tokenizer = Tokenizer::load(kModelDir / "tokenizer.json");
  const ChatFormat format = chat_format_for(model().config);
  ASSERT_EQ(golden.at("conversations").size(), 3u);
  for (const auto& conversation : golden.at("conversations")) {
    const std::string name = conversation.at("name");
    std::vector<ChatMessage> messages;
    for (const auto& m : conversation.at("messages"))
      messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
    const std::string text = render_chat(format, messages, true);
    EXPECT_EQ(text, conversation.at("text").get<std::string>()) << name;
    const std::vector<int> ids = tokenizer.encode(text);
    EXPECT_EQ(ids, conversation.at("ids").get<std::vector<int>>()) << name;
  }
}

// ---- the model is worth reading (its training: tools/train_tiny_glm5.py) ----------------------

// Teacher-forced on the held-out text (1487 predicted tokens, DSA at index_topk 128): 82.5 for
// the first model, 40.8 once retrained, under 30 (the goal) since its indexers learned their
// projections and it trained on long rows (tools/README.md).
TEST(EmbeddedQuality, HeldOutPerplexityIsUnder30) {
  const Tokenizer tokenizer = Tokenizer::load(kModelDir / "tokenizer.json");
  const std::vector<int> ids = tokenizer.encode(read_text(kDataDir / "heldout.txt"), false);
  ReferenceModel reference(model().config, model().weights);
  KvCache cache(model().config);
  const ScoreResult score =
      score_tokens(reference_forward(reference, cache), model().config.vocab_size, ids, 256);
  EXPECT_LE(score.perplexity, 30.0);
}

// m (fp32 or BF16) quantized to NVFP4 by ModelOpt's recipe (kernels::quantize_nvfp4).
Matrix nvfp4_of(const Matrix& m) {
  std::vector<float> w(size_t(m.rows * m.cols));
  if (m.stored_bf16()) {
    for (size_t i = 0; i < w.size(); ++i) w[i] = bf16_to_f32(m.bf16[i]);
  } else {
    EXPECT_EQ(m.format(), WeightFormat::kF32);
    std::copy(m.data.begin(), m.data.end(), w.begin());
  }
  Matrix q;
  q.rows = m.rows;
  q.cols = m.cols;
  q.nvfp4.codes.resize(w.size() / 2);
  q.nvfp4.scales.resize(w.size() / 16);
  q.nvfp4.global = kernels::quantize_nvfp4(w.data(), m.rows, m.cols, q.nvfp4.codes.data(),
                                           q.nvfp4.scales.data());
  return q;
}

// The routed experts in NVFP4 (as a ModelOpt export of this model would hold them): the held-out
// perplexity stays near the BF16 model's, and int8 activations (the default for 4-bit weights)
// stay within 1 % of fp32 ones.
TEST(EmbeddedQuality, Nvfp4ExpertsWithInt8ActivationsKeepThePerplexity) {
  const Tokenizer tokenizer = Tokenizer::load(kModelDir / "tokenizer.json");
  const std::vector<int> ids = tokenizer.encode(read_text(kDataDir / "heldout.txt"), false);
  ModelWeights weights = model().weights;
  int converted = 0;
  for (LayerWeights& layer : weights.layers)
    for (MlpWeights& e : layer.experts) {
      if (e.empty()) continue;
      ASSERT_FALSE(e.quantized());
      e.gate = nvfp4_of(e.gate), e.up = nvfp4_of(e.up), e.down = nvfp4_of(e.down);
      ++converted;
    }
  ASSERT_GT(converted, 0);
  const auto perplexity = [&](kernels::QuantActivations acts) {
    const testing::ScopedActivations scoped(acts);
    ReferenceModel reference(model().config, weights);
    KvCache cache(model().config);
    return score_tokens(reference_forward(reference, cache), model().config.vocab_size, ids, 256)
        .perplexity;
  };
  const double f32 = perplexity(kernels::QuantActivations::kF32);
  const double int8 = perplexity(kernels::QuantActivations::kInt8);
  const double bf16 =
      read_json(kDataDir / "score.json").at("lowest_position_ties").at("perplexity").get<double>();
  std::printf("NVFP4 experts: perplexity %.4f (fp32 activations), %.4f (int8), BF16 model %.4f\n",
              f32, int8, bf16);
  EXPECT_NE(f32, int8);  // the int8 path was taken
  EXPECT_LE(std::abs(int8 / f32 - 1), 0.01);
  EXPECT_LE(f32, 1.03 * bf16);
}

// The checkpoint carries one multi-token-prediction layer (num_nextn_predict_layers 1, its
// tensors as layer num_hidden_layers in DeepSeek-V3's names); it loads and is left out of the
// forward.
TEST(EmbeddedQuality, TheMtpLayerIsStoredAndLeftOut) {
  EXPECT_EQ(model().config.num_nextn_predict_layers, 1);
  EXPECT_NE(model().checkpoint->find(
                fmt::format("model.layers.{}.eh_proj.weight", model().config.num_layers)),
            nullptr);
  EXPECT_EQ(int(model().weights.layers.size()), model().config.num_layers);
}

}  // namespace
}  // namespace colibri
