// NVIDIA ModelOpt NVFP4 checkpoints: the declaration (config.json's quantization_config with
// quant_method modelopt, hf_quant_config.json) read or refused with the field named, the weights
// (`weight` U8 codes, `weight_scale` E4M3 blocks of 16, `weight_scale_2`, `input_scale`) read as
// stored with the values the published layout defines, and anything inconsistent refused naming
// the tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "../engine/scoped_activations.h"
#include "common/dtype.h"
#include "common/error.h"
#include "cpu/linear.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/matrix.h"
#include "model/weights.h"
#include "model_writer.h"
#include "moe/experts.h"

namespace colibri {
namespace {

using test::json;
using test::Tensor;
using test::TinyArch;
using test::TinyModel;
using ::testing::HasSubstr;

// The error of f(), or "accepted".
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "accepted";
}

// ---------------------------------------------------------------------------------------------
// The declaration

// config.json's quantization_config as ModelOpt's export writes it
// (convert_hf_quant_config_format).
json modelopt_quantization_config() {
  const json fp4 = {{"dynamic", false}, {"num_bits", 4}, {"type", "float"}, {"group_size", 16}};
  return {{"config_groups",
           {{"group_0", {{"input_activations", fp4}, {"weights", fp4}, {"targets", {"Linear"}}}}}},
          {"ignore", {"lm_head", "model.layers.0.self_attn*", "*mlp.gate"}},
          {"quant_algo", "NVFP4"},
          {"producer", {{"name", "modelopt"}, {"version", "0.39.0"}}},
          {"quant_method", "modelopt"}};
}

// hf_quant_config.json as ModelOpt writes it.
json hf_quant_config() {
  return {{"producer", {{"name", "modelopt"}, {"version", "0.39.0"}}},
          {"quantization",
           {{"quant_algo", "NVFP4"},
            {"kv_cache_quant_algo", nullptr},
            {"group_size", 16},
            {"exclude_modules", {"lm_head", "model.layers.1.mlp.shared_experts*"}}}}};
}

json config_with(const json& quantization_config) {
  json config = TinyModel({.arch = TinyArch::kDeepseekV3}).config;
  config["quantization_config"] = quantization_config;
  return config;
}

ModelConfig parse(const json& config) {
  return parse_model_config(config.dump(), "tiny/config.json");
}

TEST(Nvfp4Config, ModelOptQuantizationConfigIsRead) {
  for (const char* method : {"modelopt", "modelopt_fp4"}) {
    json q = modelopt_quantization_config();
    q["quant_method"] = method;
    const ModelConfig c = parse(config_with(q));
    ASSERT_TRUE(c.nvfp4) << method;
    EXPECT_EQ(c.nvfp4->excluded,
              (std::vector<std::string>{"lm_head", "model.layers.0.self_attn*", "*mlp.gate"}));
    EXPECT_TRUE(c.nvfp4->input_scales);
    EXPECT_FALSE(c.fp8_block);
    EXPECT_FALSE(c.int4_group_size);
  }
  EXPECT_FALSE(parse(TinyModel({.arch = TinyArch::kDeepseekV3}).config).nvfp4);
}

TEST(Nvfp4Config, HfQuantConfigAloneOrBesideConfigJson) {
  const TinyModel model({.arch = TinyArch::kDeepseekV3});
  {  // hf_quant_config.json alone (older exports leave config.json without quantization_config)
    test::TempDir dir;
    model.write(dir.path());
    test::write_json_file(dir.path() / "hf_quant_config.json", hf_quant_config());
    const ModelConfig c = load_model_config(dir.path());
    ASSERT_TRUE(c.nvfp4);
    EXPECT_EQ(c.nvfp4->excluded,
              (std::vector<std::string>{"lm_head", "model.layers.1.mlp.shared_experts*"}));
    EXPECT_THAT(c.nvfp4->declared_in, HasSubstr("hf_quant_config.json"));
  }
  {  // both: the exclusions of either
    test::TempDir dir;
    TinyModel both = model;
    both.config["quantization_config"] = modelopt_quantization_config();
    both.write(dir.path());
    test::write_json_file(dir.path() / "hf_quant_config.json", hf_quant_config());
    const ModelConfig c = load_model_config(dir.path());
    ASSERT_TRUE(c.nvfp4);
    EXPECT_EQ(c.nvfp4->excluded.size(), 5u);
    EXPECT_FALSE(c.nvfp4->excluded_by("model.layers.1.mlp.shared_experts.up_proj").empty());
    EXPECT_FALSE(c.nvfp4->excluded_by("model.layers.0.self_attn.q_a_proj").empty());
  }
  {  // config.json's quant_method modelopt without quant_algo takes the file's
    test::TempDir dir;
    TinyModel bare = model;
    bare.config["quantization_config"] = {{"quant_method", "modelopt"}};
    bare.write(dir.path());
    EXPECT_THAT(error_of([&] { load_model_config(dir.path()); }),
                HasSubstr("has no quant_algo and the model directory has no hf_quant_config"));
    test::write_json_file(dir.path() / "hf_quant_config.json", hf_quant_config());
    EXPECT_TRUE(load_model_config(dir.path()).nvfp4);
  }
}

TEST(Nvfp4Config, RefusalsNameTheField) {
  struct Case {
    std::function<void(json&)> edit;
    std::string expected;
  };
  const Case cases[] = {
      {[](json& q) { q["quant_algo"] = "MIXED_PRECISION"; },
       "quantization_config.quant_algo 'MIXED_PRECISION' is not supported"},
      {[](json& q) { q["quant_algo"] = "W4A16_NVFP4"; },
       "quantization_config.quant_algo 'W4A16_NVFP4' is not supported"},
      {[](json& q) { q["quant_algo"] = "FP8"; }, "quant_algo 'FP8' is not supported"},
      {[](json& q) { q["group_size"] = 32; }, "quantization_config.group_size 32"},
      {[](json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 32; },
       "config_groups.group_0.weights.group_size 32"},
      {[](json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 8; },
       "weights.num_bits 8"},
      {[](json& q) { q["config_groups"]["group_0"]["weights"]["type"] = "int"; },
       "weights.type 'int'"},
      {[](json& q) { q["weight_scale_encoding"] = "csf"; },
       "quantization_config.weight_scale_encoding 'csf'"},
      {[](json& q) { q["ignore"] = "lm_head"; }, "quantization_config.ignore must be a list"},
      {[](json& q) { q.erase("quant_algo"); }, "quantization_config has no quant_algo"},
  };
  for (const Case& c : cases) {
    json q = modelopt_quantization_config();
    c.edit(q);
    const std::string error = error_of([&] { parse(config_with(q)); });
    EXPECT_THAT(error, HasSubstr("tiny/config.json")) << c.expected;
    EXPECT_THAT(error, HasSubstr(c.expected));
  }
}

TEST(Nvfp4Config, HfQuantConfigRefusalsNameTheFileAndField) {
  struct Case {
    std::function<void(json&)> edit;
    std::string expected;
  };
  const Case cases[] = {
      {[](json& h) { h["quantization"]["quant_algo"] = "MIXED_PRECISION"; },
       "quantization.quant_algo 'MIXED_PRECISION'"},
      {[](json& h) { h["quantization"]["group_size"] = 8; }, "quantization.group_size 8"},
      {[](json& h) { h["quantization"]["exclude_modules"] = {1}; },
       "quantization.exclude_modules must be a list"},
      {[](json& h) { h["quantization"]["weight_scale_encoding"] = "csf"; },
       "weight_scale_encoding 'csf'"},
      {[](json& h) { h.erase("quantization"); }, "missing object 'quantization'"},
  };
  for (const Case& c : cases) {
    test::TempDir dir;
    TinyModel({.arch = TinyArch::kDeepseekV3}).write(dir.path());
    json h = hf_quant_config();
    c.edit(h);
    test::write_json_file(dir.path() / "hf_quant_config.json", h);
    const std::string error = error_of([&] { load_model_config(dir.path()); });
    EXPECT_THAT(error, HasSubstr("hf_quant_config.json")) << c.expected;
    EXPECT_THAT(error, HasSubstr(c.expected));
  }
  // Another quant_method in config.json beside a ModelOpt hf_quant_config.json.
  test::TempDir dir;
  TinyModel fp8({.arch = TinyArch::kDeepseekV3});
  fp8.config["quantization_config"] = {{"quant_method", "fp8"}};
  fp8.write(dir.path());
  test::write_json_file(dir.path() / "hf_quant_config.json", hf_quant_config());
  EXPECT_THAT(error_of([&] { load_model_config(dir.path()); }),
              HasSubstr("declares another quant_method"));
}

TEST(Nvfp4Config, ExcludedModulesByNameGlobOrParent) {
  Nvfp4Scheme s;
  s.excluded = {"lm_head", "model.layers.0.self_attn*", "*mlp.gate", "model.layers.2.mlp",
                "re:.*\\.indexer\\.w.*"};
  EXPECT_EQ(s.excluded_by("lm_head"), "lm_head");
  EXPECT_EQ(s.excluded_by("model.layers.0.self_attn.q_a_proj"), "model.layers.0.self_attn*");
  EXPECT_EQ(s.excluded_by("model.layers.3.mlp.gate"), "*mlp.gate");
  EXPECT_EQ(s.excluded_by("model.layers.3.mlp.gate_proj"), "");  // a glob matches the whole name
  EXPECT_EQ(s.excluded_by("model.layers.2.mlp.experts.5.down_proj"), "model.layers.2.mlp");
  EXPECT_EQ(s.excluded_by("model.layers.3.self_attn.indexer.wk"), "re:.*\\.indexer\\.w.*");
  EXPECT_EQ(s.excluded_by("model.layers.10.self_attn.q_a_proj"), "");
  EXPECT_EQ(s.excluded_by("model.layers.1.mlp.experts.0.up_proj"), "");
}

// ---------------------------------------------------------------------------------------------
// The weights

// An NVFP4 Linear `module` [rows, cols] as ModelOpt stores it: every E2M1 code (the nibbles cycle
// through 0..15, -0 included) and a spread of E4M3 block scales (none a NaN), with the values the
// layout defines: e2m1 * e4m3 (exact) * weight_scale_2.
struct Nvfp4 {
  Tensor weight, scale, global, input;
  std::vector<float> expected;  // [rows, cols]
  std::vector<const Tensor*> tensors() const { return {&weight, &scale, &global, &input}; }
};

void put_f32(Tensor& t, float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  t.bytes.clear();
  for (int b = 0; b < 4; ++b) t.bytes.push_back(uint8_t(bits >> (8 * b)));
}

Nvfp4 make_nvfp4(const std::string& module, int64_t rows, int64_t cols, int seed = 0,
                 float global = 0.0078125f) {
  static constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  Nvfp4 t;
  const std::string w = module + ".weight";
  t.weight = {w, "U8", {rows, cols / 2}, std::vector<uint8_t>(size_t(rows * cols / 2)), {}};
  t.scale = {w + "_scale", "F8_E4M3", {rows, cols / 16}, {}, {}};
  t.global = {w + "_scale_2", "F32", {}, {}, {}};
  t.input = {module + ".input_scale", "F32", {}, {}, {}};
  put_f32(t.global, global);
  put_f32(t.input, 0.25f);
  for (int64_t k = 0; k < rows * cols / 16; ++k)
    t.scale.bytes.push_back(uint8_t((k * 37 + seed * 11 + 0x20) % 0x7F));  // 0x00 .. 0x7E
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < cols; ++i) {
      const int code = int((r * 5 + i * 3 + seed) % 16);
      t.weight.bytes[size_t((r * cols + i) / 2)] |= uint8_t(code << (4 * (i % 2)));
      const float e2m1 = (code & 8 ? -1.0f : 1.0f) * kE2m1[code & 7];
      const float scale = fp8_e4m3_to_f32(t.scale.bytes[size_t(r * (cols / 16) + i / 16)]);
      t.expected.push_back(e2m1 * scale * global);
    }
  return t;
}

