// config.json -> ModelConfig: the values the forward pass relies on, and an Error naming the
// file and field for every missing, mistyped, out-of-range or unsupported field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "model/config.h"
#include "model_writer.h"

namespace colibri {
namespace {

using test::json;
using test::TinyArch;
using test::TinyModel;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

json glm_config() {
  return TinyModel({.arch = TinyArch::kGlm5}).config;
}
json dsv3_config() {
  return TinyModel({.arch = TinyArch::kDeepseekV3}).config;
}

ModelConfig parse(const json& config) {
  return parse_model_config(config.dump(), "tiny/config.json");
}

TEST(Config, Glm5) {
  const ModelConfig c = parse(glm_config());
  EXPECT_EQ(c.arch, Architecture::kGlmMoeDsa);
  EXPECT_EQ(c.architecture_name, "GlmMoeDsaForCausalLM");
  EXPECT_EQ(c.vocab_size, TinyModel::kVocab);
  EXPECT_EQ(c.hidden_size, TinyModel::kHidden);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.intermediate_size, TinyModel::kIntermediate);
  EXPECT_EQ(c.num_heads, TinyModel::kHeads);
  EXPECT_EQ(c.q_lora_rank, TinyModel::kQLoraRank);
  EXPECT_EQ(c.kv_lora_rank, TinyModel::kKvLoraRank);
  EXPECT_EQ(c.qk_head_dim(), TinyModel::kNope + TinyModel::kRope);
  EXPECT_EQ(c.v_head_dim, TinyModel::kVHead);
  EXPECT_THAT(c.layer_is_moe, ElementsAre(false, true));
  EXPECT_EQ(c.num_moe_layers(), 1);
  EXPECT_EQ(c.n_routed_experts, 4);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.n_group, 2);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_TRUE(c.has_indexer());
  EXPECT_EQ(c.index_topk, TinyModel::kIndexTopk);
  EXPECT_EQ(c.index_n_heads, TinyModel::kIndexHeads);
  EXPECT_EQ(c.index_head_dim, TinyModel::kIndexHeadDim);
  EXPECT_THAT(c.indexer_is_full, ElementsAre(true, false));
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_FALSE(c.rope.yarn);
  EXPECT_TRUE(c.rope.interleave);
  EXPECT_FALSE(c.fp8_block);
  EXPECT_THAT(c.generation.eos_token_ids, ElementsAre(1));
  EXPECT_EQ(c.generation.bos_token_id, 0);
  EXPECT_FLOAT_EQ(c.softmax_scale(), float(1 / std::sqrt(6.0)));
}

TEST(Config, DeepseekV3WithYarn) {
  const ModelConfig c = parse(dsv3_config());
  EXPECT_EQ(c.arch, Architecture::kDeepseekV3);
  EXPECT_THAT(c.layer_is_moe, ElementsAre(false, true));
  EXPECT_FALSE(c.has_indexer());
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 40.0);
  EXPECT_DOUBLE_EQ(c.rope.original_max_position_embeddings, 64.0);
  EXPECT_DOUBLE_EQ(c.rope.mscale_all_dim, 1.0);
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_FLOAT_EQ(c.softmax_scale(), float(mscale * mscale / std::sqrt(6.0)));
}

TEST(Config, RopeInterleaveFlagIsReadForDeepseekOnly) {
  json config = dsv3_config();
  config["rope_interleave"] = false;
  EXPECT_FALSE(parse(config).rope.interleave);
  config = glm_config();
  config["rope_interleave"] = false;
  EXPECT_TRUE(parse(config).rope.interleave);
}

TEST(Config, Glm5DefaultsWithoutLayerTypeLists) {
  json config = glm_config();
  config.erase("mlp_layer_types");
  config.erase("indexer_types");
  config["num_hidden_layers"] = 5;
  // first_k_dense_replace defaults to 3; indexer: full where max(l - offset + 1, 0) % freq == 0.
  config["index_topk_freq"] = 2;
  const ModelConfig c = parse(config);
  EXPECT_THAT(c.layer_is_moe, ElementsAre(false, false, false, true, true));
  EXPECT_THAT(c.indexer_is_full, ElementsAre(true, true, false, true, false));
}

