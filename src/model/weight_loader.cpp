// load_model_weights and load_routed_expert: every tensor a config asks for, checked against its
// shape and for NaN/Inf, held in the format LoadOptions and the table of formats choose.
#include "model/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <optional>
#include <string_view>

#include "common/error.h"
#include "common/finite.h"

namespace colibri {

bool fp8_kept_as_stored(const ModelConfig& config) {
  return config.fp8_block.value_or(std::array<int, 2>{128, 128})[1] % 16 == 0;
}

namespace {

class Loader {
 public:
  Loader(const ModelConfig& config, const Checkpoint& checkpoint, bool keep_stored = false)
      : c_(config), checkpoint_(checkpoint), keep_stored_(keep_stored) {}

  // Every float weight is checked for NaN/Inf as it is loaded: 1.7 ms for the 11.7 M weights of
  // the embedded model (about 7% of its 22 ms load, 2 cores), against a constant token stream.
  Matrix matrix(const std::string& name, int64_t rows, int64_t cols) const {
    if (checkpoint_.is_nvfp4(name)) check_nvfp4(name);  // then dequantized by load_f32
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.data = checkpoint_.load_f32(name, {rows, cols});
    check_finite(m.data, where(name));
    return m;
  }
  // The format `name` is held in: as stored when stored weights are kept and its dtype is a
  // format's (FP8 only with column blocks its kernels take), else fp32. For U8 that is a container
  // format, which one Checkpoint::load_quant tells from the sizes.
  WeightFormat kept_format(const std::string& name) const {
    if (checkpoint_.is_packed_int4(name)) {
      check_declared(name);
      return keep_stored_ ? WeightFormat::kInt4Row : WeightFormat::kF32;
    }
    if (checkpoint_.is_nvfp4(name)) {
      check_nvfp4(name);
      return keep_stored_ ? WeightFormat::kNvfp4 : WeightFormat::kF32;
    }
    check_u8_scales(name);
    const TensorView* view = checkpoint_.find(name);
    if (!keep_stored_ || view == nullptr) return WeightFormat::kF32;
    const std::optional<WeightFormat> stored = stored_format(view->dtype);
    if (!stored || (*stored == WeightFormat::kFp8Block && !fp8_kept_as_stored(c_)))
      return WeightFormat::kF32;
    return *stored;
  }
  // A compressed-tensors weight is read only with config.json's quantization_config saying so.
  // Its zero points as the declaration says: each weight has them when it is asymmetric, none
  // when symmetric.
  void check_declared(const std::string& name) const {
    if (!c_.int4_group_size)
      fail(
          "{}: tensor '{}_packed' is a compressed-tensors INT4 weight, but config.json has no "
          "quantization_config with quant_method 'compressed-tensors'",
          checkpoint_.dir().string(), name);
    const bool zero_points = checkpoint_.has_zero_points(name);
    if (zero_points != c_.int4_zero_points)
      fail(
          "{}: tensor '{}_packed' {} zero points ('{}_zero_point'), but config.json's "
          "quantization_config says symmetric {}",
          checkpoint_.find(name + "_packed")->file->string(), name, zero_points ? "has" : "has no",
          name, zero_points ? "true" : "false");
  }
  // In an NVFP4 checkpoint, a U8 weight that is not NVFP4 must be a container's (with `.qs`).
  void check_u8_scales(const std::string& name) const {
    const TensorView* view = checkpoint_.find(name);
    if (view && view->dtype == Dtype::U8 && c_.nvfp4 && !checkpoint_.is_nvfp4(name) &&
        !checkpoint_.find(name + kQuantScaleSuffix))
      fail(
          "{}: tensor '{}' is U8 but has neither NVFP4 scales ('{}_scale' F8_E4M3 and "
          "'{}_scale_2' F32) nor container scales ('{}{}')",
          view->file->string(), name, name, name, name, kQuantScaleSuffix);
  }
  // An NVFP4 weight is read only with a ModelOpt NVFP4 declaration, outside the modules it
  // excludes, and (quant_algo NVFP4) with its input_scale.
  void check_nvfp4(const std::string& name) const {
    const Checkpoint::Nvfp4Tensors& t = *checkpoint_.nvfp4_tensors(name);
    const std::string file = t.weight->file->string();
    if (!c_.nvfp4)
      fail(
          "{}: tensor '{}' is an NVFP4 weight ('{}_scale' F8_E4M3, '{}_scale_2'), but config.json "
          "has no quantization_config with quant_method 'modelopt' and the model directory has no "
          "hf_quant_config.json",
          file, name, name, name);
    const std::string module = name.substr(0, name.size() - std::string_view(".weight").size());
    if (const std::string entry = c_.nvfp4->excluded_by(module); !entry.empty())
      fail(
          "{}: tensor '{}' is NVFP4, but '{}' in {} excludes its module from quantization (an "
          "excluded module keeps its checkpoint dtype)",
          file, name, entry, c_.nvfp4->declared_in);
    if (c_.nvfp4->input_scales && !t.input_scale)
      fail("{}: NVFP4 tensor '{}' has no '{}.input_scale' (quant_algo NVFP4)", file, name, module);
  }
  // A routed expert's matrix: NVFP4 as stored whatever keep_stored (as a container's experts stay
  // quantized), else as a projection; with row_end >= 0 only rows [row_begin, row_end).
  Matrix expert_matrix(const std::string& name, int64_t rows, int64_t cols, int64_t row_begin = 0,
                       int64_t row_end = -1) const {
    if (!checkpoint_.is_nvfp4(name)) {
      const Matrix m = projection(name, rows, cols);
      return row_end < 0 ? m : slice_rows(m, row_begin, row_end);
    }
    check_nvfp4(name);
    Matrix m;
    m.rows = row_end < 0 ? rows : row_end - row_begin;
    m.cols = cols;
    m.nvfp4 = checkpoint_.load_nvfp4(name, rows, cols, row_begin, row_end);
    return m;
  }
  // A projection, in kept_format(name).
  // by_rows: the caller reads the matrix row by row itself, so a container weight keeps its rows;
  // otherwise only the quantized kernels read it, in the layout they prefer.
  Matrix projection(const std::string& name, int64_t rows, int64_t cols,
                    bool by_rows = false) const {
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    switch (kept_format(name)) {
      case WeightFormat::kF32:
        return matrix(name, rows, cols);
      case WeightFormat::kBF16:
        m.bf16 = checkpoint_.load_bf16(name, {rows, cols});
        // Exponent all ones: NaN or Inf; the error is check_finite's on the widened values.
        if (std::any_of(m.bf16.begin(), m.bf16.end(),
                        [](uint16_t b) { return (b & 0x7F80) == 0x7F80; }))
          check_finite(checkpoint_.load_f32(name, {rows, cols}), where(name));
        break;
      case WeightFormat::kFp8Block:
        m.fp8 = checkpoint_.load_fp8(name, {rows, cols});
        break;
      case WeightFormat::kNvfp4:
        m.nvfp4 = checkpoint_.load_nvfp4(name, rows, cols);
        break;
      case WeightFormat::kInt8Row:
      case WeightFormat::kInt4Row:
      case WeightFormat::kInt4Grouped:
        m.quant = checkpoint_.load_quant(name, rows, cols);
        check_finite(m.quant.scales, where(checkpoint_.quant_scale_name(name)));
        if (!by_rows) use_cpu_layout(m.quant);
        break;
    }
    return m;
  }
  std::vector<float> vector(const std::string& name, int64_t n) const {
    std::vector<float> v = checkpoint_.load_f32(name, {n});
    check_finite(v, where(name));
    return v;
  }
  // "FILE: tensor 'NAME'" for errors.
  std::string where(const std::string& name) const {
    const TensorView* view = checkpoint_.find(name);
    return fmt::format("{}: tensor '{}'", view ? view->file->string() : checkpoint_.dir().string(),
                       name);
  }