void write(const test::TempDir& dir, const std::vector<const Tensor*>& tensors) {
  test::write_safetensors(dir.path() / "model.safetensors", tensors);
}

TEST(Nvfp4Weights, ReadAsStoredWithThePublishedValues) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{16, 64}, {5, 48}, {1, 16}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
    const Nvfp4 t = make_nvfp4("blk", rows, cols);
    test::TempDir dir;
    write(dir, t.tensors());
    const Checkpoint ck(dir.path());
    ASSERT_TRUE(ck.is_nvfp4("blk.weight"));
    EXPECT_FALSE(ck.is_quantized("blk.weight")) << "not a container weight";
    EXPECT_TRUE(ck.contains("blk.weight"));
    EXPECT_EQ(ck.load_f32("blk.weight", {rows, cols}), t.expected);
    const Nvfp4Matrix m = ck.load_nvfp4("blk.weight", rows, cols);
    EXPECT_EQ(std::vector<uint8_t>(m.codes.begin(), m.codes.end()), t.weight.bytes);
    EXPECT_EQ(std::vector<uint8_t>(m.scales.begin(), m.scales.end()), t.scale.bytes);
    EXPECT_EQ(m.global, 0.0078125f);
    // Held: the stored codes and block scales and the global scale (not input_scale).
    EXPECT_EQ(m.bytes(), t.weight.bytes.size() + t.scale.bytes.size() + 4);
    EXPECT_EQ(m.bytes(), ck.nvfp4_tensors("blk.weight")->held_bytes());
    // Rows of it, as an expert's slice reads them.
    if (rows > 1) {
      const Nvfp4Matrix tail = ck.load_nvfp4("blk.weight", rows, cols, 1, rows);
      std::vector<float> values(size_t((rows - 1) * cols));
      kernels::dequantize_nvfp4(
          {tail.codes.data(), tail.scales.data(), tail.global, rows - 1, cols}, values.data());
      EXPECT_TRUE(std::equal(values.begin(), values.end(), t.expected.begin() + cols));
    }
    // As a Matrix: linear() is the product with the published values (fp32 activations), or
    // the int8-activation kernel's (the default).
    Matrix w;
    w.rows = rows;
    w.cols = cols;
    w.nvfp4 = m;
    EXPECT_EQ(w.format(), WeightFormat::kNvfp4);
    std::vector<float> x(size_t(3 * cols));
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 7) - 3) / 4.0f + 0.01f * float(i);
    std::vector<float> y(size_t(3 * rows)), y_ref(size_t(3 * rows));
    {
      const ::colibri::testing::ScopedActivations f32(kernels::QuantActivations::kF32);
      linear(w, x.data(), 3, y.data());
    }
    kernels::linear_f32(x.data(), 3, t.expected.data(), rows, cols, y_ref.data());
    for (size_t i = 0; i < y.size(); ++i)
      EXPECT_NEAR(y[i], y_ref[i], 1e-5f * (1 + std::abs(y_ref[i])));
    {
      const ::colibri::testing::ScopedActivations int8(kernels::QuantActivations::kInt8);
      linear(w, x.data(), 3, y.data());
    }
    kernels::linear_nvfp4_int8(x.data(), 3, {m.codes.data(), m.scales.data(), m.global, rows, cols},
                               y_ref.data());
    EXPECT_EQ(y, y_ref);
  }
}

