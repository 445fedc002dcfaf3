#include "model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <regex>

#include "common/error.h"
#include "common/input_file.h"
#include "common/json_depth.h"
#include "cpu/quant.h"

namespace colibri {
namespace {

using nlohmann::json;

// Typed field access that names the file and field in every error.
class Fields {
 public:
  Fields(const json& root, std::string source) : root_(root), source_(std::move(source)) {}

  bool has(const char* key) const { return root_.contains(key) && !root_[key].is_null(); }
  const json& at(const char* key) const { return root_[key]; }
  const std::string& source() const { return source_; }

  int integer(const char* key, int min, int max) const {
    if (!has(key)) fail("{}: missing field '{}'", source_, key);
    return checked_int(root_[key], key, min, max);
  }
  int integer_or(const char* key, int fallback, int min, int max) const {
    return has(key) ? checked_int(root_[key], key, min, max) : fallback;
  }
  double number_or(const char* key, double fallback, double min, double max) const {
    if (!has(key)) return fallback;
    return checked_number(root_[key], key, min, max);
  }
  double number(const char* key, double min, double max) const {
    if (!has(key)) fail("{}: missing field '{}'", source_, key);
    return checked_number(root_[key], key, min, max);
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!root_[key].is_boolean()) fail("{}: field '{}' must be true or false", source_, key);
    return root_[key].get<bool>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!root_[key].is_string()) fail("{}: field '{}' must be a string", source_, key);
    return root_[key].get<std::string>();
  }
  std::vector<std::string> string_list(const char* key) const {
    const json& value = root_[key];
    if (!value.is_array()) fail("{}: field '{}' must be a list of strings", source_, key);
    std::vector<std::string> out;
    for (const auto& item : value) {
      if (!item.is_string()) fail("{}: field '{}' must be a list of strings", source_, key);
      out.push_back(item.get<std::string>());
    }
    return out;
  }
  std::vector<int> int_or_list(const char* key) const {
    std::vector<int> out;
    if (!has(key)) return out;
    const json& value = root_[key];
    if (value.is_array()) {
      for (const auto& item : value) out.push_back(checked_int(item, key, 0, 1 << 30));
    } else {
      out.push_back(checked_int(value, key, 0, 1 << 30));
    }
    return out;
  }

 private:
  int checked_int(const json& value, const char* key, int min, int max) const {
    if (!value.is_number_integer())
      fail("{}: field '{}' must be an integer, got {}", source_, key, value.dump());
    const int64_t v = value.get<int64_t>();
    if (v < min || v > max)
      fail("{}: field '{}' = {} is out of range [{}, {}]", source_, key, v, min, max);
    return int(v);
  }
  double checked_number(const json& value, const char* key, double min, double max) const {
    if (!value.is_number())
      fail("{}: field '{}' must be a number, got {}", source_, key, value.dump());
    const double v = value.get<double>();
    if (!std::isfinite(v) || v < min || v > max)
      fail("{}: field '{}' = {} is out of range [{}, {}]", source_, key, v, min, max);
    return v;
  }

  const json& root_;
  std::string source_;
};

constexpr int kMaxDim = 1 << 20;

RopeConfig parse_rope(const Fields& config) {
  RopeConfig rope;
  // transformers v5 writes rope_parameters (theta inside); v4-era files have rope_theta +
  // rope_scaling.
  json params = json::object();
  if (config.has("rope_parameters")) {
    params = config.at("rope_parameters");
  } else if (config.has("rope_scaling")) {
    params = config.at("rope_scaling");
  }
  if (!params.is_object()) fail("{}: field 'rope_parameters' must be an object", config.source());
  if (config.has("rope_theta") && !params.contains("rope_theta"))
    params["rope_theta"] = config.at("rope_theta");
  const Fields p(params, config.source() + " rope_parameters");
  rope.theta = p.number_or("rope_theta", 10000.0, 1.0, 1e12);
  std::string type = p.string_or("rope_type", p.string_or("type", "default"));
  if (type == "default") return rope;
  if (type != "yarn")
    fail("{}: rope type '{}' is not supported (default, yarn)", config.source(), type);
  rope.yarn = true;
  rope.factor = p.number("factor", 1.0, 1e6);
  rope.original_max_position_embeddings = p.number("original_max_position_embeddings", 1, 1e9);
  // `or` in transformers: 0 / null fall back to the defaults too.
  rope.beta_fast = p.number_or("beta_fast", 0, 0, 1e6);
  if (rope.beta_fast == 0) rope.beta_fast = 32;
  rope.beta_slow = p.number_or("beta_slow", 0, 0, 1e6);
  if (rope.beta_slow == 0) rope.beta_slow = 1;
  rope.mscale = p.number_or("mscale", 0, 0, 1e6);
  rope.mscale_all_dim = p.number_or("mscale_all_dim", 0, 0, 1e6);
  if (p.has("attention_factor")) rope.attention_factor = p.number("attention_factor", 0, 1e6);
  rope.truncate = p.boolean_or("truncate", true);
  return rope;
}