  MlpWeights mlp(const std::string& prefix, int64_t intermediate) const {
    // A container's MLP is held as one, for the fused expert kernel.
    if (is_container(kept_format(prefix + "gate_proj.weight"))) return expert(prefix, intermediate);
    const int64_t h = c_.hidden_size;
    MlpWeights w;
    w.gate = projection(prefix + "gate_proj.weight", intermediate, h);
    w.up = projection(prefix + "up_proj.weight", intermediate, h);
    w.down = projection(prefix + "down_proj.weight", h, intermediate);
    return w;
  }

  // f(), its errors naming the expert.
  template <typename F>
  static auto naming(const std::string& prefix, F f) {
    try {
      return f();
    } catch (const Error& e) {
      fail("{}*: {}", prefix, e.what());
    }
  }
  // A routed expert: kept quantized when the container stores it so (all three matrices), fp32
  // otherwise. With `slice`, only that slice of it (slice_expert); of a container's expert only
  // the slice's gate and up rows are read.
  MlpWeights expert(const std::string& prefix, int64_t intermediate, ExpertSlice slice = {}) const {
    const std::string names[3] = {prefix + "gate_proj.weight", prefix + "up_proj.weight",
                                  prefix + "down_proj.weight"};
    int quantized = 0, nvfp4 = 0;
    for (const auto& name : names) {
      check_u8_scales(name);
      quantized += checkpoint_.is_quantized(name);
      nvfp4 += checkpoint_.is_nvfp4(name);
      if (checkpoint_.is_packed_int4(name)) check_declared(name);
    }
    if (nvfp4 > 0 && quantized == 0) {
      // NVFP4 as stored; of a slice, only the slice's gate and up rows are read.
      const int64_t h = c_.hidden_size;
      if (!slice.whole()) naming(prefix, [&] { check_expert_slice(slice, intermediate, false); });
      const int64_t b = slice.whole() ? 0 : slice.begin, e = slice.whole() ? -1 : slice.end;
      MlpWeights w;
      w.gate = expert_matrix(names[0], intermediate, h, b, e);
      w.up = expert_matrix(names[1], intermediate, h, b, e);
      w.down = expert_matrix(names[2], h, intermediate);
      if (!slice.whole()) w.down = naming(prefix, [&] { return slice_cols(w.down, b, e); });
      return w;
    }
    if (quantized == 0) {
      MlpWeights w = mlp(prefix, intermediate);
      if (!slice.whole()) return naming(prefix, [&] { return slice_expert(w, slice); });
      return w;
    }
    if (quantized != 3) {
      for (const auto& name : names)
        if (!checkpoint_.is_quantized(name)) {
          const TensorView* view = checkpoint_.find(name);
          if (!view) fail("{}: tensor '{}' is missing", checkpoint_.dir().string(), name);
          if (checkpoint_.is_nvfp4(name))
            fail(
                "{}: tensor '{}' is NVFP4 but the other matrices of its expert are container "
                "weights (U8 with '.qs' scales)",
                view->file->string(), name);
          fail(
              "{}: tensor '{}' has dtype {} but the other matrices of its expert are quantized "
              "(U8)",
              view->file->string(), name, dtype_name(view->dtype));
        }
    }
    const int64_t h = c_.hidden_size;
    // Cut as stored (rows), then laid out.
    if (!slice.whole()) naming(prefix, [&] { check_expert_slice(slice, intermediate, true); });
    const int64_t b = slice.whole() ? 0 : slice.begin, e = slice.whole() ? -1 : slice.end;
    MlpWeights w;
    w.quant.gate = checkpoint_.load_quant(names[0], intermediate, h, b, e);
    w.quant.up = checkpoint_.load_quant(names[1], intermediate, h, b, e);
    w.quant.down = checkpoint_.load_quant(names[2], h, intermediate);
    check_finite(w.quant.gate.scales, where(checkpoint_.quant_scale_name(names[0])));
    check_finite(w.quant.up.scales, where(checkpoint_.quant_scale_name(names[1])));
    check_finite(w.quant.down.scales, where(checkpoint_.quant_scale_name(names[2])));
    if (!slice.whole())
      w.quant.down = naming(prefix, [&] { return quant_cols(w.quant.down, b, e); });
    for (QuantMatrix* q : {&w.quant.gate, &w.quant.up, &w.quant.down}) use_cpu_layout(*q);
    return w;
  }

