// The "bad input" acceptance: a valid tiny model directory loads exactly (config -> Checkpoint
// -> load_model_weights, FP8 block dequantization included); every corrupted variant is refused
// with one colibri::Error line naming the file and the tensor or field at fault.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/error.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"
#include "model_writer.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using test::json;
using test::Tensor;
using test::TinyArch;
using test::TinyModel;
using test::TinyModelOptions;
using ::testing::HasSubstr;

ModelWeights load_directory(const fs::path& dir, const LoadOptions& options = {}) {
  const ModelConfig config = load_model_config(dir);
  const Checkpoint checkpoint(dir, config.fp8_block);
  return load_model_weights(config, checkpoint, options);
}

// Every loaded buffer by its checkpoint name, following the naming in weights.cpp.
std::map<std::string, const std::vector<float>*> by_name(const ModelWeights& w) {
  std::map<std::string, const std::vector<float>*> out;
  auto add = [&](const std::string& name, const std::vector<float>& data) {
    if (!data.empty()) out[name] = &data;
  };
  auto add_mlp = [&](const std::string& p, const MlpWeights& m) {
    add(p + "gate_proj.weight", m.gate.data);
    add(p + "up_proj.weight", m.up.data);
    add(p + "down_proj.weight", m.down.data);
  };
  auto add_layer = [&](int l, const LayerWeights& layer) {
    const std::string p = layer_prefix(l), a = p + "self_attn.";
    add(p + "input_layernorm.weight", layer.input_norm);
    add(p + "post_attention_layernorm.weight", layer.post_attention_norm);
    add(a + "q_a_proj.weight", layer.attn.q_a_proj.data);
    add(a + "q_a_layernorm.weight", layer.attn.q_a_norm);
    add(a + "q_b_proj.weight", layer.attn.q_b_proj.data);
    add(a + "q_proj.weight", layer.attn.q_proj.data);
    add(a + "kv_a_proj_with_mqa.weight", layer.attn.kv_a_proj.data);
    add(a + "kv_a_layernorm.weight", layer.attn.kv_a_norm);
    add(a + "kv_b_proj.weight", layer.attn.kv_b_proj.data);
    add(a + "o_proj.weight", layer.attn.o_proj.data);
    if (layer.attn.indexer) {
      const IndexerWeights& idx = *layer.attn.indexer;
      add(a + "indexer.wq_b.weight", idx.wq_b.data);
      add(a + "indexer.wk.weight", idx.wk.data);
      add(a + "indexer.weights_proj.weight", idx.weights_proj.data);
      add(a + "indexer.k_norm.weight", idx.k_norm_weight);
      add(a + "indexer.k_norm.bias", idx.k_norm_bias);
    }
    add_mlp(p + "mlp.", layer.dense_mlp);
    add(p + "mlp.gate.weight", layer.router.data);
    add(p + "mlp.gate.e_score_correction_bias", layer.router_bias);
    add_mlp(p + "mlp.shared_experts.", layer.shared_experts);
    for (size_t e = 0; e < layer.experts.size(); ++e)
      add_mlp(expert_prefix(l, int(e)), layer.experts[e]);
  };
  add("model.embed_tokens.weight", w.embed.data);
  add("model.norm.weight", w.final_norm);
  add("lm_head.weight", w.lm_head.data);
  for (size_t l = 0; l < w.layers.size(); ++l) add_layer(int(l), w.layers[l]);
  for (size_t i = 0; i < w.mtp.size(); ++i) {
    const int l = int(w.layers.size() + i);
    const std::string p = layer_prefix(l);
    add(p + "eh_proj.weight", w.mtp[i].eh_proj.data);
    add(p + "enorm.weight", w.mtp[i].enorm);
    add(p + "hnorm.weight", w.mtp[i].hnorm);
    add(p + "shared_head.norm.weight", w.mtp[i].head_norm);
    add_layer(l, w.mtp[i].layer);
  }
  return out;
}

// ---- valid models ---------------------------------------------------------------------------

struct ValidCase {
  const char* name;
  TinyModelOptions options;
};

// What gtest prints for the parameter, and so the case name ctest shows.
void PrintTo(const ValidCase& c, std::ostream* os) {
  *os << c.name;
}