std::vector<bool> parse_layer_kinds(const Fields& config, const char* key, int num_layers,
                                    const std::string& yes, const std::string& no) {
  const auto kinds = config.string_list(key);
  if (int(kinds.size()) != num_layers)
    fail("{}: field '{}' has {} entries, num_hidden_layers is {}", config.source(), key,
         kinds.size(), num_layers);
  std::vector<bool> out;
  for (const auto& kind : kinds) {
    if (kind != yes && kind != no)
      fail("{}: field '{}' has unknown entry '{}' (expected '{}' or '{}')", config.source(), key,
           kind, yes, no);
    out.push_back(kind == yes);
  }
  return out;
}

// quantization_config of a block-scaled FP8 checkpoint: its weight_block_size.
std::array<int, 2> parse_fp8(const json& q, const std::string& source) {
  const Fields qf(q, source + " quantization_config");
  const std::string fmt_name = qf.string_or("fmt", "e4m3");
  if (fmt_name != "e4m3")
    fail("{}: quantization_config.fmt '{}' is not supported (e4m3)", source, fmt_name);
  std::array<int, 2> block{128, 128};
  if (qf.has("weight_block_size")) {
    const json& b = q["weight_block_size"];
    if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
        b[0].get<int64_t>() < 1 || b[1].get<int64_t>() < 1 || b[0].get<int64_t>() > kMaxDim ||
        b[1].get<int64_t>() > kMaxDim)
      fail("{}: quantization_config.weight_block_size must be two positive integers", source);
    block = {b[0].get<int>(), b[1].get<int>()};
  }
  return block;
}