  // With `split_only`, only the projections split_targets lists and kv_b_proj (split by heads).
  AttentionWeights attention(int layer, bool with_indexer, bool split_only = false) const {
    const std::string p = layer_prefix(layer) + "self_attn.";
    const int64_t h = c_.hidden_size, heads = c_.num_heads;
    AttentionWeights a;
    if (c_.q_lora_rank > 0) {
      a.q_a_proj = projection(p + "q_a_proj.weight", c_.q_lora_rank, h);
      if (!split_only) a.q_a_norm = vector(p + "q_a_layernorm.weight", c_.q_lora_rank);
      a.q_b_proj = projection(p + "q_b_proj.weight", heads * c_.qk_head_dim(), c_.q_lora_rank);
    } else {
      a.q_proj = projection(p + "q_proj.weight", heads * c_.qk_head_dim(), h);
    }
    a.kv_a_proj =
        projection(p + "kv_a_proj_with_mqa.weight", c_.kv_lora_rank + c_.qk_rope_head_dim, h);
    a.o_proj = projection(p + "o_proj.weight", h, heads * c_.v_head_dim);
    // The absorbed attention reads kv_b_proj one row at a time: kept as stored in a format it reads
    // so (WeightFormatRow::read_by_rows), fp32 otherwise.
    const int64_t kv_b_rows = heads * (c_.qk_nope_head_dim + c_.v_head_dim);
    a.kv_b_proj = projection(p + "kv_b_proj.weight", kv_b_rows, c_.kv_lora_rank, /*by_rows=*/true);
    if (!format_row(a.kv_b_proj.format()).read_by_rows)
      a.kv_b_proj = matrix(p + "kv_b_proj.weight", kv_b_rows, c_.kv_lora_rank);
    if (split_only) {
      if (with_indexer) {
        a.indexer.emplace();
        a.indexer->wq_b = projection(p + "indexer.wq_b.weight",
                                     int64_t(c_.index_n_heads) * c_.index_head_dim, c_.q_lora_rank);
      }
      return a;
    }
    a.kv_a_norm = vector(p + "kv_a_layernorm.weight", c_.kv_lora_rank);
    if (with_indexer) {
      const std::string ip = p + "indexer.";
      IndexerWeights idx;
      idx.wq_b = projection(ip + "wq_b.weight", int64_t(c_.index_n_heads) * c_.index_head_dim,
                            c_.q_lora_rank);
      idx.wk = projection(ip + "wk.weight", c_.index_head_dim, h);
      idx.weights_proj = projection(ip + "weights_proj.weight", c_.index_n_heads, h);
      idx.k_norm_weight = vector(ip + "k_norm.weight", c_.index_head_dim);
      idx.k_norm_bias = vector(ip + "k_norm.bias", c_.index_head_dim);
      a.indexer = std::move(idx);
    }
    return a;
  }