class ValidModel : public ::testing::TestWithParam<ValidCase> {};

TEST_P(ValidModel, LoadsEveryTensorExactly) {
  const TinyModel model(GetParam().options);
  test::TempDir dir;
  model.write(dir.path());

  const ModelConfig config = load_model_config(dir.path());
  const Checkpoint checkpoint(dir.path(), config.fp8_block);
  EXPECT_EQ(checkpoint.names().size(), model.tensors.size());
  const ModelWeights weights = load_model_weights(config, checkpoint);
  ASSERT_EQ(weights.layers.size(), 2u);
  EXPECT_FALSE(weights.layers[0].is_moe);
  EXPECT_TRUE(weights.layers[1].is_moe);
  EXPECT_EQ(weights.layers[0].attn.indexer.has_value(), model.glm());
  EXPECT_FALSE(weights.layers[1].attn.indexer.has_value());
  EXPECT_EQ(weights.mtp.size(), size_t(model.options().mtp_layers));

  const auto loaded = by_name(weights);
  uint64_t payload_bytes = 0;
  for (const Tensor& t : model.tensors) {
    SCOPED_TRACE(t.name);
    payload_bytes += t.bytes.size();
    const auto it = loaded.find(t.name);
    ASSERT_NE(it, loaded.end()) << "not loaded";
    EXPECT_EQ(*it->second, t.values);
  }
  EXPECT_EQ(loaded.size(), model.tensors.size() + (model.options().tie_embeddings ? 1 : 0));
  EXPECT_EQ(checkpoint.bytes_loaded(), payload_bytes);  // every tensor read exactly once
  if (model.options().tie_embeddings) {
    EXPECT_EQ(weights.lm_head.data, weights.embed.data);
  }
}

const ValidCase kValidCases[] = {
    {"Glm5TwoShardsF32", {.arch = TinyArch::kGlm5, .shards = 2, .dtype = "F32"}},
    {"Glm5OneFileBf16", {.arch = TinyArch::kGlm5, .shards = 1, .dtype = "BF16"}},
    {"Glm5WithMtp", {.arch = TinyArch::kGlm5, .shards = 3, .dtype = "BF16", .mtp_layers = 1}},
    {"DeepseekV3ThreeShardsBf16",
     {.arch = TinyArch::kDeepseekV3, .shards = 3, .dtype = "BF16", .mtp_layers = 1}},
    {"DeepseekV3PlainQProjTied",
     {.arch = TinyArch::kDeepseekV3, .shards = 2, .q_lora = false, .tie_embeddings = true}},
};

INSTANTIATE_TEST_SUITE_P(Loader, ValidModel, ::testing::ValuesIn(kValidCases));

TEST(Loader, DirectoryOfShardsWithoutIndex) {
  TinyModel model;
  test::TempDir dir;
  model.write(dir.path());
  fs::remove(dir.path() / "model.safetensors.index.json");
  const auto loaded = load_directory(dir.path());
  EXPECT_EQ(loaded.embed.data, model.tensor("model.embed_tokens.weight").values);
}

TEST(Loader, ExpertRankLoadsOnlyItsExperts) {
  TinyModel model;
  test::TempDir dir;
  model.write(dir.path());
  LoadOptions options;
  options.dense = false;
  options.owns_expert = [](int layer, int expert) { return layer == 1 && expert % 2 == 1; };
  const ModelWeights w = load_directory(dir.path(), options);
  EXPECT_TRUE(w.embed.empty());
  EXPECT_TRUE(w.layers[1].attn.o_proj.empty());
  ASSERT_EQ(w.layers[1].experts.size(), size_t(TinyModel::kExperts));
  for (int e = 0; e < TinyModel::kExperts; ++e) {
    SCOPED_TRACE(e);
    const MlpWeights& expert = w.layers[1].experts[size_t(e)];
    EXPECT_EQ(expert.empty(), e % 2 == 0);
    if (!expert.empty()) {
      EXPECT_EQ(expert.down.data, model.tensor(expert_prefix(1, e) + "down_proj.weight").values);
    }
  }
}

// ---- FP8 block dequantization ---------------------------------------------------------------

