// The model description read from a Hugging Face config.json (+ generation_config.json).
// Everything the forward pass needs is resolved here, so no other code reads JSON.
#pragma once

#include <array>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace colibri {

enum class Architecture { kDeepseekV3, kGlmMoeDsa };

struct RopeConfig {
  double theta = 10000.0;
  bool interleave = true;  // GPT-J pairs (x[2i], x[2i+1]); false = NeoX halves
  bool yarn = false;
  double factor = 1.0;
  double original_max_position_embeddings = 0;
  double beta_fast = 32, beta_slow = 1;
  double mscale = 0, mscale_all_dim = 0;
  std::optional<double> attention_factor;
  bool truncate = true;
};

struct GenerationDefaults {
  std::vector<int> eos_token_ids;
  std::optional<int> bos_token_id;
  bool do_sample = false;
  float temperature = 1.0f;
  float top_p = 1.0f;
};

// What a ModelOpt NVFP4 checkpoint declares (quant_algo NVFP4, group_size 16): which modules stay
// unquantized, and whether every quantized Linear has its `input_scale`.
struct Nvfp4Scheme {
  // exclude_modules (hf_quant_config.json) and ignore (config.json's quantization_config, or
  // hf_quant_config.json's in newer exports), together: module names with `*` matching any run of
  // characters (`model.layers.0.self_attn*`, `*mlp.gate`), or `re:` and a regular expression.
  std::vector<std::string> excluded;
  // The files that declared it ("config.json", "hf_quant_config.json", or both), for errors.
  std::string declared_in;
  // quant_algo NVFP4 (W4A4) has an `input_scale` per Linear: read and checked, not used (the
  // activations stay fp32).
  bool input_scales = true;
  // The entry of `excluded` that names `module` or a module containing it ("" when none): such a
  // module is not quantized and keeps its checkpoint dtype.
  std::string excluded_by(const std::string& module) const;
};

struct ModelConfig {
  Architecture arch = Architecture::kDeepseekV3;
  std::string architecture_name;  // as in config.json "architectures"

  int vocab_size = 0;
  int hidden_size = 0;
  int num_layers = 0;  // num_hidden_layers, MTP layers excluded
  int intermediate_size = 0;
  float rms_norm_eps = 1e-6f;
  float mla_norm_eps = 1e-6f;  // q_a_layernorm / kv_a_layernorm: constructor default, not config
  bool tie_word_embeddings = false;
  int max_position_embeddings = 0;

  // MLA
  int num_heads = 0;
  int q_lora_rank = 0;  // 0: plain q_proj
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  RopeConfig rope;

  // MoE
  std::vector<bool> layer_is_moe;  // [num_layers]
  int n_routed_experts = 0;
  int num_experts_per_tok = 0;
  int n_shared_experts = 0;
  int moe_intermediate_size = 0;
  int n_group = 1;
  int topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;

  // DSA lightning indexer (GLM-5.x); index_topk == 0 means no indexer.
  int index_topk = 0;
  int index_n_heads = 0;
  int index_head_dim = 0;
  std::vector<bool> indexer_is_full;  // [num_layers]; false = reuse previous full layer's top-k

  int num_nextn_predict_layers = 0;             // MTP layers stored after the main layers
  std::optional<std::array<int, 2>> fp8_block;  // weight_block_size of fp8 checkpoints
  // compressed-tensors pack-quantized INT4 checkpoints (quantization_config): the group size of
  // their weight_scale, 0 for a scale per row; and whether they are asymmetric (symmetric false:
  // each weight has its `_zero_point`).
  std::optional<int> int4_group_size;
  bool int4_zero_points = false;
  // NVFP4 checkpoints of NVIDIA ModelOpt (config.json quantization_config with quant_method
  // modelopt / modelopt_fp4, and/or hf_quant_config.json): quant_algo NVFP4, blocks of 16.
  std::optional<Nvfp4Scheme> nvfp4;

  GenerationDefaults generation;

  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool has_indexer() const { return index_topk > 0; }
  int num_moe_layers() const;
  // qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for YaRN.
  float softmax_scale() const;
};

// Reads and validates DIR/config.json and, if present, DIR/generation_config.json.
// Throws colibri::Error naming the file and field on anything missing, malformed or unsupported.
ModelConfig load_model_config(const std::filesystem::path& model_dir);

// The same from JSON text; `source` names it in errors.
ModelConfig parse_model_config(const std::string& config_json, const std::string& source);

}  // namespace colibri