// quantization_config of a compressed-tensors checkpoint: only the pack-quantized INT4 weights the
// int4 container's kernels run as stored (W4A16, symmetric or with zero points, groups of a
// container size or a scale per row, static, in stored order).
struct CompressedTensorsScheme {
  int group_size;  // 0: per row
  bool symmetric;
};
CompressedTensorsScheme parse_compressed_tensors(const json& q, const std::string& source) {
  const std::string where = source + ": quantization_config";
  const Fields qf(q, where);
  const std::string format = qf.string_or("format", "");
  if (format != "pack-quantized")
    fail("{}.format '{}' is not supported (compressed-tensors: pack-quantized)", where, format);
  if (!qf.has("config_groups") || !q["config_groups"].is_object() || q["config_groups"].empty())
    fail("{}.config_groups must be an object with at least one group", where);
  if (qf.has("ignore")) {
    const json& ignore = q["ignore"];
    if (!ignore.is_array() ||
        !std::all_of(ignore.begin(), ignore.end(), [](const json& v) { return v.is_string(); }))
      fail("{}.ignore must be a list of module names", where);
  }
  std::optional<int> group_size;
  std::optional<bool> symmetric;
  for (const auto& [name, group] : q["config_groups"].items()) {
    const std::string at = fmt::format("{}.config_groups.{}", where, name);
    if (!group.is_object()) fail("{} must be an object", at);
    const Fields gf(group, at);
    if (gf.has("format") && gf.at("format") != "pack-quantized")
      fail("{}.format '{}' is not supported (pack-quantized)", at, gf.at("format").dump());
    if (gf.has("input_activations"))
      fail("{}.input_activations: quantized activations are not supported (W4A16 only)", at);
    if (!gf.has("weights") || !gf.at("weights").is_object())
      fail("{}.weights must be an object", at);
    const Fields w(gf.at("weights"), at + ".weights");
    const int bits = w.integer("num_bits", 1, 64);
    if (bits != 4) fail("{}.weights.num_bits {} is not supported (4)", at, bits);
    if (const std::string type = w.string_or("type", ""); type != "int")
      fail("{}.weights.type '{}' is not supported (int)", at, type);
    // Asymmetric (symmetric false): a `_zero_point` a weight, for group and channel strategies.
    const bool is_symmetric = w.boolean_or("symmetric", true);
    if (w.boolean_or("dynamic", false)) fail("{}.weights.dynamic true is not supported", at);
    if (w.has("actorder") && w.at("actorder") != "static")
      fail("{}.weights.actorder {} is not supported (null or static: no weight_g_idx)", at,
           w.at("actorder").dump());
    const std::string strategy = w.string_or("strategy", "");
    int size = 0;
    if (strategy == "group") {
      size = w.integer("group_size", 1, kMaxDim);
      if (!kernels::is_valid_group_size(size))
        fail(
            "{}.weights.group_size {} is not supported (the int4 container's group sizes: 16, 32, "
            "48, 64, 96, 128, 192, 256)",
            at, size);
    } else if (strategy != "channel") {
      fail("{}.weights.strategy '{}' is not supported (group, channel)", at, strategy);
    }
    if (group_size && *group_size != size)
      fail("{}.weights: group size {} differs from another group's {} (one per checkpoint)", at,
           size, *group_size);
    if (symmetric && *symmetric != is_symmetric)
      fail("{}.weights.symmetric {} differs from another group's (one per checkpoint)", at,
           is_symmetric);
    group_size = size;
    symmetric = is_symmetric;
  }
  return {*group_size, *symmetric};
}

// The quant_algo of a ModelOpt declaration: NVFP4 (W4A4: weights and an input_scale per Linear),
// anything else refused naming the field.
void check_modelopt_algo(const std::string& algo, const std::string& at) {
  if (algo == "NVFP4") return;
  if (algo == "MIXED_PRECISION")
    fail(
        "{} 'MIXED_PRECISION' is not supported: only checkpoints whose quantized layers are all "
        "NVFP4 are read (quant_algo NVFP4)",
        at);
  fail("{} '{}' is not supported (ModelOpt checkpoints: NVFP4)", at, algo);
}

// ModelOpt's block size: 16 where it is given.
void check_modelopt_group_size(const Fields& f, const std::string& at) {
  if (!f.has("group_size")) return;
  const int g = f.integer("group_size", 1, kMaxDim);
  if (g != 16)
    fail("{}.group_size {} is not supported (NVFP4: one E4M3 scale a block of 16)", at, g);
}

// CSF-encoded block scales (weight_scale_encoding "csf": `.nvfp4_csf_fixed` and
// `.nvfp4_csf_exceptions` tensors instead of `weight_scale`) are not read.
void refuse_scale_encoding(const Fields& f, const std::string& at) {
  if (!f.has("weight_scale_encoding")) return;
  const std::string encoding = f.string_or("weight_scale_encoding", "");
  if (encoding == "none" || encoding.empty()) return;
  fail(
      "{}.weight_scale_encoding '{}' is not supported: NVFP4 block scales are read as plain E4M3 "
      "'weight_scale' tensors only",
      at, encoding);
}

// A list of module names or globs (exclude_modules, ignore), appended to `out`.
void read_module_list(const json& list, const std::string& at, std::vector<std::string>& out) {
  if (list.is_null()) return;
  if (!list.is_array() ||
      !std::all_of(list.begin(), list.end(), [](const json& v) { return v.is_string(); }))
    fail("{} must be a list of module names", at);
  for (const json& v : list) out.push_back(v.get<std::string>());
}