// E4M3 bytes with hand-checked values (bias 7): the payload cycles through them.
struct Fp8Value {
  uint8_t bits;
  float value;
};
constexpr Fp8Value kFp8Values[] = {{0x38, 1.0f},   {0x40, 2.0f},    {0x30, 0.5f},  {0xb8, -1.0f},
                                   {0x00, 0.0f},   {0x3c, 1.5f},    {0xc4, -3.0f}, {0x48, 4.0f},
                                   {0x7e, 448.0f}, {0x01, 0x1p-9f}, {0x80, -0.0f}};
constexpr float kScales[] = {0.5f, 2.0f, 4.0f, 0.25f, 8.0f, 1.0f, 16.0f, 0.125f, 32.0f, 64.0f};

size_t fp8_index(int64_t i, int64_t j) {
  return size_t(i * 7 + j * 3) % std::size(kFp8Values);
}

// An F8_E4M3 weight [rows, cols] and its F32 scale_inv [ceil(rows/br), ceil(cols/bc)].
std::pair<Tensor, Tensor> fp8_weight(const std::string& name, int64_t rows, int64_t cols, int br,
                                     int bc) {
  Tensor w{name, "F8_E4M3", {rows, cols}, {}, {}};
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) w.bytes.push_back(kFp8Values[fp8_index(i, j)].bits);
  Tensor s{name + "_scale_inv", "F32", {(rows + br - 1) / br, (cols + bc - 1) / bc}, {}, {}};
  for (int64_t k = 0; k < s.numel(); ++k) {
    const uint32_t bits = std::bit_cast<uint32_t>(kScales[size_t(k) % std::size(kScales)]);
    for (int b = 0; b < 4; ++b) s.bytes.push_back(uint8_t(bits >> (8 * b)));
  }
  return {w, s};
}

// Products of a power of two and a small value: exact, so compared with ==.
std::vector<float> fp8_expected(int64_t rows, int64_t cols, int br, int bc) {
  const int64_t scale_cols = (cols + bc - 1) / bc;
  std::vector<float> out;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      out.push_back(kFp8Values[fp8_index(i, j)].value *
                    kScales[size_t((i / br) * scale_cols + j / bc) % std::size(kScales)]);
  return out;
}

TEST(Fp8, DequantizesWith128BlocksIncludingPartialOnes) {
  // 130 x 260: the last block row holds 2 rows, the last block column 4 columns.
  const auto [weight, scale] = fp8_weight("blk.w", 130, 260, 128, 128);
  ASSERT_EQ(scale.shape, (std::vector<int64_t>{2, 3}));
  test::TempDir dir;
  test::write_safetensors(dir.path() / "model.safetensors", {&weight, &scale});
  const Checkpoint checkpoint(dir.path(), std::array<int, 2>{128, 128});
  const std::vector<float> loaded = checkpoint.load_f32("blk.w", {130, 260});
  const std::vector<float> expected = fp8_expected(130, 260, 128, 128);
  ASSERT_EQ(loaded.size(), expected.size());
  int mismatches = 0;
  for (size_t k = 0; k < loaded.size(); ++k)
    mismatches += std::bit_cast<uint32_t>(loaded[k]) != std::bit_cast<uint32_t>(expected[k]);
  EXPECT_EQ(mismatches, 0);
  // Spot checks by hand: corners of the partial blocks.
  EXPECT_EQ(loaded[0], 0.5f);                  // (0, 0): 1.0 (0x38) in block (0, 0), scale 0.5
  EXPECT_EQ(loaded[1 * 260 + 130], 4.0f);      // (1, 130): 2.0 (0x40) in block (0, 1), scale 2
  EXPECT_EQ(loaded[128 * 260 + 0], 0.375f);    // (128, 0): 1.5 (0x3c) in block (1, 0), scale 0.25
  EXPECT_EQ(loaded[129 * 260 + 259], 448.0f);  // (129, 259): 448 (0x7e) in block (1, 2), scale 1
  EXPECT_EQ(checkpoint.bytes_loaded(), 130u * 260u + 6u * 4u);
}