TEST(Nvfp4Weights, SlicesByRowsAndWholeBlocksOfColumns) {
  const Nvfp4 t = make_nvfp4("blk", 16, 64);
  test::TempDir dir;
  write(dir, t.tensors());
  Matrix w;
  w.rows = 16;
  w.cols = 64;
  w.nvfp4 = Checkpoint(dir.path()).load_nvfp4("blk.weight", 16, 64);
  const auto values = [](const Matrix& m) {
    std::vector<float> out(size_t(m.rows * m.cols));
    kernels::dequantize_nvfp4(
        {m.nvfp4.codes.data(), m.nvfp4.scales.data(), m.nvfp4.global, m.rows, m.cols}, out.data());
    return out;
  };
  const Matrix rows = slice_rows(w, 8, 16);
  EXPECT_EQ(rows.format(), WeightFormat::kNvfp4);
  EXPECT_EQ(values(rows), std::vector<float>(t.expected.begin() + 8 * 64, t.expected.end()));
  const Matrix cols = slice_cols(w, 16, 48);
  ASSERT_EQ(cols.format(), WeightFormat::kNvfp4);
  const std::vector<float> got = values(cols);
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t c = 0; c < 32; ++c)
      EXPECT_EQ(got[size_t(r * 32 + c)], t.expected[size_t(r * 64 + 16 + c)]);
  EXPECT_THAT(error_of([&] { slice_cols(w, 8, 40); }), HasSubstr("not whole blocks of 16"));
}