  LayerWeights layer(int l, bool is_moe, bool with_indexer, const LoadOptions& options) const {
    LayerWeights w;
    w.is_moe = is_moe;
    const std::string p = layer_prefix(l);
    if (options.split_targets_only) {
      w.attn = attention(l, with_indexer, /*split_only=*/true);
      if (!is_moe) w.dense_mlp = mlp(p + "mlp.", c_.intermediate_size);
      return w;
    }
    if (options.dense) {
      w.input_norm = vector(p + "input_layernorm.weight", c_.hidden_size);
      w.post_attention_norm = vector(p + "post_attention_layernorm.weight", c_.hidden_size);
      w.attn = attention(l, with_indexer);
      if (!is_moe) w.dense_mlp = mlp(p + "mlp.", c_.intermediate_size);
    }
    if (!is_moe) return w;
    if (options.dense) {
      w.router = matrix(p + "mlp.gate.weight", c_.n_routed_experts, c_.hidden_size);
      w.router_bias = vector(p + "mlp.gate.e_score_correction_bias", c_.n_routed_experts);
      if (c_.n_shared_experts > 0)
        w.shared_experts =
            mlp(p + "mlp.shared_experts.", int64_t(c_.moe_intermediate_size) * c_.n_shared_experts);
    }
    w.experts.resize(size_t(c_.n_routed_experts));
    for (int e = 0; e < c_.n_routed_experts; ++e)
      if (!options.owns_expert || options.owns_expert(l, e))
        w.experts[size_t(e)] = expert(expert_prefix(l, e), c_.moe_intermediate_size);
    return w;
  }