TEST(Fp8, BlockSizeComesFromTheConfig) {
  const auto [weight, scale] = fp8_weight("blk.w", 130, 260, 64, 96);
  ASSERT_EQ(scale.shape, (std::vector<int64_t>{3, 3}));
  test::TempDir dir;
  test::write_safetensors(dir.path() / "model.safetensors", {&weight, &scale});
  EXPECT_EQ(Checkpoint(dir.path(), std::array<int, 2>{64, 96}).load_f32("blk.w", {130, 260}),
            fp8_expected(130, 260, 64, 96));
  EXPECT_THROW(Checkpoint(dir.path()).load_f32("blk.w", {130, 260}), Error);  // 128x128: [2, 3]
}

// Makes `name` an F8_E4M3 weight with its scale_inv in the model and declares fp8 in config.json.
void make_fp8(TinyModel& model, const std::string& name, bool with_scale = true) {
  Tensor& t = model.tensor(name);
  auto [weight, scale] = fp8_weight(name, t.shape[0], t.shape[1], 128, 128);
  t = weight;
  if (with_scale) model.tensors.push_back(scale);
  model.config["quantization_config"] = {{"quant_method", "fp8"},
                                         {"fmt", "e4m3"},
                                         {"activation_scheme", "dynamic"},
                                         {"weight_block_size", {128, 128}}};
}

TEST(Fp8, ModelWithFp8ProjectionsLoads) {
  TinyModel model({.arch = TinyArch::kDeepseekV3, .shards = 2, .dtype = "BF16"});
  const std::string q_b = "model.layers.1.self_attn.q_b_proj.weight";
  const std::string down = expert_prefix(1, 3) + "down_proj.weight";
  make_fp8(model, q_b);
  make_fp8(model, down);
  test::TempDir dir;
  model.write(dir.path());
  const ModelWeights w = load_directory(dir.path());
  EXPECT_EQ(w.layers[1].attn.q_b_proj.data, fp8_expected(12, 8, 128, 128));
  EXPECT_EQ(w.layers[1].experts[3].down.data,
            fp8_expected(TinyModel::kHidden, TinyModel::kMoeIntermediate, 128, 128));
  EXPECT_EQ(w.layers[1].experts[2].down.data,
            model.tensor(expert_prefix(1, 2) + "down_proj.weight").values);
}

// ---- corrupted models -----------------------------------------------------------------------

// What a case sees: the directory and the model that was written into it.
struct Written {
  const fs::path& dir;
  const TinyModel& model;
  fs::path shard(const std::string& tensor) const { return dir / model.shard_file(tensor); }
  fs::path shard_number(int i) const { return dir / model.shard_name(i); }
  fs::path index() const { return dir / "model.safetensors.index.json"; }
  fs::path config() const { return dir / "config.json"; }
};

struct CorruptCase {
  const char* name;
  TinyModelOptions options;
  std::function<void(TinyModel&)> edit_model;                        // before writing; may be empty
  std::function<void(const Written&)> corrupt_files;                 // after writing; may be empty
  std::function<std::vector<std::string>(const Written&)> expected;  // substrings of the error
};

// What gtest prints for the parameter, and so the case name ctest shows.
void PrintTo(const CorruptCase& c, std::ostream* os) {
  *os << c.name;
}

const std::string kQb1 = "model.layers.1.self_attn.q_b_proj.weight";
const std::string kKvNorm1 = "model.layers.1.self_attn.kv_a_layernorm.weight";
const std::string kInNorm0 = "model.layers.0.input_layernorm.weight";
const std::string kPostNorm0 = "model.layers.0.post_attention_layernorm.weight";
const std::string kEmbed = "model.embed_tokens.weight";

std::string str(const fs::path& path) {
  return path.string();
}

void truncate_file(const fs::path& path, uintmax_t bytes) {
  fs::resize_file(path, bytes);
}

void edit_tensor_entry(const fs::path& file, const std::string& tensor,
                       const std::function<void(json&)>& edit) {
  test::rewrite_header(file, [&](json& header) { edit(header.at(tensor)); });
}

void edit_config(const Written& w, const std::function<void(json&)>& edit) {
  json config = test::read_json_file(w.config());
  edit(config);
  test::write_json_file(w.config(), config);
}

