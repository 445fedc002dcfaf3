// compressed-tensors pack-quantized INT4 checkpoints: quantization_config read or refused with the
// field named, weights (`<name>_packed` / `_scale` / `_shape`, and `_zero_point` when asymmetric)
// read as the int4 container holds them, with the same numbers, and anything inconsistent refused
// naming the tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"
#include "model_writer.h"

namespace colibri {
namespace {

using test::json;
using test::Tensor;
using test::TinyArch;
using test::TinyModel;
using ::testing::HasSubstr;

json w4a16_config(json weights) {
  json config = TinyModel({.arch = TinyArch::kDeepseekV3}).config;
  config["quantization_config"] = {
      {"quant_method", "compressed-tensors"},
      {"format", "pack-quantized"},
      {"quantization_status", "compressed"},
      {"ignore", {"lm_head", "re:.*self_attn.*"}},
      {"config_groups",
       {{"group_0",
         {{"targets", {"Linear"}}, {"weights", weights}, {"input_activations", nullptr}}}}}};
  return config;
}

json group_weights(int group_size) {
  return {{"num_bits", 4},
          {"type", "int"},
          {"symmetric", true},
          {"strategy", "group"},
          {"group_size", group_size},
          {"dynamic", false},
          {"actorder", nullptr}};
}

ModelConfig parse(const json& config) {
  return parse_model_config(config.dump(), "tiny/config.json");
}

TEST(CompressedTensorsConfig, GroupAndChannelStrategies) {
  for (int g : {32, 64, 128}) EXPECT_EQ(parse(w4a16_config(group_weights(g))).int4_group_size, g);
  json channel = group_weights(0);
  channel["strategy"] = "channel";
  channel.erase("group_size");
  EXPECT_EQ(parse(w4a16_config(channel)).int4_group_size, 0);
  EXPECT_FALSE(parse(TinyModel({.arch = TinyArch::kDeepseekV3}).config).int4_group_size);
}

// symmetric false (zero points) is read for both strategies; symmetric is compressed-tensors'
// default.
TEST(CompressedTensorsConfig, AsymmetricGroupAndChannel) {
  EXPECT_FALSE(parse(w4a16_config(group_weights(32))).int4_zero_points);
  json group = group_weights(64);
  group["symmetric"] = false;
  const ModelConfig g = parse(w4a16_config(group));
  EXPECT_EQ(g.int4_group_size, 64);
  EXPECT_TRUE(g.int4_zero_points);
  json channel = group;
  channel["strategy"] = "channel";
  channel.erase("group_size");
  const ModelConfig c = parse(w4a16_config(channel));
  EXPECT_EQ(c.int4_group_size, 0);
  EXPECT_TRUE(c.int4_zero_points);
  json unstated = group_weights(32);
  unstated.erase("symmetric");
  EXPECT_FALSE(parse(w4a16_config(unstated)).int4_zero_points);
}

TEST(CompressedTensorsConfig, RefusalsNameTheField) {
  struct Case {
    std::function<void(json&)> edit;
    std::string expected;
  };
  const Case cases[] = {
      {[](json& q) { q["format"] = "nvfp4-pack-quantized"; }, "quantization_config.format"},
      {[](json& q) { q["config_groups"] = json::object(); }, "config_groups must be an object"},
      {[](json& q) { q["ignore"] = "lm_head"; }, "quantization_config.ignore"},
      {[](json& q) {
         q["config_groups"]["group_1"] = q["config_groups"]["group_0"];
         q["config_groups"]["group_1"]["weights"]["symmetric"] = false;
       },
       "weights.symmetric false differs from another group's"},
      {[](json& q) {
         q["config_groups"]["group_0"]["weights"]["symmetric"] = false;
         q["config_groups"]["group_0"]["weights"]["actorder"] = "group";
       },
       "weights.actorder"},
      {[](json& q) {
         q["config_groups"]["group_0"]["weights"]["symmetric"] = false;
         q["config_groups"]["group_0"]["weights"]["dynamic"] = true;
       },
       "weights.dynamic true"},
      {[](json& q) {
         q["config_groups"]["group_0"]["weights"]["symmetric"] = false;
         q["config_groups"]["group_0"]["input_activations"] = {{"num_bits", 8}};
       },
       "input_activations"},
      {[](json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 8; },
       "weights.num_bits 8"},
      {[](json& q) { q["config_groups"]["group_0"]["weights"]["type"] = "float"; },
       "weights.type 'float'"},
      {[](json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 40; },
       "weights.group_size 40"},
      {[](json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"; },
       "weights.strategy 'tensor'"},
      {[](json& q) { q["config_groups"]["group_0"]["weights"]["actorder"] = "group"; },
       "weights.actorder"},
      {[](json& q) {
         q["config_groups"]["group_0"]["input_activations"] = {{"num_bits", 8}};
       },
       "input_activations"},
      {[](json& q) {
         q["config_groups"]["group_1"] = q["config_groups"]["group_0"];
         q["config_groups"]["group_1"]["weights"]["group_size"] = 64;
       },
       "differs from another group's"},
      {[](json& q) { q["quant_method"] = "awq"; }, "quantization_config.quant_method 'awq'"},
      {[](json& q) { q["quant_method"] = "modelopt"; }, "quantization_config has no quant_algo"},
  };
  for (const Case& c : cases) {
    json config = w4a16_config(group_weights(32));
    c.edit(config["quantization_config"]);
    try {
      parse(config);
      ADD_FAILURE() << "accepted: " << c.expected;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("tiny/config.json")) << c.expected;
      EXPECT_THAT(e.what(), HasSubstr(c.expected));
    }
  }
}

// A [rows, cols] weight packed as compressed-tensors writes it (pack_to_int32: element i of a row
// at bits 4(i % 8) of word i / 8, as q + 8), with BF16 scales [rows, groups]; with zero points,
// those packed along the rows (zp + 8 of row r, group g at bits 4(r % 8) of word [r / 8, g]).
struct Packed {
  Tensor packed, scale, shape, zero;  // zero: empty name when symmetric
  std::vector<float> expected;        // (q - zp) * scale, exact
  std::vector<const Tensor*> tensors() const {
    std::vector<const Tensor*> out = {&packed, &scale, &shape};
    if (!zero.name.empty()) out.push_back(&zero);
    return out;
  }
};

// Zero point of row r, group g: every value of [-8, 7] over the rows and groups.
int zero_point_of(int64_t r, int64_t g) {
  return int((r * 5 + g * 3 + 1) % 16) - 8;
}

Packed pack(const std::string& name, int64_t rows, int64_t cols, int group_size,
            bool zero_points = false) {
  const int64_t words = (cols + 7) / 8;
  const int64_t groups = group_size ? (cols + group_size - 1) / group_size : 1;
  Packed p;
  p.packed = {name + "_packed", "I32", {rows, words}, {}, {}};
  p.scale = {name + "_scale", "BF16", {rows, groups}, {}, {}};
  p.shape = {name + "_shape", "I64", {2}, {}, {}};
  if (zero_points) {
    std::vector<uint32_t> z(size_t((rows + 7) / 8 * groups), 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g)
        z[size_t(r / 8 * groups + g)] |= uint32_t(zero_point_of(r, g) + 8) << (4 * (r % 8));
    p.zero = {name + "_zero_point", "I32", {(rows + 7) / 8, groups}, {}, {}};
    for (uint32_t word : z)
      for (int b = 0; b < 4; ++b) p.zero.bytes.push_back(uint8_t(word >> (8 * b)));
  }
  std::vector<uint32_t> w(size_t(rows * words), 0);
  std::vector<float> scales(size_t(rows * groups));
  for (int64_t k = 0; k < rows * groups; ++k) {
    scales[size_t(k)] = float(1 + k % 5) / 64.0f;  // exact in BF16
    const uint32_t bits = std::bit_cast<uint32_t>(scales[size_t(k)]) >> 16;
    p.scale.bytes.push_back(uint8_t(bits));
    p.scale.bytes.push_back(uint8_t(bits >> 8));
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < cols; ++i) {
      const int q = int((r * 7 + i * 3) % 16) - 8;  // every code
      w[size_t(r * words + i / 8)] |= uint32_t(q + 8) << (4 * (i % 8));
      const int64_t g = group_size ? i / group_size : 0;
      const int zp = zero_points ? zero_point_of(r, g) : 0;
      p.expected.push_back(float(q - zp) * scales[size_t(r * groups + g)]);
    }
  for (uint32_t word : w)
    for (int b = 0; b < 4; ++b) p.packed.bytes.push_back(uint8_t(word >> (8 * b)));
  for (int64_t d : {rows, cols})
    for (int b = 0; b < 8; ++b) p.shape.bytes.push_back(uint8_t(uint64_t(d) >> (8 * b)));
  return p;
}

void write(const test::TempDir& dir, const std::vector<const Tensor*>& tensors) {
  test::write_safetensors(dir.path() / "model.safetensors", tensors);
}

TEST(CompressedTensorsWeights, ReadAsTheContainerWithTheSameNumbers) {
  struct Case {
    int64_t rows, cols;
    int group_size;
    kernels::QuantFormat format;
  };
  const Case cases[] = {
      {16, 64, 32, kernels::QuantFormat::kInt4Grouped},
      {8, 256, 64, kernels::QuantFormat::kInt4Grouped},
      {8, 384, 128, kernels::QuantFormat::kInt4Grouped},
      {5, 72, 32, kernels::QuantFormat::kInt4Grouped},  // a short last group and word
      {3, 13, 32, kernels::QuantFormat::kInt4Row},      // one group a row; odd columns
      {4, 40, 0, kernels::QuantFormat::kInt4Row},       // strategy channel
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.rows << "x" << c.cols << " g" << c.group_size);
    const Packed p = pack("blk.weight", c.rows, c.cols, c.group_size);
    test::TempDir dir;
    write(dir, {&p.packed, &p.scale, &p.shape});
    for (const std::optional<int> group :
         {std::optional<int>(c.group_size), std::optional<int>()}) {
      const Checkpoint ck(dir.path(), std::nullopt, group);
      ASSERT_TRUE(ck.is_packed_int4("blk.weight"));
      EXPECT_TRUE(ck.is_quantized("blk.weight"));
      EXPECT_TRUE(ck.contains("blk.weight"));
      EXPECT_EQ(ck.quant_scale_name("blk.weight"), "blk.weight_scale");
      EXPECT_EQ(ck.load_f32("blk.weight", {c.rows, c.cols}), p.expected);
      const QuantMatrix q = ck.load_quant("blk.weight", c.rows, c.cols);
      EXPECT_EQ(q.format, c.format);
      EXPECT_EQ(q.group_size, c.format == kernels::QuantFormat::kInt4Row ? 0 : c.group_size);
      // Held: the stored nibbles (whole bytes of a row) and the scales widened to fp32.
      EXPECT_EQ(q.data.size(), size_t(c.rows * ((c.cols + 1) / 2)));
      EXPECT_EQ(q.scales.size(), p.scale.bytes.size() / 2);
      EXPECT_EQ(q.bytes(), ck.quant_bytes("blk.weight", c.rows, c.cols));
      // Rows of it, as an expert's slice reads them.
      const QuantMatrix rows = ck.load_quant("blk.weight", c.rows, c.cols, 1, c.rows);
      std::vector<float> sliced(size_t((c.rows - 1) * c.cols));
      kernels::dequantize(rows.view(), sliced.data());
      EXPECT_TRUE(std::equal(sliced.begin(), sliced.end(), p.expected.begin() + c.cols));
    }
  }
}

// The checks at open, each naming the tensor.
TEST(CompressedTensorsWeights, InconsistentTensorsAreRefused) {
  struct Case {
    const char* what;
    std::function<void(Packed&, std::vector<Tensor>&)> edit;
    std::optional<int> group;
    std::string expected;
  };
  const Case cases[] = {
      {"zero points unpacked",
       [](Packed&, std::vector<Tensor>& extra) {
         extra.push_back(
             {"blk.weight_zero_point", "I32", {16, 2}, std::vector<uint8_t>(128, 0), {}});
       },
       32, "'blk.weight_zero_point' has dtype I32 and shape [16, 2], expected I32 [2, 2]"},
      {"zero points dtype",
       [](Packed&, std::vector<Tensor>& extra) {
         extra.push_back({"blk.weight_zero_point", "I8", {2, 2}, std::vector<uint8_t>(4, 0), {}});
       },
       32, "'blk.weight_zero_point' has dtype I8"},
      {"zero points groups",
       [](Packed&, std::vector<Tensor>& extra) {
         extra.push_back({"blk.weight_zero_point", "I32", {2, 1}, std::vector<uint8_t>(8, 0), {}});
       },
       32, "'blk.weight_zero_point' has dtype I32 and shape [2, 1]"},
      {"g_idx",
       [](Packed&, std::vector<Tensor>& extra) {
         extra.push_back({"blk.weight_g_idx", "I32", {64}, std::vector<uint8_t>(256, 0), {}});
       },
       32, "'blk.weight_g_idx' is not supported"},
      {"packed dtype", [](Packed& p, std::vector<Tensor>&) { p.packed.dtype = "U32"; }, 32,
       "'blk.weight_packed' has dtype U32"},
      {"packed columns",
       [](Packed& p, std::vector<Tensor>&) {
         p.packed.shape = {32, 4};
       },
       32, "'blk.weight_packed' has shape [32, 4]"},
      {"shape values", [](Packed& p, std::vector<Tensor>&) { p.shape.bytes[0] = 17; }, 32,
       "'blk.weight_shape' says [17, 64]"},
      {"scale dtype", [](Packed& p, std::vector<Tensor>&) { p.scale.dtype = "I16"; }, 32,
       "'blk.weight_scale' has dtype I16"},
      {"scale rows",
       [](Packed& p, std::vector<Tensor>&) {
         p.scale.shape = {8, 8};
       },
       32, "'blk.weight_scale' has shape [8, 8]"},
      {"group of the config", [](Packed&, std::vector<Tensor>&) {}, 64,
       "'blk.weight_scale' has 2 groups a row, expected 1"},
      {"no scale", [](Packed& p, std::vector<Tensor>&) { p.scale.name = "blk.weight_scales"; }, 32,
       "has no 'blk.weight_scale'"},
      {"stored twice",
       [](Packed&, std::vector<Tensor>& extra) {
         extra.push_back({"blk.weight", "BF16", {1}, {0, 0}, {}});
       },
       32, "'blk.weight' is stored both"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Packed p = pack("blk.weight", 16, 64, 32);
    std::vector<Tensor> extra;
    c.edit(p, extra);
    // Keep each payload as large as its header says, so only the named check can fail.
    for (Tensor* t : {&p.packed, &p.scale}) {
      int64_t bytes = t->numel() * (t->dtype == "BF16" || t->dtype == "I16" ? 2 : 4);
      t->bytes.resize(size_t(bytes));
    }
    std::vector<const Tensor*> tensors = {&p.packed, &p.scale, &p.shape};
    for (const Tensor& t : extra) tensors.push_back(&t);
    test::TempDir dir;
    write(dir, tensors);
    try {
      Checkpoint(dir.path(), std::nullopt, c.group);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(c.expected));
      EXPECT_THAT(e.what(), HasSubstr("model.safetensors"));
    }
  }
}

// A routed expert in compressed-tensors INT4 stays quantized: its resident bytes are the stored
// nibbles and the scales widened to fp32; without a compressed-tensors quantization_config in
// config.json it is refused.
TEST(CompressedTensorsWeights, RoutedExpertKeptAsStored) {
  ModelConfig config;
  config.hidden_size = 64;
  config.moe_intermediate_size = 128;
  const std::string prefix = "model.layers.1.mlp.experts.3.";
  const Packed gate = pack(prefix + "gate_proj.weight", 128, 64, 32);
  const Packed up = pack(prefix + "up_proj.weight", 128, 64, 32);
  const Packed down = pack(prefix + "down_proj.weight", 64, 128, 32);
  test::TempDir dir;
  write(dir, {&gate.packed, &gate.scale, &gate.shape, &up.packed, &up.scale, &up.shape,
              &down.packed, &down.scale, &down.shape});
  const Checkpoint checkpoint(dir.path(), std::nullopt, 32);
  try {
    load_routed_expert(config, checkpoint, 1, 3);
    ADD_FAILURE() << "accepted without quantization_config";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("gate_proj.weight_packed' is a compressed-tensors INT4"));
  }
  config.int4_group_size = 32;
  const MlpWeights w = load_routed_expert(config, checkpoint, 1, 3);
  ASSERT_TRUE(w.quantized());
  EXPECT_EQ(w.quant.gate.format, kernels::QuantFormat::kInt4Grouped);
  EXPECT_EQ(w.quant.down.group_size, 32);
  const uint64_t nibbles = 3 * 128 * 64 / 2, scales = 3 * 128 * 64 / 32;
  EXPECT_EQ(w.bytes(), nibbles + 4 * scales);
  uint64_t stored = 0;
  for (const Packed* p : {&gate, &up, &down}) stored += p->packed.bytes.size();
  EXPECT_EQ(stored, nibbles);
}

