// Test helper: writes tiny but complete GLM-5 (GlmMoeDsaForCausalLM) and DeepSeek-V3 model
// directories — config.json plus safetensors shards with exactly the tensor names and shapes
// src/model/weights.cpp loads — and low-level safetensors encoding for building corrupt files.
//
// Every weight value is a multiple of 1/8 in [-7/8, 7/8], exact in F32, BF16 and F16, so tests
// compare loaded weights with `==`.
#pragma once

#include <stdlib.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace colibri::test {

namespace fs = std::filesystem;
using nlohmann::json;

// A fresh directory under $TMPDIR, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "colibri-test-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

inline std::string read_file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

inline void write_file_bytes(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

inline json read_json_file(const fs::path& path) {
  return json::parse(read_file_bytes(path));
}
inline void write_json_file(const fs::path& path, const json& value) {
  write_file_bytes(path, value.dump(2));
}

// The 8-byte little-endian header length, the header text, then the data section.
inline std::string encode_safetensors_raw(uint64_t header_length, std::string_view header,
                                          std::string_view data) {
  std::string out(8, '\0');
  std::memcpy(out.data(), &header_length, 8);
  out.append(header);
  out.append(data);
  return out;
}

// A header padded with spaces to a multiple of 8 bytes, as the Python writer does.
inline std::string encode_safetensors(const json& header, std::string_view data) {
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return encode_safetensors_raw(text.size(), text, data);
}

struct SafetensorsParts {
  json header;
  std::string data;
};

// Splits a well-formed file back into header and data, for rewriting one part.
inline SafetensorsParts split_safetensors(const fs::path& path) {
  const std::string bytes = read_file_bytes(path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  return {json::parse(bytes.substr(8, header_length)), bytes.substr(8 + header_length)};
}

inline void rewrite_header(const fs::path& path, const std::function<void(json&)>& edit) {
  SafetensorsParts parts = split_safetensors(path);
  edit(parts.header);
  write_file_bytes(path, encode_safetensors(parts.header, parts.data));
}

struct Tensor {
  std::string name;
  std::string dtype;  // safetensors spelling: "F32", "BF16", "F8_E4M3", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // little-endian payload
  std::vector<float> values;   // what the payload decodes to (F32/BF16 tensors from make_tensor)

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

inline uint32_t fnv1a(std::string_view text) {
  uint32_t h = 2166136261u;
  for (char ch : text) h = (h ^ uint8_t(ch)) * 16777619u;
  return h;
}

// Deterministic, name-dependent values: multiples of 1/8 in [-7/8, 7/8].
inline std::vector<float> pattern_values(std::string_view name, int64_t n) {
  const uint32_t seed = fnv1a(name) % 15;
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k)
    values[size_t(k)] = float(int((uint32_t(k) * 4 + seed) % 15) - 7) / 8.0f;
  return values;
}

// An F32 or BF16 tensor filled with pattern_values.
inline Tensor make_tensor(const std::string& name, std::vector<int64_t> shape,
                          const std::string& dtype = "F32") {
  Tensor t{name, dtype, std::move(shape), {}, {}};
  t.values = pattern_values(name, t.numel());
  for (float v : t.values) {
    const uint32_t bits = std::bit_cast<uint32_t>(v);
    if (dtype == "F32") {
      for (int b = 0; b < 4; ++b) t.bytes.push_back(uint8_t(bits >> (8 * b)));
    } else if (dtype == "BF16") {
      t.bytes.push_back(uint8_t(bits >> 16));  // exact: the low 16 bits are zero
      t.bytes.push_back(uint8_t(bits >> 24));
    } else {
      throw std::invalid_argument("make_tensor: dtype " + dtype);
    }
  }
  return t;
}

// Header (data_offsets in the given order) and data section of one file.
inline SafetensorsParts layout_safetensors(const std::vector<const Tensor*>& tensors) {
  SafetensorsParts parts{json::object(), {}};
  parts.header["__metadata__"] = {{"format", "pt"}};
  for (const Tensor* t : tensors) {
    const uint64_t begin = parts.data.size();
    parts.data.append(reinterpret_cast<const char*>(t->bytes.data()), t->bytes.size());
    parts.header[t->name] = {{"dtype", t->dtype},
                             {"shape", t->shape},
                             {"data_offsets", {begin, uint64_t(parts.data.size())}}};
  }
  return parts;
}

inline void write_safetensors(const fs::path& path, const std::vector<const Tensor*>& tensors) {
  const SafetensorsParts parts = layout_safetensors(tensors);
  write_file_bytes(path, encode_safetensors(parts.header, parts.data));
}

enum class TinyArch { kGlm5, kDeepseekV3 };

struct TinyModelOptions {
  TinyArch arch = TinyArch::kGlm5;
  int shards = 2;               // 1: model.safetensors; more: model-0000i-of-0000n + index.json
  std::string dtype = "F32";    // of every weight tensor
  int mtp_layers = 0;           // num_nextn_predict_layers, with their tensors
  bool q_lora = true;           // false: plain q_proj (DeepSeek-V3 only)
  bool tie_embeddings = false;  // true: no lm_head.weight
};

// A valid two-layer model (layer 0 dense, layer 1 MoE) with small dimensions. Edit `config`
// and `tensors` before write() to build a variant.
class TinyModel {
 public:
  static constexpr int kVocab = 32, kHidden = 16, kLayers = 2, kIntermediate = 24, kHeads = 2;
  static constexpr int kQLoraRank = 8, kKvLoraRank = 8, kNope = 4, kRope = 2, kVHead = 4;
  static constexpr int kExperts = 4, kExpertsPerTok = 2, kSharedExperts = 1, kMoeIntermediate = 8;
  static constexpr int kIndexHeads = 2, kIndexHeadDim = 4, kIndexTopk = 4;

  explicit TinyModel(TinyModelOptions options = {}) : options_(options) {
    build_config();
    build_tensors();
  }

  json config;
  std::vector<Tensor> tensors;

  const TinyModelOptions& options() const { return options_; }
  bool glm() const { return options_.arch == TinyArch::kGlm5; }

  Tensor& tensor(const std::string& name) {
    for (auto& t : tensors)
      if (t.name == name) return t;
    throw std::out_of_range("TinyModel has no tensor " + name);
  }
  void remove(const std::string& name) {
    std::erase_if(tensors, [&](const Tensor& t) { return t.name == name; });
  }

  // File name a tensor goes to: the tensor list is cut into `shards` contiguous pieces.
  std::string shard_file(const std::string& name) const {
    for (size_t i = 0; i < tensors.size(); ++i)
      if (tensors[i].name == name) return shard_name(shard_of(i));
    throw std::out_of_range("TinyModel has no tensor " + name);
  }
  std::string shard_name(int shard) const {
    if (options_.shards == 1) return "model.safetensors";
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", shard + 1, options_.shards);
    return name;
  }

  void write(const fs::path& dir) const {
    write_json_file(dir / "config.json", config);
    json weight_map = json::object();
    uint64_t total_bytes = 0;
    for (int s = 0; s < options_.shards; ++s) {
      std::vector<const Tensor*> in_shard;
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (shard_of(i) != s) continue;
        in_shard.push_back(&tensors[i]);
        weight_map[tensors[i].name] = shard_name(s);
        total_bytes += tensors[i].bytes.size();
      }
      write_safetensors(dir / shard_name(s), in_shard);
    }
    if (options_.shards > 1)
      write_json_file(dir / "model.safetensors.index.json",
                      {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}});
  }

 private:
  int shard_of(size_t index) const { return int(index * size_t(options_.shards) / tensors.size()); }

  void build_config() {
    config = {
        {"vocab_size", kVocab},
        {"hidden_size", kHidden},
        {"num_hidden_layers", kLayers},
        {"intermediate_size", kIntermediate},
        {"rms_norm_eps", 1e-6},
        {"max_position_embeddings", 256},
        {"hidden_act", "silu"},
        {"num_attention_heads", kHeads},
        {"num_key_value_heads", kHeads},
        {"kv_lora_rank", kKvLoraRank},
        {"qk_nope_head_dim", kNope},
        {"qk_rope_head_dim", kRope},
        {"v_head_dim", kVHead},
        {"n_routed_experts", kExperts},
        {"num_experts_per_tok", kExpertsPerTok},
        {"n_shared_experts", kSharedExperts},
        {"moe_intermediate_size", kMoeIntermediate},
        {"n_group", 2},
        {"topk_group", 1},
        {"norm_topk_prob", true},
        {"routed_scaling_factor", 2.5},
        {"scoring_func", "sigmoid"},
        {"topk_method", "noaux_tc"},
        {"tie_word_embeddings", options_.tie_embeddings},
        {"num_nextn_predict_layers", options_.mtp_layers},
        {"bos_token_id", 0},
        {"eos_token_id", 1},
    };
    if (options_.q_lora) config["q_lora_rank"] = kQLoraRank;
    if (glm()) {
      config["architectures"] = {"GlmMoeDsaForCausalLM"};
      config["model_type"] = "glm_moe_dsa";
      config["mlp_layer_types"] = {"dense", "sparse"};
      config["index_topk"] = kIndexTopk;
      config["index_n_heads"] = kIndexHeads;
      config["index_head_dim"] = kIndexHeadDim;
      config["indexer_types"] = {"full", "shared"};
      config["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
    } else {
      config["architectures"] = {"DeepseekV3ForCausalLM"};
      config["model_type"] = "deepseek_v3";
      config["first_k_dense_replace"] = 1;
      config["moe_layer_freq"] = 1;
      config["rope_theta"] = 10000.0;
      config["rope_interleave"] = true;
      config["rope_scaling"] = {
          {"type", "yarn"},       {"factor", 40.0}, {"original_max_position_embeddings", 64},
          {"beta_fast", 32},      {"beta_slow", 1}, {"mscale", 1.0},
          {"mscale_all_dim", 1.0}};
    }
  }

  void add(const std::string& name, std::vector<int64_t> shape) {
    tensors.push_back(make_tensor(name, std::move(shape), options_.dtype));
  }
  void add_mlp(const std::string& prefix, int64_t intermediate) {
    add(prefix + "gate_proj.weight", {intermediate, kHidden});
    add(prefix + "up_proj.weight", {intermediate, kHidden});
    add(prefix + "down_proj.weight", {kHidden, intermediate});
  }

  void add_layer(int layer, bool is_moe, bool with_indexer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    add(p + "input_layernorm.weight", {kHidden});
    add(p + "post_attention_layernorm.weight", {kHidden});
    const std::string a = p + "self_attn.";
    if (options_.q_lora) {
      add(a + "q_a_proj.weight", {kQLoraRank, kHidden});
      add(a + "q_a_layernorm.weight", {kQLoraRank});
      add(a + "q_b_proj.weight", {kHeads * (kNope + kRope), kQLoraRank});
    } else {
      add(a + "q_proj.weight", {kHeads * (kNope + kRope), kHidden});
    }
    add(a + "kv_a_proj_with_mqa.weight", {kKvLoraRank + kRope, kHidden});
    add(a + "kv_a_layernorm.weight", {kKvLoraRank});
    add(a + "kv_b_proj.weight", {kHeads * (kNope + kVHead), kKvLoraRank});
    add(a + "o_proj.weight", {kHidden, kHeads * kVHead});
    if (with_indexer) {
      add(a + "indexer.wq_b.weight", {kIndexHeads * kIndexHeadDim, kQLoraRank});
      add(a + "indexer.wk.weight", {kIndexHeadDim, kHidden});
      add(a + "indexer.weights_proj.weight", {kIndexHeads, kHidden});
      add(a + "indexer.k_norm.weight", {kIndexHeadDim});
      add(a + "indexer.k_norm.bias", {kIndexHeadDim});
    }
    if (!is_moe) {
      add_mlp(p + "mlp.", kIntermediate);
      return;
    }
    add(p + "mlp.gate.weight", {kExperts, kHidden});
    add(p + "mlp.gate.e_score_correction_bias", {kExperts});
    add_mlp(p + "mlp.shared_experts.", kMoeIntermediate * kSharedExperts);
    for (int e = 0; e < kExperts; ++e)
      add_mlp(p + "mlp.experts." + std::to_string(e) + ".", kMoeIntermediate);
  }

  void build_tensors() {
    add("model.embed_tokens.weight", {kVocab, kHidden});
    add("model.norm.weight", {kHidden});
    if (!options_.tie_embeddings) add("lm_head.weight", {kVocab, kHidden});
    // GLM: layer 0 runs the full indexer, layer 1 reuses its top-k (indexer_types above).
    add_layer(0, false, glm());
    add_layer(1, true, false);
    for (int i = 0; i < options_.mtp_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(kLayers + i) + ".";
      add(p + "eh_proj.weight", {kHidden, 2 * kHidden});
      add(p + "enorm.weight", {kHidden});
      add(p + "hnorm.weight", {kHidden});
      add(p + "shared_head.norm.weight", {kHidden});
      add_layer(kLayers + i, true, glm());
    }
  }

  TinyModelOptions options_;
};

}  // namespace colibri::test