void edit_index(const Written& w, const std::function<void(json&)>& edit) {
  json index = test::read_json_file(w.index());
  edit(index);
  test::write_json_file(w.index(), index);
}

const TinyModelOptions kGlmSharded{.arch = TinyArch::kGlm5, .shards = 2};
const TinyModelOptions kGlmSingle{.arch = TinyArch::kGlm5, .shards = 1};
const TinyModelOptions kDsv3Sharded{
    .arch = TinyArch::kDeepseekV3, .shards = 3, .dtype = "BF16", .mtp_layers = 1};

const CorruptCase kCorruptCases[] = {
    // -- shards and the index
    {"MissingShard",
     kGlmSharded,
     {},
     [](const Written& w) { fs::remove(w.shard_number(1)); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard_number(1)), "shard is missing"};
     }},
    {"ShardIsDirectory",
     kGlmSharded,
     {},
     [](const Written& w) {
       fs::remove(w.shard_number(0));
       fs::create_directory(w.shard_number(0));
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard_number(0)), "not a regular file"};
     }},
    {"NoSafetensorsAtAll",
     kGlmSharded,
     {},
     [](const Written& w) {
       fs::remove(w.index());
       fs::remove(w.shard_number(0));
       fs::remove(w.shard_number(1));
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.dir), "no safetensors files"};
     }},
    {"IndexNotJson",
     kGlmSharded,
     {},
     [](const Written& w) { test::write_file_bytes(w.index(), "{\"weight_map\": {"); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.index()), "not valid JSON"};
     }},
    {"IndexWithoutWeightMap",
     kGlmSharded,
     {},
     [](const Written& w) { edit_index(w, [](json& index) { index.erase("weight_map"); }); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.index()), "'weight_map'"};
     }},
    {"IndexPointsAtWrongShard",
     kGlmSharded,
     {},
     [](const Written& w) {
       edit_index(w, [&](json& index) { index["weight_map"][kEmbed] = w.model.shard_name(1); });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.index()), "tensor '" + kEmbed + "'",
                                       "the index says " + w.model.shard_name(1)};
     }},
    {"IndexNamesAbsentShard",
     kGlmSharded,
     {},
     [](const Written& w) {
       edit_index(w, [](json& index) {
         index["weight_map"][kEmbed] = "model-00003-of-00002.safetensors";
       });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.dir / "model-00003-of-00002.safetensors"), "missing"};
     }},
    {"IndexEscapesDirectory",
     kGlmSharded,
     {},
     [](const Written& w) {
       edit_index(
           w, [&](json& index) { index["weight_map"][kQb1] = "../" + w.model.shard_file(kQb1); });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.index()), "weight_map['" + kQb1 + "']",
                                       "not a file in the model directory"};
     }},
    {"TensorListedInIndexMissingFromShard",
     kGlmSharded,
     {},
     [](const Written& w) {
       test::rewrite_header(w.shard(kKvNorm1), [](json& header) { header.erase(kKvNorm1); });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kKvNorm1)), "tensor '" + kKvNorm1 + "'",
                                       "listed in the index is missing"};
     }},
    {"TensorInTwoShards",
     kGlmSharded,
     {},
     [](const Written& w) {
       // Append a copy of the embedding (shard 1) to shard 2.
       test::SafetensorsParts parts = test::split_safetensors(w.shard_number(1));
       const Tensor& embed = w.model.tensors.front();
       const uint64_t begin = parts.data.size();
       parts.data.append(embed.bytes.begin(), embed.bytes.end());
       parts.header[kEmbed] = {{"dtype", embed.dtype},
                               {"shape", embed.shape},
                               {"data_offsets", {begin, parts.data.size()}}};
       test::write_file_bytes(w.shard_number(1),
                              test::encode_safetensors(parts.header, parts.data));
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard_number(1)), "tensor '" + kEmbed + "'",
                                       "also appears in", str(w.shard_number(0))};
     }},
    // -- the bytes of one file
    {"ShorterThan8Bytes",
     kGlmSharded,
     {},
     [](const Written& w) { truncate_file(w.shard_number(1), 5); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard_number(1)), "truncated: 5 bytes"};
     }},
    {"EmptyFile",
     kGlmSingle,
     {},
     [](const Written& w) { truncate_file(w.dir / "model.safetensors", 0); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.dir / "model.safetensors"), "truncated: 0 bytes"};
     }},
    {"TruncatedInData",
     kGlmSharded,
     {},
     [](const Written& w) {
       truncate_file(w.shard_number(1), fs::file_size(w.shard_number(1)) - 6);
     },
     [](const Written& w) {
       // Computed from the intact copy's header: the rewritten file is cut.
       return std::vector<std::string>{str(w.shard_number(1)),
                                       "tensor '" + w.model.tensors.back().name + "'", "beyond the",
                                       "truncated?"};
     }},
    {"TruncatedSingleFile",
     kGlmSingle,
     {},
     [](const Written& w) {
       truncate_file(w.dir / "model.safetensors", fs::file_size(w.dir / "model.safetensors") / 2);
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.dir / "model.safetensors"), "tensor '", "beyond the"};
     }},
    {"TruncatedInHeader",
     kGlmSharded,
     {},
     [](const Written& w) { truncate_file(w.shard_number(0), 40); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard_number(0)), "header length",
                                       "runs past the end of the 40 byte file"};
     }},
    {"HeaderLengthOver100MB",
     kGlmSharded,
     {},
     [](const Written& w) {
       std::string bytes = test::read_file_bytes(w.shard_number(0));
       const uint64_t length = 200ull << 20;
       std::memcpy(bytes.data(), &length, 8);
       test::write_file_bytes(w.shard_number(0), bytes);
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard_number(0)), "header length 209715200 exceeds"};
     }},
    {"HeaderNotJson",
     kGlmSharded,
     {},
     [](const Written& w) {
       std::string bytes = test::read_file_bytes(w.shard_number(0));
       bytes[8 + 1] = ',';  // {,"__metadata__": ...
       test::write_file_bytes(w.shard_number(0), bytes);
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard_number(0)), "header is not valid JSON"};
     }},
    {"HeaderNotStartingWithBrace",
     kGlmSharded,
     {},
     [](const Written& w) {
       std::string bytes = test::read_file_bytes(w.shard_number(1));
       bytes[8] = 'X';
       test::write_file_bytes(w.shard_number(1), bytes);
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard_number(1)), "header does not start with '{'"};
     }},
    {"OverlappingOffsets",
     kGlmSharded,
     {},
     [](const Written& w) {
       test::rewrite_header(w.shard(kPostNorm0), [](json& header) {
         header[kPostNorm0]["data_offsets"] = header[kInNorm0]["data_offsets"];
       });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kPostNorm0)), kInNorm0, kPostNorm0, "overlap"};
     }},
    {"OffsetsBeyondData",
     kGlmSharded,
     {},
     [](const Written& w) {
       edit_tensor_entry(w.shard(kQb1), kQb1, [](json& e) {
         e["data_offsets"][1] = e["data_offsets"][1].get<uint64_t>() + (1u << 20);
       });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1)), "tensor '" + kQb1 + "'", "beyond the"};
     }},
    {"OffsetsBeginAfterEnd",
     kGlmSharded,
     {},
     [](const Written& w) {
       edit_tensor_entry(w.shard(kQb1), kQb1, [](json& e) {
         e["data_offsets"] = {e["data_offsets"][1], e["data_offsets"][0]};
       });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1)), "tensor '" + kQb1 + "'", "begin",
                                       "> end"};
     }},
    {"OffsetsNegative",
     kGlmSharded,
     {},
     [](const Written& w) {
       edit_tensor_entry(w.shard(kQb1), kQb1, [](json& e) { e["data_offsets"][0] = -4; });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1)), "tensor '" + kQb1 + "'", "non-negative"};
     }},
    {"ByteCountNotDtypeTimesShape",
     kGlmSharded,
     {},
     [](const Written& w) {
       edit_tensor_entry(w.shard(kQb1), kQb1, [](json& e) { e["dtype"] = "BF16"; });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1)), "tensor '" + kQb1 + "'",
                                       "384 bytes in data_offsets but dtype BF16"};
     }},
    {"UnknownDtype",
     kGlmSharded,
     {},
     [](const Written& w) {
       edit_tensor_entry(w.shard(kQb1), kQb1, [](json& e) { e["dtype"] = "F4_E2M1"; });
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1)), "tensor '" + kQb1 + "'",
                                       "unknown dtype 'F4_E2M1'"};
     }},
    // -- tensors that do not fit the config
    {"WrongShapeQbProj",
     kGlmSharded,
     [](TinyModel& m) {
       m.tensor(kQb1) = test::make_tensor(kQb1, {12, 9});
     },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1)), "tensor '" + kQb1 + "'",
                                       "has shape [12, 9], expected [12, 8]"};
     }},
    {"TransposedOProj",
     kDsv3Sharded,
     [](TinyModel& m) {
       const std::string name = "model.layers.0.self_attn.o_proj.weight";
       m.tensor(name) = test::make_tensor(name, {8, 16}, "BF16");
     },
     {},
     [](const Written& w) {
       return std::vector<std::string>{
           str(w.shard("model.layers.0.self_attn.o_proj.weight")),
           "'model.layers.0.self_attn.o_proj.weight' has shape [8, 16], expected [16, 8]"};
     }},
    {"WrongShapeExpert",
     kGlmSharded,
     [](TinyModel& m) {
       const std::string name = expert_prefix(1, 3) + "down_proj.weight";
       m.tensor(name) = test::make_tensor(name, {16, 9});
     },
     {},
     [](const Written& w) {
       const std::string name = expert_prefix(1, 3) + "down_proj.weight";
       return std::vector<std::string>{str(w.shard(name)), "tensor '" + name + "'",
                                       "expected [16, 8]"};
     }},
    {"ConfigDisagreesWithWeights",
     kGlmSharded,
     {},
     [](const Written& w) { edit_config(w, [](json& c) { c["hidden_size"] = 32; }); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kEmbed)), "tensor '" + kEmbed + "'",
                                       "expected [32, 32]"};
     }},
    {"MissingTensor",
     kGlmSharded,
     [](TinyModel& m) { m.remove(kKvNorm1); },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.dir), "tensor '" + kKvNorm1 + "' is missing"};
     }},
    {"MissingIndexerTensor",
     kGlmSingle,
     [](TinyModel& m) { m.remove("model.layers.0.self_attn.indexer.wk.weight"); },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.dir),
                                       "'model.layers.0.self_attn.indexer.wk.weight' is missing"};
     }},
    {"IncompleteMtpLayer",
     kDsv3Sharded,
     [](TinyModel& m) { m.remove("model.layers.2.hnorm.weight"); },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.dir), "'model.layers.2.hnorm.weight' is missing"};
     }},
    {"IntegerWeight",
     kGlmSharded,
     [](TinyModel& m) {
       Tensor& t = m.tensor(kKvNorm1);
       t.dtype = "I32";
     },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kKvNorm1)), "tensor '" + kKvNorm1 + "'",
                                       "dtype I32, expected a float type"};
     }},
    {"Fp8WithoutScaleInv",
     kGlmSharded,
     [](TinyModel& m) { make_fp8(m, kQb1, false); },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1)), "F8_E4M3 tensor '" + kQb1 + "'",
                                       "no '" + kQb1 + "_scale_inv'"};
     }},
    {"ScaleInvWrongShape",
     kGlmSharded,
     [](TinyModel& m) {
       make_fp8(m, kQb1);
       Tensor& s = m.tensor(kQb1 + "_scale_inv");
       s.shape = {1, 2};
       s.bytes.resize(8, 0);
     },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1 + "_scale_inv")),
                                       "tensor '" + kQb1 + "_scale_inv'",
                                       "has shape [1, 2], expected [1, 1]"};
     }},
    {"ScaleInvIntegerDtype",
     kGlmSharded,
     [](TinyModel& m) {
       make_fp8(m, kQb1);
       m.tensor(kQb1 + "_scale_inv").dtype = "I32";
     },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.shard(kQb1 + "_scale_inv")),
                                       "tensor '" + kQb1 + "_scale_inv'",
                                       "dtype I32, expected a float type"};
     }},
    // -- config.json
    {"ConfigMissing",
     kGlmSharded,
     {},
     [](const Written& w) { fs::remove(w.config()); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()), "missing"};
     }},
    {"ConfigNotJson",
     kGlmSharded,
     {},
     [](const Written& w) { test::write_file_bytes(w.config(), "{\"hidden_size\": 16,,}"); },
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()), "not valid JSON"};
     }},
    {"ConfigMissingHiddenSize",
     kGlmSharded,
     [](TinyModel& m) { m.config.erase("hidden_size"); },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()), "missing field 'hidden_size'"};
     }},
    {"ConfigNegativeHiddenSize",
     kDsv3Sharded,
     [](TinyModel& m) { m.config["hidden_size"] = -16; },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()), "'hidden_size' = -16 is out of range"};
     }},
    {"ConfigWrongType",
     kGlmSharded,
     [](TinyModel& m) { m.config["kv_lora_rank"] = "8"; },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()),
                                       "'kv_lora_rank' must be an integer, got \"8\""};
     }},
    {"ConfigTooManyExpertsPerToken",
     kGlmSharded,
     [](TinyModel& m) { m.config["num_experts_per_tok"] = 5; },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()),
                                       "'num_experts_per_tok' = 5 is out of range [1, 4]"};
     }},
    {"ConfigExpertsNotDivisibleByGroups",
     kDsv3Sharded,
     [](TinyModel& m) { m.config["n_group"] = 3; },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()),
                                       "n_routed_experts = 4 is not divisible by n_group = 3"};
     }},
    {"ConfigUnknownArchitecture",
     kGlmSharded,
     [](TinyModel& m) { m.config["architectures"] = {"MixtralForCausalLM"}; },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()),
                                       "architecture 'MixtralForCausalLM' is not supported"};
     }},
    {"ConfigUnsupportedRope",
     kGlmSharded,
     [](TinyModel& m) { m.config["rope_parameters"]["rope_type"] = "longrope"; },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()), "rope type 'longrope' is not supported"};
     }},
    {"ConfigEosOutsideVocab",
     kGlmSharded,
     [](TinyModel& m) {
       m.config["eos_token_id"] = {1, 32};
     },
     {},
     [](const Written& w) {
       return std::vector<std::string>{str(w.config()),
                                       "eos_token_id 32 is outside the vocabulary of 32"};
     }},
    {"GenerationConfigEosOutsideVocab",
     kGlmSharded,
     {},
     [](const Written& w) {
       test::write_json_file(w.dir / "generation_config.json", {{"eos_token_id", {1, 99}}});
     },
     [](const Written& w) {
       return std::vector<std::string>{str(w.dir / "generation_config.json"),
                                       "eos_token_id 99 is outside the vocabulary"};
     }},
};