// config.json's quantization_config of a ModelOpt checkpoint (as ModelOpt's export writes it:
// quant_algo, config_groups in the compressed-tensors shape, ignore, producer). quant_algo may be
// missing when hf_quant_config.json gives it (`hf`).
Nvfp4Scheme parse_modelopt(const json& q, const std::string& source, const Nvfp4Scheme* hf) {
  const std::string where = source + ": quantization_config";
  const Fields qf(q, where);
  if (qf.has("quant_algo")) {
    check_modelopt_algo(qf.string_or("quant_algo", ""), where + ".quant_algo");
  } else if (!hf) {
    fail("{} has no quant_algo and the model directory has no hf_quant_config.json", where);
  }
  check_modelopt_group_size(qf, where);
  refuse_scale_encoding(qf, where);
  if (qf.has("config_groups")) {
    const json& groups = q["config_groups"];
    if (!groups.is_object()) fail("{}.config_groups must be an object", where);
    for (const auto& [name, group] : groups.items()) {
      const std::string at = fmt::format("{}.config_groups.{}", where, name);
      if (!group.is_object()) fail("{} must be an object", at);
      const Fields gf(group, at);
      if (!gf.has("weights")) continue;
      if (!gf.at("weights").is_object()) fail("{}.weights must be an object", at);
      const Fields w(gf.at("weights"), at + ".weights");
      if (w.has("num_bits") && w.integer("num_bits", 1, 64) != 4)
        fail("{}.weights.num_bits {} is not supported (NVFP4: 4)", at, w.at("num_bits").dump());
      if (const std::string type = w.string_or("type", "float"); type != "float")
        fail("{}.weights.type '{}' is not supported (NVFP4: float)", at, type);
      check_modelopt_group_size(w, at + ".weights");
      refuse_scale_encoding(w, at + ".weights");
    }
  }
  Nvfp4Scheme scheme;
  scheme.declared_in = source;
  if (qf.has("ignore")) read_module_list(q["ignore"], where + ".ignore", scheme.excluded);
  if (qf.has("exclude_modules"))
    read_module_list(q["exclude_modules"], where + ".exclude_modules", scheme.excluded);
  return scheme;
}

// hf_quant_config.json of a ModelOpt export: {"producer": {...}, "quantization": {"quant_algo":
// "NVFP4", "kv_cache_quant_algo": ..., "group_size": 16, "exclude_modules": [...]}} (newer
// exports: "ignore" globs).
Nvfp4Scheme parse_hf_quant_config(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text, json_depth_limit(source));
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", source, e.what());
  }
  if (!root.is_object()) fail("{}: not a JSON object", source);
  if (!root.contains("quantization") || !root["quantization"].is_object())
    fail("{}: missing object 'quantization'", source);
  const json& q = root["quantization"];
  const std::string where = source + ": quantization";
  const Fields qf(q, where);
  if (!qf.has("quant_algo")) fail("{} has no quant_algo", where);
  check_modelopt_algo(qf.string_or("quant_algo", ""), where + ".quant_algo");
  check_modelopt_group_size(qf, where);
  refuse_scale_encoding(qf, where);
  Nvfp4Scheme scheme;
  scheme.declared_in = source;
  if (qf.has("exclude_modules"))
    read_module_list(q["exclude_modules"], where + ".exclude_modules", scheme.excluded);
  if (qf.has("ignore")) read_module_list(q["ignore"], where + ".ignore", scheme.excluded);
  return scheme;
}

// `text` matches the glob `pattern` whole: `*` any run of characters, anything else itself.
bool glob_match(std::string_view pattern, std::string_view text) {
  size_t p = 0, t = 0, star = std::string_view::npos, resume = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p, ++t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

ModelConfig parse_config(const std::string& config_json, const std::string& source,
                         const Nvfp4Scheme* hf_quant);

}  // namespace

std::string Nvfp4Scheme::excluded_by(const std::string& module) const {
  // The module and every module containing it: "model.layers.3.self_attn" excludes its q_a_proj.
  std::vector<std::string_view> names;
  for (size_t end = module.size(); end != std::string::npos && end > 0;
       end = module.rfind('.', end - 1))
    names.emplace_back(module.data(), end);
  for (const std::string& entry : excluded) {
    const bool regex = entry.rfind("re:", 0) == 0;
    for (const std::string_view name : names)
      if (regex ? std::regex_match(name.begin(), name.end(), std::regex(entry.substr(3)))
                : glob_match(entry, name))
        return entry;
  }
  return {};
}

int ModelConfig::num_moe_layers() const {
  int n = 0;
  for (bool moe : layer_is_moe) n += moe;
  return n;
}