// Asymmetric weights: the nibbles as the container holds them and the zero points as fp32
// offsets -zp * s, so that the container's numbers are (q - zp) * s exactly, whole or by rows (any
// row, across the zero points' words of 8 rows) and columns (whole groups).
TEST(CompressedTensorsWeights, ZeroPointsReadAsOffsetsWithTheSameNumbers) {
  struct Case {
    int64_t rows, cols;
    int group_size;
  };
  const Case cases[] = {{16, 64, 32}, {13, 72, 32}, {9, 256, 64}, {3, 13, 32}, {21, 40, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.rows << "x" << c.cols << " g" << c.group_size);
    const Packed p = pack("blk.weight", c.rows, c.cols, c.group_size, true);
    test::TempDir dir;
    write(dir, p.tensors());
    const Checkpoint ck(dir.path(), std::nullopt, c.group_size);
    ASSERT_TRUE(ck.has_zero_points("blk.weight"));
    EXPECT_EQ(ck.load_f32("blk.weight", {c.rows, c.cols}), p.expected);
    const QuantMatrix q = ck.load_quant("blk.weight", c.rows, c.cols);
    const int64_t groups = kernels::offset_groups(q.view());
    ASSERT_EQ(q.offsets.size(), size_t(c.rows * groups));
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t g = 0; g < groups; ++g)
        EXPECT_EQ(q.offsets[size_t(r * groups + g)],
                  float(-zero_point_of(r, g)) * q.scales[size_t(r * groups + g)]);
    // Held: nibbles, fp32 scales and as many fp32 offsets.
    EXPECT_EQ(q.bytes(), q.data.size() + 8 * q.scales.size());
    EXPECT_EQ(q.bytes(), ck.quant_bytes("blk.weight", c.rows, c.cols));
    for (const int64_t r0 : {int64_t(1), int64_t(c.rows / 2), c.rows - 1}) {
      const QuantMatrix rows = ck.load_quant("blk.weight", c.rows, c.cols, r0, c.rows);
      std::vector<float> got(size_t((c.rows - r0) * c.cols));
      kernels::dequantize(rows.view(), got.data());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), p.expected.begin() + r0 * c.cols))
          << "rows from " << r0;
      const QuantMatrix cut = quant_rows(q, r0, c.rows);
      kernels::dequantize(cut.view(), got.data());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), p.expected.begin() + r0 * c.cols))
          << "quant_rows from " << r0;
    }
    const int64_t c0 = c.group_size && c.cols > c.group_size ? c.group_size : 0;
    const QuantMatrix cols = quant_cols(q, c0, c.cols);
    std::vector<float> got(size_t(c.rows * (c.cols - c0)));
    kernels::dequantize(cols.view(), got.data());
    for (int64_t r = 0; r < c.rows; ++r)
      EXPECT_TRUE(std::equal(got.begin() + r * (c.cols - c0), got.begin() + (r + 1) * (c.cols - c0),
                             p.expected.begin() + r * c.cols + c0))
          << "quant_cols from " << c0 << ", row " << r;
  }
}