class CorruptModel : public ::testing::TestWithParam<CorruptCase> {};

TEST_P(CorruptModel, RefusedWithOneLineNamingFileAndCulprit) {
  const CorruptCase& c = GetParam();
  TinyModel model(c.options);
  if (c.edit_model) c.edit_model(model);
  test::TempDir dir;
  model.write(dir.path());
  const Written written{dir.path(), model};
  const std::vector<std::string> expected = c.expected(written);  // before the files change
  if (c.corrupt_files) c.corrupt_files(written);
  try {
    load_directory(dir.path());
    FAIL() << "loaded without error";
  } catch (const Error& e) {
    const std::string message = e.what();
    ASSERT_FALSE(expected.empty());
    for (const auto& part : expected) EXPECT_THAT(message, HasSubstr(part));
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  } catch (const std::exception& e) {
    FAIL() << "not a colibri::Error: " << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Loader, CorruptModel, ::testing::ValuesIn(kCorruptCases));

// The valid directory each corrupted case starts from loads: no case passes by accident.
TEST(Loader, CorruptCasesStartFromValidModels) {
  for (const TinyModelOptions& options : {kGlmSharded, kGlmSingle, kDsv3Sharded}) {
    test::TempDir dir;
    TinyModel(options).write(dir.path());
    EXPECT_NO_THROW(load_directory(dir.path()));
  }
}

}  // namespace
}  // namespace colibri