float ModelConfig::softmax_scale() const {
  double scale = 1.0 / std::sqrt(double(qk_head_dim()));
  if (rope.yarn && rope.mscale_all_dim != 0 && rope.factor > 1) {
    const double m = 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
    scale *= m * m;
  }
  return float(scale);
}

ModelConfig parse_model_config(const std::string& config_json, const std::string& source) {
  return parse_config(config_json, source, nullptr);
}

namespace {

ModelConfig parse_config(const std::string& config_json, const std::string& source,
                         const Nvfp4Scheme* hf_quant) {
  json root;
  try {
    root = json::parse(config_json, json_depth_limit(source));
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", source, e.what());
  }
  if (!root.is_object()) fail("{}: not a JSON object", source);
  const Fields config(root, source);

  ModelConfig c;
  if (!config.has("architectures")) fail("{}: missing field 'architectures'", source);
  const auto architectures = config.string_list("architectures");
  if (architectures.size() != 1)
    fail("{}: field 'architectures' must name one architecture", source);
  c.architecture_name = architectures[0];
  if (c.architecture_name == "DeepseekV3ForCausalLM") {
    c.arch = Architecture::kDeepseekV3;
  } else if (c.architecture_name == "GlmMoeDsaForCausalLM") {
    c.arch = Architecture::kGlmMoeDsa;
  } else {
    fail("{}: architecture '{}' is not supported (DeepseekV3ForCausalLM, GlmMoeDsaForCausalLM)",
         source, c.architecture_name);
  }
  const bool glm = c.arch == Architecture::kGlmMoeDsa;

  c.vocab_size = config.integer("vocab_size", 1, 1 << 24);
  c.hidden_size = config.integer("hidden_size", 1, kMaxDim);
  c.num_layers = config.integer("num_hidden_layers", 1, 4096);
  c.intermediate_size = config.integer("intermediate_size", 1, kMaxDim);
  c.rms_norm_eps = float(config.number("rms_norm_eps", 0, 1));
  c.tie_word_embeddings = config.boolean_or("tie_word_embeddings", false);
  c.max_position_embeddings = config.integer_or("max_position_embeddings", 1 << 30, 1, 1 << 30);

  const std::string act = config.string_or("hidden_act", "silu");
  if (act != "silu") fail("{}: hidden_act '{}' is not supported (silu)", source, act);
  if (config.boolean_or("attention_bias", false))
    fail("{}: attention_bias = true is not supported for MLA models", source);

  c.num_heads = config.integer("num_attention_heads", 1, 4096);
  const int kv_heads = config.integer_or("num_key_value_heads", c.num_heads, 1, 4096);
  if (kv_heads != c.num_heads)
    fail("{}: num_key_value_heads = {} must equal num_attention_heads = {} for MLA", source,
         kv_heads, c.num_heads);
  c.q_lora_rank = config.integer_or("q_lora_rank", 0, 1, kMaxDim);
  if (glm && c.q_lora_rank == 0)
    fail("{}: missing field 'q_lora_rank' (required by GLM-5 DSA)", source);
  c.kv_lora_rank = config.integer("kv_lora_rank", 1, kMaxDim);
  c.qk_nope_head_dim = config.integer("qk_nope_head_dim", 1, 65536);
  c.qk_rope_head_dim = config.integer("qk_rope_head_dim", 2, 65536);
  if (c.qk_rope_head_dim % 2)
    fail("{}: qk_rope_head_dim = {} must be even", source, c.qk_rope_head_dim);
  c.v_head_dim = config.integer("v_head_dim", 1, 65536);
  c.rope = parse_rope(config);
  // transformers hard-codes interleaved RoPE for GLM-5 (MLA and indexer) and reads the flag
  // only for DeepSeek-V3.
  c.rope.interleave = glm || config.boolean_or("rope_interleave", true);

  // MoE
  c.n_routed_experts = config.integer_or("n_routed_experts", 0, 0, 1 << 16);
  const std::string scoring = config.string_or("scoring_func", "sigmoid");
  if (scoring != "sigmoid")
    fail("{}: scoring_func '{}' is not supported (sigmoid)", source, scoring);
  const std::string topk_method = config.string_or("topk_method", "noaux_tc");
  if (topk_method != "noaux_tc")
    fail("{}: topk_method '{}' is not supported (noaux_tc)", source, topk_method);
  if (glm && config.has("mlp_layer_types")) {
    c.layer_is_moe = parse_layer_kinds(config, "mlp_layer_types", c.num_layers, "sparse", "dense");
  } else {
    const int first_dense = config.integer_or("first_k_dense_replace", glm ? 3 : 0, 0, 1 << 16);
    const int freq = config.integer_or("moe_layer_freq", 1, 1, 1 << 16);
    for (int l = 0; l < c.num_layers; ++l)
      c.layer_is_moe.push_back(c.n_routed_experts > 0 && l >= first_dense && l % freq == 0);
  }
  if (c.num_moe_layers() > 0) {
    if (c.n_routed_experts == 0) fail("{}: MoE layers need 'n_routed_experts' > 0", source);
    c.num_experts_per_tok = config.integer("num_experts_per_tok", 1, c.n_routed_experts);
    c.n_shared_experts = config.integer_or("n_shared_experts", 0, 0, 64);
    c.moe_intermediate_size = config.integer("moe_intermediate_size", 1, kMaxDim);
    c.n_group = config.integer_or("n_group", 1, 1, c.n_routed_experts);
    c.topk_group = config.integer_or("topk_group", 1, 1, c.n_group);
    if (c.n_routed_experts % c.n_group)
      fail("{}: n_routed_experts = {} is not divisible by n_group = {}", source, c.n_routed_experts,
           c.n_group);
    const int per_group = c.n_routed_experts / c.n_group;
    if (c.n_group > 1 && per_group < 2)
      fail("{}: n_group = {} leaves fewer than 2 experts per group", source, c.n_group);
    if (c.num_experts_per_tok > c.topk_group * per_group)
      fail("{}: num_experts_per_tok = {} exceeds the {} experts in topk_group = {} groups", source,
           c.num_experts_per_tok, c.topk_group * per_group, c.topk_group);
    c.norm_topk_prob = config.boolean_or("norm_topk_prob", true);
    c.routed_scaling_factor = float(config.number_or("routed_scaling_factor", 1.0, 0, 1e6));
    // 0 would silently drop every routed expert's output.
    if (!(c.routed_scaling_factor > 0))
      fail("{}: field 'routed_scaling_factor' = {} must be > 0", source, c.routed_scaling_factor);
  }

  // DSA indexer
  if (glm) {
    // A key past the context is never there to select: a larger top-k selects every key, as the
    // context's does, and would only size buffers by it.
    c.index_topk = std::min(config.integer("index_topk", 1, 1 << 30), c.max_position_embeddings);
    c.index_n_heads = config.integer("index_n_heads", 1, 4096);
    c.index_head_dim = config.integer("index_head_dim", 1, 65536);
    if (c.index_head_dim < c.qk_rope_head_dim)
      fail("{}: index_head_dim = {} is smaller than qk_rope_head_dim = {}", source,
           c.index_head_dim, c.qk_rope_head_dim);
    if (config.has("indexer_types")) {
      c.indexer_is_full =
          parse_layer_kinds(config, "indexer_types", c.num_layers, "full", "shared");
    } else if (config.has("index_topk_pattern")) {
      const std::string pattern = config.string_or("index_topk_pattern", "");
      if (int(pattern.size()) != c.num_layers ||
          pattern.find_first_not_of("FS") != std::string::npos)
        fail("{}: field 'index_topk_pattern' must be {} characters of F/S", source, c.num_layers);
      for (char ch : pattern) c.indexer_is_full.push_back(ch == 'F');
    } else {
      const int freq = config.integer_or("index_topk_freq", 1, 1, 1 << 16);
      const int offset = config.integer_or("index_skip_topk_offset", 2, 0, 1 << 16);
      for (int l = 0; l < c.num_layers; ++l)
        c.indexer_is_full.push_back(std::max(l - offset + 1, 0) % freq == 0);
    }
    if (!c.indexer_is_full[0])
      fail("{}: indexer layer 0 is 'shared' but no earlier full layer exists", source);
  }

  c.num_nextn_predict_layers = config.integer_or("num_nextn_predict_layers", 0, 0, 16);

  if (config.has("quantization_config")) {
    const json& q = config.at("quantization_config");
    if (!q.is_object()) fail("{}: field 'quantization_config' must be an object", source);
    const std::string method =
        Fields(q, source + " quantization_config").string_or("quant_method", "");
    if (method == "fp8") {
      c.fp8_block = parse_fp8(q, source);
    } else if (method == "compressed-tensors") {
      const CompressedTensorsScheme scheme = parse_compressed_tensors(q, source);
      c.int4_group_size = scheme.group_size;
      c.int4_zero_points = !scheme.symmetric;
    } else if (method == "modelopt" || method == "modelopt_fp4") {
      c.nvfp4 = parse_modelopt(q, source, hf_quant);
    } else {
      fail(
          "{}: quantization_config.quant_method '{}' is not supported (fp8, compressed-tensors, "
          "modelopt)",
          source, method);
    }
  }
  if (hf_quant) {
    if (c.fp8_block || c.int4_group_size)
      fail(
          "{}: the model directory's {} declares a ModelOpt NVFP4 checkpoint, but "
          "quantization_config declares another quant_method",
          source, hf_quant->declared_in);
    if (!c.nvfp4) {
      c.nvfp4 = *hf_quant;
    } else {  // both: a module excluded by either stays unquantized
      c.nvfp4->excluded.insert(c.nvfp4->excluded.end(), hf_quant->excluded.begin(),
                               hf_quant->excluded.end());
      c.nvfp4->declared_in += " and " + hf_quant->declared_in;
    }
  }

  c.generation.eos_token_ids = config.int_or_list("eos_token_id");
  if (config.has("bos_token_id"))
    c.generation.bos_token_id = config.integer("bos_token_id", 0, 1 << 30);
  return c;
}

}  // namespace