// A top-k beyond the context selects every key either way: bounded by the context, so that
// nothing is sized by it (1e9 once took 12 GB for 4 tokens).
TEST(Config, IndexTopkIsBoundedByTheContext) {
  json config = glm_config();
  config["index_topk"] = 1000000000;
  const ModelConfig c = parse(config);
  EXPECT_EQ(c.index_topk, c.max_position_embeddings);
  config["index_topk"] = 3;
  EXPECT_EQ(parse(config).index_topk, 3);
}

TEST(Config, IndexTopkPattern) {
  json config = glm_config();
  config.erase("indexer_types");
  config["num_hidden_layers"] = 4;
  config["mlp_layer_types"] = {"dense", "sparse", "sparse", "dense"};
  config["index_topk_pattern"] = "FSSF";
  const ModelConfig c = parse(config);
  EXPECT_THAT(c.layer_is_moe, ElementsAre(false, true, true, false));
  EXPECT_THAT(c.indexer_is_full, ElementsAre(true, false, false, true));
}

TEST(Config, Glm5YarnInRopeParameters) {
  json config = glm_config();
  config["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 5e5},
                               {"factor", 4.0},       {"original_max_position_embeddings", 32},
                               {"beta_fast", 0},      {"attention_factor", 1.25}};
  const ModelConfig c = parse(config);
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_DOUBLE_EQ(c.rope.theta, 5e5);
  EXPECT_DOUBLE_EQ(c.rope.factor, 4.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 32);  // 0 means the default, as in transformers
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1);
  EXPECT_EQ(c.rope.attention_factor, 1.25);
}