// A routed expert with zero points stays quantized, its offsets with it; zero points must be what
// config.json declares (symmetric false: every weight has them; true: none has).
TEST(CompressedTensorsWeights, AsymmetricRoutedExpertKeptAsStored) {
  ModelConfig config;
  config.hidden_size = 64;
  config.moe_intermediate_size = 128;
  config.int4_group_size = 32;
  const std::string prefix = "model.layers.1.mlp.experts.3.";
  const Packed gate = pack(prefix + "gate_proj.weight", 128, 64, 32, true);
  const Packed up = pack(prefix + "up_proj.weight", 128, 64, 32, true);
  const Packed down = pack(prefix + "down_proj.weight", 64, 128, 32, true);
  test::TempDir dir;
  std::vector<const Tensor*> tensors;
  for (const Packed* p : {&gate, &up, &down})
    for (const Tensor* t : p->tensors()) tensors.push_back(t);
  write(dir, tensors);
  const Checkpoint checkpoint(dir.path(), std::nullopt, 32);
  try {
    load_routed_expert(config, checkpoint, 1, 3);
    ADD_FAILURE() << "accepted zero points in a symmetric checkpoint";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.safetensors"));
    EXPECT_THAT(e.what(), HasSubstr("gate_proj.weight_packed' has zero points"));
    EXPECT_THAT(e.what(), HasSubstr("symmetric true"));
  }
  config.int4_zero_points = true;
  const MlpWeights w = load_routed_expert(config, checkpoint, 1, 3);
  ASSERT_TRUE(w.quantized());
  for (const QuantMatrix* q : {&w.quant.gate, &w.quant.up, &w.quant.down})
    EXPECT_TRUE(q->has_zero_points());
  const uint64_t nibbles = 3 * 128 * 64 / 2, scales = 3 * 128 * 64 / 32;
  EXPECT_EQ(w.bytes(), nibbles + 4 * scales + 4 * scales);
  uint64_t quant_bytes = 0;
  for (const auto& [name, rows, cols] :
       {std::tuple{"gate_proj", 128, 64}, {"up_proj", 128, 64}, {"down_proj", 64, 128}})
    quant_bytes += checkpoint.quant_bytes(prefix + name + ".weight", rows, cols);
  EXPECT_EQ(w.bytes(), quant_bytes);

  // Declared asymmetric, a weight without zero points is refused.
  const Packed plain = pack(prefix + "gate_proj.weight", 128, 64, 32);
  test::TempDir dir2;
  std::vector<const Tensor*> mixed = plain.tensors();
  for (const Packed* p : {&up, &down})
    for (const Tensor* t : p->tensors()) mixed.push_back(t);
  write(dir2, mixed);
  const Checkpoint without(dir2.path(), std::nullopt, 32);
  try {
    load_routed_expert(config, without, 1, 3);
    ADD_FAILURE() << "accepted a weight without zero points in an asymmetric checkpoint";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("gate_proj.weight_packed' has no zero points"));
    EXPECT_THAT(e.what(), HasSubstr("symmetric false"));
  }
}

}  // namespace
}  // namespace colibri