 private:
  const ModelConfig& c_;
  const Checkpoint& checkpoint_;
  bool keep_stored_;
};

// Tensors the config has no place for: layers past num_hidden_layers (+ MTP layers), shared
// experts with n_shared_experts = 0, routed experts past n_routed_experts or in a dense layer.
// Such a checkpoint belongs to another config; running it would silently drop weights.
void refuse_unexpected_tensors(const ModelConfig& c, const Checkpoint& checkpoint) {
  constexpr std::string_view kLayers = "model.layers.";
  const int layers_in_config = c.num_layers + c.num_nextn_predict_layers;
  for (const std::string& name : checkpoint.names()) {
    if (name.rfind(kLayers, 0) != 0) continue;
    const char* begin = name.data() + kLayers.size();
    const char* end = name.data() + name.size();
    int layer = -1;
    const auto [after, ec] = std::from_chars(begin, end, layer);
    if (ec != std::errc() || after == end || *after != '.') continue;
    const std::string_view rest(after + 1, size_t(end - after - 1));
    const std::string file = checkpoint.find(name)->file->string();
    if (layer >= layers_in_config)
      fail(
          "{}: tensor '{}' belongs to layer {}, but config.json has num_hidden_layers = {} and "
          "num_nextn_predict_layers = {}",
          file, name, layer, c.num_layers, c.num_nextn_predict_layers);
    const bool moe =
        layer < c.num_layers ? bool(c.layer_is_moe[size_t(layer)]) : c.n_routed_experts > 0;
    if (rest.rfind("mlp.shared_experts.", 0) == 0 && (c.n_shared_experts == 0 || !moe))
      fail("{}: tensor '{}' is a shared expert, but config.json has {}", file, name,
           moe ? "n_shared_experts = 0" : fmt::format("layer {} dense", layer));
    constexpr std::string_view kExperts = "mlp.experts.";
    if (rest.rfind(kExperts, 0) != 0 && rest.rfind("mlp.gate.", 0) != 0) continue;
    if (!moe)
      fail("{}: tensor '{}' belongs to a MoE layer, but config.json has layer {} dense", file, name,
           layer);
    if (rest.rfind(kExperts, 0) != 0) continue;
    int expert = -1;
    const char* expert_begin = rest.data() + kExperts.size();
    const auto [expert_end, expert_ec] = std::from_chars(expert_begin, end, expert);
    if (expert_ec == std::errc() && expert >= c.n_routed_experts)
      fail("{}: tensor '{}' is routed expert {}, but config.json has n_routed_experts = {}", file,
           name, expert, c.n_routed_experts);
  }
}

}  // namespace

MlpWeights load_routed_expert(const ModelConfig& config, const Checkpoint& checkpoint, int layer,
                              int expert, ExpertSlice slice) {
  return Loader(config, checkpoint, /*keep_stored=*/true)
      .expert(expert_prefix(layer, expert), config.moe_intermediate_size, slice);
}

ModelWeights load_model_weights(const ModelConfig& config, const Checkpoint& checkpoint,
                                const LoadOptions& options) {
  refuse_unexpected_tensors(config, checkpoint);
  const Loader load(config, checkpoint, options.keep_stored);
  ModelWeights w;
  if (options.split_targets_only) {
    const bool tied = config.tie_word_embeddings && !checkpoint.contains("lm_head.weight");
    w.lm_head =
        tied ? load.matrix("model.embed_tokens.weight", config.vocab_size, config.hidden_size)
             : load.projection("lm_head.weight", config.vocab_size, config.hidden_size);
    for (int l = 0; l < config.num_layers; ++l) {
      const bool full_indexer = config.has_indexer() && config.indexer_is_full[size_t(l)];
      w.layers.push_back(load.layer(l, config.layer_is_moe[size_t(l)], full_indexer, options));
    }
    return w;
  }
  if (options.dense) {
    w.embed = load.matrix("model.embed_tokens.weight", config.vocab_size, config.hidden_size);
    w.final_norm = load.vector("model.norm.weight", config.hidden_size);
    if (config.tie_word_embeddings && !checkpoint.contains("lm_head.weight")) {
      w.lm_head = w.embed;
    } else {
      w.lm_head = load.projection("lm_head.weight", config.vocab_size, config.hidden_size);
    }
  }
  for (int l = 0; l < config.num_layers; ++l) {
    const bool full_indexer = config.has_indexer() && config.indexer_is_full[size_t(l)];
    w.layers.push_back(load.layer(l, config.layer_is_moe[size_t(l)], full_indexer, options));
  }

  // MTP layers follow the main layers. transformers drops them on save, so they are optional;
  // when present they must be complete and well-shaped.
  for (int i = 0; options.mtp && options.dense && i < config.num_nextn_predict_layers; ++i) {
    const int l = config.num_layers + i;
    const std::string p = layer_prefix(l);
    if (!checkpoint.contains(p + "eh_proj.weight")) continue;
    MtpWeights mtp;
    mtp.eh_proj =
        load.matrix(p + "eh_proj.weight", config.hidden_size, 2 * int64_t(config.hidden_size));
    mtp.enorm = load.vector(p + "enorm.weight", config.hidden_size);
    mtp.hnorm = load.vector(p + "hnorm.weight", config.hidden_size);
    mtp.head_norm = load.vector(p + "shared_head.norm.weight", config.hidden_size);
    const bool full_indexer =
        config.has_indexer() && checkpoint.contains(p + "self_attn.indexer.wk.weight");
    mtp.layer = load.layer(l, config.n_routed_experts > 0, full_indexer, options);
    w.mtp.push_back(std::move(mtp));
  }
  return w;
}

}  // namespace colibri