namespace {

void apply_generation_config(const std::filesystem::path& path, GenerationDefaults& gen) {
  const std::string source = path.string();
  json root;
  try {
    root = json::parse(read_regular_file(path, "the generation config"), json_depth_limit(source));
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", path.string(), e.what());
  }
  if (!root.is_object()) fail("{}: not a JSON object", path.string());
  const Fields fields(root, path.string());
  if (fields.has("eos_token_id")) gen.eos_token_ids = fields.int_or_list("eos_token_id");
  if (fields.has("bos_token_id")) gen.bos_token_id = fields.integer("bos_token_id", 0, 1 << 30);
  gen.do_sample = fields.boolean_or("do_sample", gen.do_sample);
  gen.temperature = float(fields.number_or("temperature", gen.temperature, 0, 100));
  gen.top_p = float(fields.number_or("top_p", gen.top_p, 0, 1));
}

}  // namespace

ModelConfig load_model_config(const std::filesystem::path& model_dir) {
  const auto config_path = model_dir / "config.json";
  if (!path_present(config_path, "the model config")) fail("{}: missing", config_path.string());
  // ModelOpt exports describe their quantization in hf_quant_config.json beside config.json.
  std::optional<Nvfp4Scheme> hf_quant;
  const auto hf_quant_path = model_dir / "hf_quant_config.json";
  if (path_present(hf_quant_path, "the ModelOpt quantization config"))
    hf_quant =
        parse_hf_quant_config(read_regular_file(hf_quant_path, "the ModelOpt quantization config"),
                              hf_quant_path.string());
  ModelConfig config = parse_config(read_regular_file(config_path, "the model config"),
                                    config_path.string(), hf_quant ? &*hf_quant : nullptr);
  // Checked after each file, so that the error names the file the id came from.
  const auto check_eos = [&config](const std::filesystem::path& source) {
    for (int id : config.generation.eos_token_ids)
      if (id >= config.vocab_size)
        fail("{}: eos_token_id {} is outside the vocabulary of {}", source.string(), id,
             config.vocab_size);
  };
  check_eos(config_path);
  const auto generation_path = model_dir / "generation_config.json";
  if (path_present(generation_path, "the generation config")) {
    apply_generation_config(generation_path, config.generation);
    check_eos(generation_path);
  }
  return config;
}

}  // namespace colibri