TEST(Config, Fp8QuantizationBlock) {
  json config = dsv3_config();
  config["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}};
  EXPECT_EQ(parse(config).fp8_block, (std::array<int, 2>{128, 128}));
  config["quantization_config"]["weight_block_size"] = {64, 32};
  EXPECT_EQ(parse(config).fp8_block, (std::array<int, 2>{64, 32}));
}

TEST(Config, GenerationConfigOverridesDefaults) {
  test::TempDir dir;
  TinyModel model;
  test::write_json_file(dir.path() / "config.json", model.config);
  test::write_json_file(
      dir.path() / "generation_config.json",
      {{"eos_token_id", {2, 3}}, {"do_sample", true}, {"temperature", 0.6}, {"top_p", 0.95}});
  const ModelConfig c = load_model_config(dir.path());
  EXPECT_THAT(c.generation.eos_token_ids, ElementsAre(2, 3));
  EXPECT_TRUE(c.generation.do_sample);
  EXPECT_FLOAT_EQ(c.generation.temperature, 0.6f);
  EXPECT_FLOAT_EQ(c.generation.top_p, 0.95f);
}

// ---- errors from load_model_config: the file at fault is named ------------------------------

void expect_load_error(const test::fs::path& dir, const std::vector<std::string>& expected) {
  try {
    load_model_config(dir);
    FAIL() << "loaded without error";
  } catch (const Error& e) {
    for (const auto& part : expected) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

TEST(Config, MissingConfigJson) {
  test::TempDir dir;
  expect_load_error(dir.path(), {(dir.path() / "config.json").string(), "missing"});
}

TEST(Config, EosOutsideVocabulary) {
  test::TempDir dir;
  TinyModel model;
  model.config["eos_token_id"] = {1, TinyModel::kVocab};
  test::write_json_file(dir.path() / "config.json", model.config);
  expect_load_error(dir.path(), {(dir.path() / "config.json").string(), "eos_token_id 32",
                                 "outside the vocabulary of 32"});
}

TEST(Config, EosOutsideVocabularyNamesGenerationConfig) {
  test::TempDir dir;
  TinyModel model;
  test::write_json_file(dir.path() / "config.json", model.config);
  test::write_json_file(dir.path() / "generation_config.json", {{"eos_token_id", 1000}});
  expect_load_error(dir.path(),
                    {(dir.path() / "generation_config.json").string(), "eos_token_id 1000"});
}

TEST(Config, GenerationConfigNotJson) {
  test::TempDir dir;
  TinyModel model;
  test::write_json_file(dir.path() / "config.json", model.config);
  test::write_file_bytes(dir.path() / "generation_config.json", "{\"eos_token_id\": ");
  expect_load_error(dir.path(),
                    {(dir.path() / "generation_config.json").string(), "not valid JSON"});
}

TEST(Config, GenerationConfigBadTemperature) {
  test::TempDir dir;
  TinyModel model;
  test::write_json_file(dir.path() / "config.json", model.config);
  test::write_json_file(dir.path() / "generation_config.json", {{"temperature", "hot"}});
  expect_load_error(dir.path(),
                    {(dir.path() / "generation_config.json").string(), "'temperature'"});
}

// ---- errors from parse_model_config: one table ----------------------------------------------

struct BadConfig {
  const char* name;
  TinyArch arch;
  std::function<void(json&)> edit;
  std::vector<std::string> expected;  // besides the source name
};

// What gtest prints for the parameter, and so the case name ctest shows.
void PrintTo(const BadConfig& c, std::ostream* os) {
  *os << c.name;
}

constexpr TinyArch kGlm = TinyArch::kGlm5;
constexpr TinyArch kDsv3 = TinyArch::kDeepseekV3;

const BadConfig kBadConfigs[] = {
    {"NoArchitectures",
     kGlm,
     [](json& c) { c.erase("architectures"); },
     {"missing field 'architectures'"}},
    {"NullArchitectures",
     kGlm,
     [](json& c) { c["architectures"] = nullptr; },
     {"missing field 'architectures'"}},
    {"ArchitecturesNotList",
     kGlm,
     [](json& c) { c["architectures"] = "GlmMoeDsaForCausalLM"; },
     {"'architectures' must be a list of strings"}},
    {"TwoArchitectures",
     kGlm,
     [](json& c) { c["architectures"].push_back("DeepseekV3ForCausalLM"); },
     {"'architectures' must name one architecture"}},
    {"UnknownArchitecture",
     kGlm,
     [](json& c) { c["architectures"] = {"LlamaForCausalLM"}; },
     {"architecture 'LlamaForCausalLM' is not supported"}},
    {"MissingHiddenSize",
     kGlm,
     [](json& c) { c.erase("hidden_size"); },
     {"missing field 'hidden_size'"}},
    {"NegativeHiddenSize",
     kGlm,
     [](json& c) { c["hidden_size"] = -16; },
     {"'hidden_size' = -16 is out of range"}},
    {"HugeHiddenSize",
     kGlm,
     [](json& c) { c["hidden_size"] = 1ll << 40; },
     {"'hidden_size'", "out of range"}},
    {"HiddenSizeU64Max",
     kGlm,
     [](json& c) { c["hidden_size"] = ~0ull; },
     {"'hidden_size'", "out of range"}},
    {"HiddenSizeString",
     kGlm,
     [](json& c) { c["hidden_size"] = "16"; },
     {"'hidden_size' must be an integer"}},
    {"HiddenSizeFractional",
     kGlm,
     [](json& c) { c["hidden_size"] = 16.5; },
     {"'hidden_size' must be an integer"}},
    {"ZeroVocab", kGlm, [](json& c) { c["vocab_size"] = 0; }, {"'vocab_size' = 0 is out of range"}},
    {"MissingLayers",
     kDsv3,
     [](json& c) { c.erase("num_hidden_layers"); },
     {"missing field 'num_hidden_layers'"}},
    {"EpsString",
     kGlm,
     [](json& c) { c["rms_norm_eps"] = "1e-6"; },
     {"'rms_norm_eps' must be a number"}},
    {"EpsNegative",
     kGlm,
     [](json& c) { c["rms_norm_eps"] = -1e-6; },
     {"'rms_norm_eps'", "out of range"}},
    {"TieEmbeddingsString",
     kGlm,
     [](json& c) { c["tie_word_embeddings"] = "yes"; },
     {"'tie_word_embeddings' must be true or false"}},
    {"GeluActivation",
     kGlm,
     [](json& c) { c["hidden_act"] = "gelu"; },
     {"hidden_act 'gelu' is not supported"}},
    {"AttentionBias", kDsv3, [](json& c) { c["attention_bias"] = true; }, {"attention_bias"}},
    {"GroupedKvHeads",
     kDsv3,
     [](json& c) { c["num_key_value_heads"] = 1; },
     {"num_key_value_heads = 1 must equal num_attention_heads = 2"}},
    {"GlmWithoutQLora",
     kGlm,
     [](json& c) { c.erase("q_lora_rank"); },
     {"missing field 'q_lora_rank'"}},
    {"OddRopeDim",
     kGlm,
     [](json& c) { c["qk_rope_head_dim"] = 3; },
     {"qk_rope_head_dim = 3 must be even"}},
    {"UnsupportedRopeType",
     kGlm,
     [](json& c) { c["rope_parameters"]["rope_type"] = "linear"; },
     {"rope type 'linear' is not supported"}},
    {"UnsupportedRopeScalingType",
     kDsv3,
     [](json& c) { c["rope_scaling"]["type"] = "dynamic"; },
     {"rope type 'dynamic' is not supported"}},
    {"RopeParametersNotObject",
     kGlm,
     [](json& c) {
       c["rope_parameters"] = {1, 2};
     },
     {"'rope_parameters' must be an object"}},
    {"YarnWithoutFactor",
     kDsv3,
     [](json& c) { c["rope_scaling"].erase("factor"); },
     {"rope_parameters", "missing field 'factor'"}},
    {"NegativeRopeTheta",
     kDsv3,
     [](json& c) { c["rope_theta"] = -1.0; },
     {"'rope_theta'", "out of range"}},
    {"SoftmaxScoring",
     kDsv3,
     [](json& c) { c["scoring_func"] = "softmax"; },
     {"scoring_func 'softmax'"}},
    {"GreedyTopk", kDsv3, [](json& c) { c["topk_method"] = "greedy"; }, {"topk_method 'greedy'"}},
    {"MlpLayerTypesWrongLength",
     kGlm,
     [](json& c) { c["mlp_layer_types"] = {"dense"}; },
     {"'mlp_layer_types' has 1 entries, num_hidden_layers is 2"}},
    {"MlpLayerTypesUnknownEntry",
     kGlm,
     [](json& c) { c["mlp_layer_types"][1] = "moe"; },
     {"'mlp_layer_types' has unknown entry 'moe'"}},
    {"MoeWithoutExperts",
     kGlm,
     [](json& c) { c.erase("n_routed_experts"); },
     {"'n_routed_experts' > 0"}},
    {"MissingExpertsPerToken",
     kDsv3,
     [](json& c) { c.erase("num_experts_per_tok"); },
     {"missing field 'num_experts_per_tok'"}},
    {"MoreExpertsPerTokenThanExperts",
     kGlm,
     [](json& c) { c["num_experts_per_tok"] = 5; },
     {"'num_experts_per_tok' = 5 is out of range [1, 4]"}},
    {"ExpertsNotDivisibleByGroups",
     kDsv3,
     [](json& c) { c["n_group"] = 3; },
     {"n_routed_experts = 4 is not divisible by n_group = 3"}},
    {"MoreGroupsThanExperts",
     kDsv3,
     [](json& c) { c["n_group"] = 8; },
     {"'n_group' = 8 is out of range [1, 4]"}},
    {"OneExpertPerGroup",
     kDsv3,
     [](json& c) { c["n_group"] = 4; },
     {"fewer than 2 experts per group"}},
    {"TopkGroupAboveGroups",
     kDsv3,
     [](json& c) { c["topk_group"] = 3; },
     {"'topk_group' = 3 is out of range [1, 2]"}},
    {"TopkBeyondSelectedGroups",
     kDsv3,
     [](json& c) { c["num_experts_per_tok"] = 3; },
     {"num_experts_per_tok = 3 exceeds the 2 experts in topk_group = 1 groups"}},
    {"MissingMoeIntermediate",
     kGlm,
     [](json& c) { c.erase("moe_intermediate_size"); },
     {"missing field 'moe_intermediate_size'"}},
    {"GlmWithoutIndexTopk",
     kGlm,
     [](json& c) { c.erase("index_topk"); },
     {"missing field 'index_topk'"}},
    {"IndexHeadDimBelowRope",
     kGlm,
     [](json& c) { c["index_head_dim"] = 1; },
     {"index_head_dim = 1 is smaller than qk_rope_head_dim = 2"}},
    {"IndexerStartsShared",
     kGlm,
     [](json& c) {
       c["indexer_types"] = {"shared", "full"};
     },
     {"indexer layer 0 is 'shared'"}},
    {"IndexerTypesWrongLength",
     kGlm,
     [](json& c) {
       c["indexer_types"] = {"full", "full", "full"};
     },
     {"'indexer_types' has 3 entries"}},
    {"IndexTopkPatternBadChar",
     kGlm,
     [](json& c) {
       c.erase("indexer_types");
       c["index_topk_pattern"] = "FX";
     },
     {"'index_topk_pattern' must be 2 characters of F/S"}},
    {"QuantizationNotObject",
     kDsv3,
     [](json& c) { c["quantization_config"] = "fp8"; },
     {"'quantization_config' must be an object"}},
    {"QuantizationAwq",
     kDsv3,
     [](json& c) {
       c["quantization_config"] = {{"quant_method", "awq"}};
     },
     {"quant_method 'awq' is not supported"}},
    {"QuantizationE5m2",
     kDsv3,
     [](json& c) {
       c["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e5m2"}};
     },
     {"quantization_config.fmt 'e5m2'"}},
    {"QuantizationBlockOneNumber",
     kDsv3,
     [](json& c) {
       c["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128}}};
     },
     {"weight_block_size must be two positive integers"}},
    {"QuantizationBlockZero",
     kDsv3,
     [](json& c) {
       c["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {0, 128}}};
     },
     {"weight_block_size must be two positive integers"}},
    {"NegativeEos",
     kGlm,
     [](json& c) { c["eos_token_id"] = -1; },
     {"'eos_token_id' = -1 is out of range"}},
    {"EosString",
     kGlm,
     [](json& c) { c["eos_token_id"] = "</s>"; },
     {"'eos_token_id' must be an integer"}},
    {"TooManyMtpLayers",
     kDsv3,
     [](json& c) { c["num_nextn_predict_layers"] = 100; },
     {"'num_nextn_predict_layers' = 100 is out of range"}},
};

class BadConfigs : public ::testing::TestWithParam<BadConfig> {};

TEST_P(BadConfigs, RefusedWithErrorNamingFileAndField) {
  const BadConfig& bad = GetParam();
  json config = TinyModel({.arch = bad.arch}).config;
  ASSERT_NO_THROW(parse(config)) << "the unedited config must be valid";
  bad.edit(config);
  try {
    parse(config);
    FAIL() << "parsed without error: " << config.dump();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_THAT(message, HasSubstr("tiny/config.json"));
    for (const auto& part : bad.expected) EXPECT_THAT(message, HasSubstr(part));
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Config, BadConfigs, ::testing::ValuesIn(kBadConfigs));

TEST(Config, NotJson) {
  for (const char* text : {"", "{\"vocab_size\": 32,", "vocab_size = 32", "{\"a\": 1} trailing"}) {
    SCOPED_TRACE(text);
    try {
      parse_model_config(text, "tiny/config.json");
      FAIL() << "parsed without error";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("tiny/config.json: not valid JSON"));
    }
  }
  EXPECT_THROW(parse_model_config("[1, 2]", "tiny/config.json"), Error);
  EXPECT_THROW(parse_model_config("null", "tiny/config.json"), Error);
}

}  // namespace
}  // namespace colibri
