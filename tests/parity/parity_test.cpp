// transformers (fp32, eager) → the reference forward: per-position logits and greedy tokens of
// the committed tiny models (tools/make_parity_fixtures.py) must match the recorded goldens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "../engine/scoped_activations.h"
#include "common/npy.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "model/weights.h"
#include "oracle/reference_model.h"

namespace colibri {
namespace {

constexpr float kMaxAbsError = 1e-3f;
const std::filesystem::path kParityDir = std::filesystem::path(COLIBRI_TEST_DATA) / "parity";

struct Fixture {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;
  ModelWeights weights;
  std::vector<int> prompt, teacher_forced, greedy;
  NpyArray logits, greedy_logits;
};

const Fixture& load_fixture(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Fixture>> cache;
  auto& slot = cache[name];
  if (slot) return *slot;
  const auto dir = kParityDir / name;
  auto f = std::make_unique<Fixture>();
  f->config = load_model_config(dir / "model");
  f->checkpoint =
      std::make_unique<Checkpoint>(dir / "model", f->config.fp8_block, f->config.int4_group_size);
  f->weights = load_model_weights(f->config, *f->checkpoint);
  std::ifstream meta_file(dir / "golden" / "meta.json");
  const auto meta = nlohmann::json::parse(meta_file);
  f->prompt = meta.at("prompt_ids").get<std::vector<int>>();
  f->teacher_forced = meta.at("tf_ids").get<std::vector<int>>();
  f->greedy = meta.at("greedy_ids").get<std::vector<int>>();
  f->logits = read_npy_f32(dir / "golden" / "logits.npy");
  f->greedy_logits = read_npy_f32(dir / "golden" / "greedy_logits.npy");
  slot = std::move(f);
  return *slot;
}

// Compares logits row by row; returns the max abs error and checks argmax equality everywhere.
float expect_logits_match(std::span<const float> actual, const NpyArray& golden, int first_row,
                          int rows, const std::string& what) {
  const int vocab = int(golden.shape[1]);
  EXPECT_EQ(actual.size(), size_t(rows) * vocab) << what;
  float max_error = 0.0f;
  for (int r = 0; r < rows && size_t(r + 1) * vocab <= actual.size(); ++r) {
    std::span<const float> got = actual.subspan(size_t(r) * vocab, size_t(vocab));
    std::span<const float> want(&golden.data[size_t(first_row + r) * vocab], size_t(vocab));
    float row_error = 0.0f;
    for (int v = 0; v < vocab; ++v)
      row_error = std::max(row_error, std::abs(got[size_t(v)] - want[size_t(v)]));
    EXPECT_LE(row_error, kMaxAbsError) << what << ": position " << first_row + r;
    EXPECT_EQ(argmax(got), argmax(want))
        << what << ": greedy token differs at position " << first_row + r;
    max_error = std::max(max_error, row_error);
  }
  return max_error;
}

// transformers computes in fp32: weights kept as stored (NVFP4 would take int8 activations by
// default) are compared with fp32 activations; int8 activations are checked in tests/engine.
class Parity : public ::testing::TestWithParam<std::string> {
  testing::ScopedActivations f32_{kernels::QuantActivations::kF32};
};

TEST_P(Parity, GoldenIsNotTrivial) {
  const Fixture& f = load_fixture(GetParam());
  const auto& l = f.logits;
  ASSERT_EQ(l.shape.size(), 2u);
  ASSERT_EQ(l.shape[0], int64_t(f.prompt.size() + f.teacher_forced.size()));
  ASSERT_EQ(l.shape[1], f.config.vocab_size);
  const auto [lo, hi] = std::minmax_element(l.data.begin(), l.data.end());
  EXPECT_GT(*hi - *lo, 1.0f) << "golden logits are nearly constant";
  if (f.config.has_indexer()) {
    EXPECT_LT(f.config.index_topk, int(l.shape[0]))
        << "DSA selection never happens in this fixture";
  }
}

TEST_P(Parity, PrefillMatchesTransformers) {
  const Fixture& f = load_fixture(GetParam());
  ReferenceModel model(f.config, f.weights);
  KvCache cache(f.config);
  std::vector<int> tokens = f.prompt;
  tokens.insert(tokens.end(), f.teacher_forced.begin(), f.teacher_forced.end());
  const auto logits = model.forward(tokens, cache);
  const float error = expect_logits_match(logits, f.logits, 0, int(tokens.size()), "prefill");
  std::printf("[%s] prefill max |logit error| = %.3g\n", GetParam().c_str(), error);
  RecordProperty("max_abs_error", std::to_string(error));
}

TEST_P(Parity, IncrementalDecodeMatchesTransformers) {
  const Fixture& f = load_fixture(GetParam());
  ReferenceModel model(f.config, f.weights);
  KvCache cache(f.config);
  auto logits = model.forward(f.prompt, cache);
  float error = expect_logits_match(logits, f.logits, 0, int(f.prompt.size()), "prompt");
  for (size_t i = 0; i < f.teacher_forced.size(); ++i) {
    const int token[] = {f.teacher_forced[i]};
    logits = model.forward(token, cache);
    error = std::max(error,
                     expect_logits_match(logits, f.logits, int(f.prompt.size() + i), 1, "decode"));
  }
  EXPECT_EQ(cache.length(), int(f.prompt.size() + f.teacher_forced.size()));
  std::printf("[%s] incremental decode max |logit error| = %.3g\n", GetParam().c_str(), error);
  RecordProperty("max_abs_error", std::to_string(error));
}

TEST_P(Parity, ChunkedPrefillMatchesTransformers) {
  const Fixture& f = load_fixture(GetParam());
  ReferenceModel model(f.config, f.weights);
  KvCache cache(f.config);
  std::vector<int> tokens = f.prompt;
  tokens.insert(tokens.end(), f.teacher_forced.begin(), f.teacher_forced.end());
  const size_t split = tokens.size() / 3;
  const std::span<const int> all(tokens);
  auto first = model.forward(all.first(split), cache);
  auto rest = model.forward(all.subspan(split), cache);
  expect_logits_match(first, f.logits, 0, int(split), "chunk 1");
  expect_logits_match(rest, f.logits, int(split), int(tokens.size() - split), "chunk 2");
}

TEST_P(Parity, GreedyTokensMatchTransformers) {
  const Fixture& f = load_fixture(GetParam());
  ReferenceModel model(f.config, f.weights);
  GenerateRequest request;
  request.prompt = f.prompt;
  request.max_new_tokens = int(f.greedy.size());
  request.keep_logits = true;
  KvCache cache(f.config);
  const GenerateResult result =
      generate(reference_forward(model, cache), f.config.vocab_size, request);
  EXPECT_EQ(result.tokens, f.greedy);
  const int rows = int(f.prompt.size() + f.greedy.size());
  const float error = expect_logits_match(result.logits, f.greedy_logits, 0, rows, "greedy run");
  std::printf("[%s] greedy run max |logit error| = %.3g\n", GetParam().c_str(), error);
}

std::vector<std::string> fixtures() {
  std::vector<std::string> names;
  if (!std::filesystem::is_directory(kParityDir))
    return names;  // BothArchitecturesArePresent fails
  for (const auto& entry : std::filesystem::directory_iterator(kParityDir))
    if (std::filesystem::exists(entry.path() / "golden" / "meta.json"))
      names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Parity, ::testing::ValuesIn(fixtures()),
                         [](const auto& param_info) { return param_info.param; });

TEST(ParityFixtures, BothArchitecturesArePresent) {
  bool glm = false, deepseek = false;
  for (const auto& name : fixtures()) {
    const ModelConfig config = load_model_config(kParityDir / name / "model");
    glm |= config.arch == Architecture::kGlmMoeDsa;
    deepseek |= config.arch == Architecture::kDeepseekV3;
  }
  EXPECT_TRUE(glm) << "no GlmMoeDsaForCausalLM parity fixture in " << kParityDir;
  EXPECT_TRUE(deepseek) << "no DeepseekV3ForCausalLM parity fixture in " << kParityDir;
}

}  // namespace
}  // namespace colibri