// The checks at open, each naming the tensor and its file.
TEST(Nvfp4Weights, InconsistentTensorsAreRefusedAtOpen) {
  struct Case {
    const char* what;
    std::function<void(Nvfp4&, std::vector<Tensor>&)> edit;
    std::string expected;
  };
  const Case cases[] = {
      {"weight dtype", [](Nvfp4& t, auto&) { t.weight.dtype = "I8"; },
       "tensor 'blk.weight' has dtype I8"},
      {"weight rank", [](Nvfp4& t, auto&) { t.weight.shape = {16 * 32}; },
       "tensor 'blk.weight' has dtype U8 and shape [512], expected U8 [out, in / 2]"},
      {"no block scales", [](Nvfp4& t, auto&) { t.scale.name = "blk.weight_scales"; },
       "NVFP4 tensor 'blk.weight' has no 'blk.weight_scale'"},
      {"no global scale", [](Nvfp4& t, auto&) { t.global.name = "blk.weight_scale2"; },
       "NVFP4 tensor 'blk.weight' has no 'blk.weight_scale_2'"},
      {"no weight", [](Nvfp4& t, auto&) { t.weight.name = "blk.weights"; },
       "its weight 'blk.weight' is missing"},
      {"scale dtype",
       [](Nvfp4& t, auto&) {
         t.scale.dtype = "BF16";
         t.scale.bytes.resize(t.scale.bytes.size() * 2);
       },
       "tensor 'blk.weight_scale' has dtype BF16"},
      {"scale rows",
       [](Nvfp4& t, auto&) {
         t.scale.shape = {8, 8};
       },
       "tensor 'blk.weight_scale' has shape [8, 8], expected [16, 4]"},
      {"group size 32",
       [](Nvfp4& t, auto&) {
         t.scale.shape = {16, 2};
         t.scale.bytes.resize(32);
       },
       "blocks of 32 columns of 'blk.weight' [16, 64], but NVFP4 reads blocks of 16"},
      {"global dtype",
       [](Nvfp4& t, auto&) {
         t.global.dtype = "BF16";
         t.global.bytes.resize(2);
       },
       "tensor 'blk.weight_scale_2' has dtype BF16 and shape [], expected an F32 scalar"},
      {"global shape",
       [](Nvfp4& t, auto&) {
         t.global.shape = {2};
         t.global.bytes.resize(8);
       },
       "tensor 'blk.weight_scale_2' has dtype F32 and shape [2]"},
      {"input scale shape",
       [](Nvfp4& t, auto&) {
         t.input.shape = {1, 2};
         t.input.bytes.resize(8);
       },
       "tensor 'blk.input_scale' has dtype F32 and shape [1, 2]"},
      {"container scales too",
       [](Nvfp4&, std::vector<Tensor>& extra) {
         extra.push_back({"blk.weight.qs", "F32", {16}, std::vector<uint8_t>(64, 0), {}});
       },
       "tensor 'blk.weight' has both NVFP4 scales"},
      {"CSF scales",
       [](Nvfp4&, std::vector<Tensor>& extra) {
         extra.push_back(
             {"blk.weight_scale.nvfp4_csf_fixed", "U8", {16}, std::vector<uint8_t>(16, 0), {}});
       },
       "tensor 'blk.weight_scale.nvfp4_csf_fixed' holds CSF-encoded NVFP4 block scales"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Nvfp4 t = make_nvfp4("blk", 16, 64);
    std::vector<Tensor> extra;
    c.edit(t, extra);
    std::vector<const Tensor*> tensors = t.tensors();
    for (const Tensor& e : extra) tensors.push_back(&e);
    test::TempDir dir;
    write(dir, tensors);
    const std::string error = error_of([&] { (void)Checkpoint(dir.path()); });
    EXPECT_THAT(error, HasSubstr(c.expected));
    EXPECT_THAT(error, HasSubstr("model.safetensors"));
  }
}

// The checks as a weight is read: its scale bytes and scalars.
TEST(Nvfp4Weights, BadScalesAreRefusedAtLoad) {
  struct Case {
    const char* what;
    std::function<void(Nvfp4&)> edit;
    std::string expected;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {"NaN block scale", [](Nvfp4& t) { t.scale.bytes[4 * 3 + 2] = 0x7F; },
       "tensor 'blk.weight_scale' has a NaN (byte 0x7f) at [3, 2]"},
      {"negative NaN block scale", [](Nvfp4& t) { t.scale.bytes[0] = 0xFF; },
       "tensor 'blk.weight_scale' has a NaN (byte 0xff) at [0, 0]"},
      {"NaN global", [nan](Nvfp4& t) { put_f32(t.global, nan); },
       "tensor 'blk.weight_scale_2' is nan, expected a finite scale >= 0"},
      {"negative global", [](Nvfp4& t) { put_f32(t.global, -1.0f); },
       "tensor 'blk.weight_scale_2' is -1"},
      {"zero input scale", [](Nvfp4& t) { put_f32(t.input, 0.0f); },
       "tensor 'blk.input_scale' is 0, expected a finite scale > 0"},
      {"infinite input scale",
       [](Nvfp4& t) { put_f32(t.input, std::numeric_limits<float>::infinity()); },
       "tensor 'blk.input_scale' is inf"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Nvfp4 t = make_nvfp4("blk", 16, 64);
    c.edit(t);
    test::TempDir dir;
    write(dir, t.tensors());
    const Checkpoint ck(dir.path());
    EXPECT_THAT(error_of([&] { ck.load_nvfp4("blk.weight", 16, 64); }), HasSubstr(c.expected));
    EXPECT_THAT(error_of([&] { ck.load_f32("blk.weight", {16, 64}); }), HasSubstr(c.expected));
  }
  // The shape a caller expects.
  const Nvfp4 t = make_nvfp4("blk", 16, 64);
  test::TempDir dir;
  write(dir, t.tensors());
  EXPECT_THAT(error_of([&] { Checkpoint(dir.path()).load_nvfp4("blk.weight", 16, 32); }),
              HasSubstr("NVFP4 tensor 'blk.weight' is [16, 64] (U8 [16, 32]), expected [16, 32]"));
}

// A routed expert [64 -> 32 -> 64] whose three matrices are NVFP4, written with `config`'s
// declaration (or none); returns its stored bytes as held.
uint64_t write_expert(const test::TempDir& dir, const std::string& prefix,
                      std::function<void(std::vector<Nvfp4>&)> edit = {}) {
  std::vector<Nvfp4> m = {make_nvfp4(prefix + "gate_proj", 32, 64, 1),
                          make_nvfp4(prefix + "up_proj", 32, 64, 2),
                          make_nvfp4(prefix + "down_proj", 64, 32, 3)};
  if (edit) edit(m);
  std::vector<const Tensor*> tensors;
  uint64_t held = 0;
  for (const Nvfp4& t : m) {
    for (const Tensor* p : t.tensors()) tensors.push_back(p);
    held += t.weight.bytes.size() + t.scale.bytes.size() + 4;
  }
  write(dir, tensors);
  return held;
}

ModelConfig expert_config() {
  ModelConfig config;
  config.hidden_size = 64;
  config.moe_intermediate_size = 32;
  return config;
}

TEST(Nvfp4Weights, RoutedExpertKeptAsStoredItsBytesTheStoredOnes) {
  const std::string prefix = "model.layers.1.mlp.experts.3.";
  test::TempDir dir;
  const uint64_t held = write_expert(dir, prefix);
  const Checkpoint checkpoint(dir.path());
  ModelConfig config = expert_config();
  // Without a ModelOpt declaration: refused, naming the tensor.
  EXPECT_THAT(error_of([&] { load_routed_expert(config, checkpoint, 1, 3); }),
              HasSubstr("tensor '" + prefix + "gate_proj.weight' is an NVFP4 weight ('" + prefix +
                        "gate_proj.weight_scale' F8_E4M3"));
  config.nvfp4 = Nvfp4Scheme{};
  const MlpWeights w = load_routed_expert(config, checkpoint, 1, 3);
  EXPECT_FALSE(w.quantized());
  for (const Matrix* m : {&w.gate, &w.up, &w.down}) EXPECT_EQ(m->format(), WeightFormat::kNvfp4);
  // Resident bytes: the stored codes and block scales and each matrix's global scale.
  EXPECT_EQ(w.bytes(), held);
  EXPECT_EQ(w.bytes(), 3 * (32 * 64 / 2 + 32 * 64 / 16 + 4));

  // Two slices of it (--placement sliced) sum to the whole expert (fp32 activations: with int8
  // ones each slice of down_proj's inputs is quantized by its own blocks).
  const ::colibri::testing::ScopedActivations f32(kernels::QuantActivations::kF32);
  const ExpertSlice halves[2] = {{0, 16}, {16, 32}};
  std::vector<float> x(size_t(2 * 64));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 9) - 4) / 8.0f;
  std::vector<float> whole(size_t(2 * 64)), sum(size_t(2 * 64), 0.0f), part(size_t(2 * 64));
  mlp_forward(w, x.data(), 2, whole.data());
  uint64_t sliced_bytes = 0;
  for (const ExpertSlice& s : halves) {
    const MlpWeights p = load_routed_expert(config, checkpoint, 1, 3, s);
    EXPECT_EQ(p.gate.format(), WeightFormat::kNvfp4);
    EXPECT_EQ(p.gate.rows, 16);
    EXPECT_EQ(p.down.cols, 16);
    sliced_bytes += p.bytes();
    mlp_forward(p, x.data(), 2, part.data());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  EXPECT_EQ(sliced_bytes, held + 3 * 4);  // each slice holds its own copy of the global scales
  for (size_t i = 0; i < sum.size(); ++i)
    EXPECT_NEAR(sum[i], whole[i], 1e-5f * (1 + std::abs(whole[i])));  // summed in another order
  // A slice inside a block of 16 columns of down_proj is refused.
  EXPECT_THAT(error_of([&] {
                load_routed_expert(config, checkpoint, 1, 3, {0, 8});
              }),
              HasSubstr("not whole blocks of 16"));
}

TEST(Nvfp4Weights, LoaderRefusalsNameTheTensor) {
  const std::string prefix = "model.layers.1.mlp.experts.3.";
  {  // a module the declaration excludes holds NVFP4 tensors
    test::TempDir dir;
    write_expert(dir, prefix);
    const Checkpoint checkpoint(dir.path());
    ModelConfig config = expert_config();
    config.nvfp4 = Nvfp4Scheme{};
    config.nvfp4->excluded = {"model.layers.1.mlp.experts.3.up*"};
    config.nvfp4->declared_in = "tiny/hf_quant_config.json";
    EXPECT_THAT(error_of([&] { load_routed_expert(config, checkpoint, 1, 3); }),
                HasSubstr("tensor '" + prefix +
                          "up_proj.weight' is NVFP4, but 'model.layers.1.mlp.experts.3.up*' in "
                          "tiny/hf_quant_config.json excludes its module"));
  }
  {  // quant_algo NVFP4 without an input_scale
    test::TempDir dir;
    write_expert(dir, prefix, [](std::vector<Nvfp4>& m) { m[2].input.name = "unrelated.scale"; });
    const Checkpoint checkpoint(dir.path());
    ModelConfig config = expert_config();
    config.nvfp4 = Nvfp4Scheme{};
    EXPECT_THAT(error_of([&] { load_routed_expert(config, checkpoint, 1, 3); }),
                HasSubstr("NVFP4 tensor '" + prefix + "down_proj.weight' has no '" + prefix +
                          "down_proj.input_scale'"));
    config.nvfp4->input_scales = false;
    EXPECT_NO_THROW(load_routed_expert(config, checkpoint, 1, 3));
  }
  {  // a U8 weight with neither kind of scales, under an NVFP4 declaration
    test::TempDir dir;
    write_expert(dir, prefix, [](std::vector<Nvfp4>& m) {
      m[1].scale.name = "x.weight_scale_inv";
      m[1].global.name = "x.global";
      m[1].scale.dtype = "U8";
    });
    const Checkpoint checkpoint(dir.path());
    ModelConfig config = expert_config();
    config.nvfp4 = Nvfp4Scheme{};
    EXPECT_THAT(
        error_of([&] { load_routed_expert(config, checkpoint, 1, 3); }),
        HasSubstr("tensor '" + prefix + "up_proj.weight' is U8 but has neither NVFP4 scales"));
  }
}

}  // namespace
}  // namespace colibri
