// colibri-gen-bench-model: writes a container directory with random weights in the shapes of a
// GLM-5.2-style MoE (MLA attention, DSA indexer, routed + shared experts), for benchmarking the
// node at real per-layer sizes without a checkpoint. Routed experts are int4-g64 (random packed
// bytes and scales generated directly, one tensor at a time), dense weights int8-row, norms and
// routers F32. One shard per layer plus one for the embeddings, final norm and lm_head.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.h"
#include "model/container.h"
#include "tools/convert.h"

namespace {

namespace fs = std::filesystem;
using colibri::QuantSpec;
using colibri::ShardSlot;
using colibri::kernels::QuantFormat;
using nlohmann::json;

struct Shape {
  int layers = 2, vocab = 4096, hidden = 6144, heads = 64;
  int q_lora_rank = 2048, kv_lora_rank = 512, qk_nope = 192, qk_rope = 64, v_head = 256;
  int index_heads = 32, index_head_dim = 128, index_topk = 2048;
  int experts = 256, moe_intermediate = 2048, shared_experts = 1, top_k = 8,
      dense_intermediate = 12288;
  int first_dense = 1, group_size = 64;
  uint64_t seed = 1;
};

// splitmix64: fast, reproducible, good enough for weights nobody reads.
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
};

enum class Kind { kNorm, kZero, kRouter, kInt8, kInt4 };

struct Tensor {
  std::string name;
  int64_t rows, cols;  // cols = 0 for a 1-D tensor of `rows` elements
  Kind kind;
};

QuantSpec spec_of(const Tensor& t, int group_size) {
  if (t.kind == Kind::kInt8) return {QuantFormat::kInt8Row, 0};
  QuantSpec spec{QuantFormat::kInt4Grouped, group_size};
  if ((t.cols + group_size - 1) / group_size <= 1) spec = {QuantFormat::kInt4Row, 0};
  const colibri::QuantResolution back = colibri::resolve_quant_format(
      colibri::kernels::packed_bytes(spec.format, t.rows, t.cols),
      colibri::kernels::scale_count(spec.format, t.rows, t.cols, spec.group_size), t.rows, t.cols);
  if (!back.ok() || back.spec.format != spec.format || back.spec.group_size != spec.group_size)
    colibri::fail("{} [{}, {}]: {} would not be readable unambiguously; choose other sizes", t.name,
                  t.rows, t.cols, colibri::quant_spec_name(spec));
  return spec;
}

std::vector<ShardSlot> slots_of(const Tensor& t, int group_size) {
  if (t.kind == Kind::kInt8 || t.kind == Kind::kInt4)
    return colibri::quant_slots(t.name, spec_of(t, group_size), t.rows, t.cols);
  std::vector<int64_t> shape = {t.rows};
  if (t.cols) shape.push_back(t.cols);
  return {{t.name, "F32", shape, 4 * uint64_t(t.rows) * uint64_t(t.cols ? t.cols : 1)}};
}

// Tensors of one shard in file order: a routed expert's gate, up and down data, then their
// scales (one contiguous read per expert, as colibri-convert writes them).
struct Shard {
  std::vector<std::vector<Tensor>> units;
};

void add(Shard& shard, Tensor t) {
  shard.units.push_back({std::move(t)});
}

Shard layer_shard(const Shape& s, int layer) {
  const std::string p = fmt::format("model.layers.{}.", layer);
  const std::string a = p + "self_attn.";
  Shard shard;
  add(shard, {p + "input_layernorm.weight", s.hidden, 0, Kind::kNorm});
  add(shard, {p + "post_attention_layernorm.weight", s.hidden, 0, Kind::kNorm});
  add(shard, {a + "q_a_proj.weight", s.q_lora_rank, s.hidden, Kind::kInt8});
  add(shard, {a + "q_a_layernorm.weight", s.q_lora_rank, 0, Kind::kNorm});
  add(shard, {a + "q_b_proj.weight", int64_t(s.heads) * (s.qk_nope + s.qk_rope), s.q_lora_rank,
              Kind::kInt8});
  add(shard, {a + "kv_a_proj_with_mqa.weight", s.kv_lora_rank + s.qk_rope, s.hidden, Kind::kInt8});
  add(shard, {a + "kv_a_layernorm.weight", s.kv_lora_rank, 0, Kind::kNorm});
  add(shard, {a + "kv_b_proj.weight", int64_t(s.heads) * (s.qk_nope + s.v_head), s.kv_lora_rank,
              Kind::kInt8});
  add(shard, {a + "o_proj.weight", s.hidden, int64_t(s.heads) * s.v_head, Kind::kInt8});
  add(shard, {a + "indexer.wq_b.weight", int64_t(s.index_heads) * s.index_head_dim, s.q_lora_rank,
              Kind::kInt8});
  add(shard, {a + "indexer.wk.weight", s.index_head_dim, s.hidden, Kind::kInt8});
  add(shard, {a + "indexer.k_norm.weight", s.index_head_dim, 0, Kind::kNorm});
  add(shard, {a + "indexer.k_norm.bias", s.index_head_dim, 0, Kind::kZero});
  add(shard, {a + "indexer.weights_proj.weight", s.index_heads, s.hidden, Kind::kRouter});
  const std::string m = p + "mlp.";
  if (layer < s.first_dense) {
    add(shard, {m + "gate_proj.weight", s.dense_intermediate, s.hidden, Kind::kInt8});
    add(shard, {m + "up_proj.weight", s.dense_intermediate, s.hidden, Kind::kInt8});
    add(shard, {m + "down_proj.weight", s.hidden, s.dense_intermediate, Kind::kInt8});
    return shard;
  }
  add(shard, {m + "gate.weight", s.experts, s.hidden, Kind::kRouter});
  add(shard, {m + "gate.e_score_correction_bias", s.experts, 0, Kind::kZero});
  const int64_t shared = int64_t(s.moe_intermediate) * s.shared_experts;
  add(shard, {m + "shared_experts.gate_proj.weight", shared, s.hidden, Kind::kInt8});
  add(shard, {m + "shared_experts.up_proj.weight", shared, s.hidden, Kind::kInt8});
  add(shard, {m + "shared_experts.down_proj.weight", s.hidden, shared, Kind::kInt8});
  for (int e = 0; e < s.experts; ++e) {
    const std::string x = fmt::format("{}experts.{}.", m, e);
    shard.units.push_back({{x + "gate_proj.weight", s.moe_intermediate, s.hidden, Kind::kInt4},
                           {x + "up_proj.weight", s.moe_intermediate, s.hidden, Kind::kInt4},
                           {x + "down_proj.weight", s.hidden, s.moe_intermediate, Kind::kInt4}});
  }
  return shard;
}

Shard io_shard(const Shape& s) {
  Shard shard;
  add(shard, {"model.embed_tokens.weight", s.vocab, s.hidden, Kind::kInt8});
  add(shard, {"model.norm.weight", s.hidden, 0, Kind::kNorm});
  add(shard, {"lm_head.weight", s.vocab, s.hidden, Kind::kInt8});
  return shard;
}

// Random packed bytes and scales with weights of standard deviation about 1/sqrt(cols) (so
// activations keep their scale through the layers), or 1-D F32 values.
void write_tensor_data(colibri::ShardWriter& out, const Tensor& t, int group_size, Rng& rng,
                       std::vector<float>* scales_out) {
  std::vector<uint8_t> bytes;
  if (t.kind == Kind::kInt8 || t.kind == Kind::kInt4) {
    const QuantSpec spec = spec_of(t, group_size);
    bytes.resize(size_t(colibri::kernels::packed_bytes(spec.format, t.rows, t.cols)));
    size_t i = 0;
    for (; i + 8 <= bytes.size(); i += 8) {
      const uint64_t r = rng.next();
      std::memcpy(bytes.data() + i, &r, 8);
    }
    for (; i < bytes.size(); ++i) bytes[i] = uint8_t(rng.next());
    // Uniform int8 has standard deviation ~74, uniform int4 (q in [-8, 7]) ~4.6.
    const float q_std = t.kind == Kind::kInt8 ? 74.0f : 4.6f;
    const float base = 1.0f / (q_std * std::sqrt(float(t.cols)));
    scales_out->resize(
        size_t(colibri::kernels::scale_count(spec.format, t.rows, t.cols, spec.group_size)));
    for (float& v : *scales_out) v = base * (0.75f + 0.5f * rng.uniform());
    out.write(bytes.data(), bytes.size());
    return;
  }
  std::vector<float> values(size_t(t.rows) * size_t(t.cols ? t.cols : 1));
  const float router = 1.0f / std::sqrt(float(t.cols ? t.cols : 1));
  for (float& v : values) {
    if (t.kind == Kind::kNorm)
      v = 1.0f;
    else if (t.kind == Kind::kZero)
      v = 0.0f;
    else
      v = router * (2.0f * rng.uniform() - 1.0f) * 1.7f;  // uniform with std ~ 1/sqrt(cols)
  }
  out.write(values.data(), values.size() * 4);
}

json config_of(const Shape& s) {
  json mlp = json::array(), indexer = json::array(), layer_types = json::array();
  for (int l = 0; l < s.layers; ++l) {
    mlp.push_back(l < s.first_dense ? "dense" : "sparse");
    indexer.push_back("full");
    layer_types.push_back("indexed_attention");
  }
  return {{"architectures", {"GlmMoeDsaForCausalLM"}},
          {"model_type", "glm_moe_dsa"},
          {"attention_bias", false},
          {"eos_token_id", s.vocab - 1},
          {"pad_token_id", s.vocab - 1},
          {"first_k_dense_replace", s.first_dense},
          {"head_dim", s.qk_rope},
          {"hidden_act", "silu"},
          {"hidden_size", s.hidden},
          {"index_head_dim", s.index_head_dim},
          {"index_n_heads", s.index_heads},
          {"index_topk", s.index_topk},
          {"indexer_types", indexer},
          {"intermediate_size", s.dense_intermediate},
          {"kv_lora_rank", s.kv_lora_rank},
          {"layer_types", layer_types},
          {"max_position_embeddings", 202752},
          {"mlp_layer_types", mlp},
          {"moe_intermediate_size", s.moe_intermediate},
          {"n_group", 1},
          {"n_routed_experts", s.experts},
          {"n_shared_experts", s.shared_experts},
          {"norm_topk_prob", true},
          {"num_attention_heads", s.heads},
          {"num_experts_per_tok", s.top_k},
          {"num_hidden_layers", s.layers},
          {"num_key_value_heads", s.heads},
          {"num_nextn_predict_layers", 0},
          {"q_lora_rank", s.q_lora_rank},
          {"qk_head_dim", s.qk_nope + s.qk_rope},
          {"qk_nope_head_dim", s.qk_nope},
          {"qk_rope_head_dim", s.qk_rope},
          {"rms_norm_eps", 1e-05},
          {"rope_parameters", {{"rope_theta", 1000000.0}, {"rope_type", "default"}}},
          {"routed_scaling_factor", 2.5},
          {"tie_word_embeddings", false},
          {"topk_group", 1},
          {"v_head_dim", s.v_head},
          {"vocab_size", s.vocab}};
}

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  std::string output;
  CLI::App app{
      "colibri-gen-bench-model: writes a colibri container with random weights in GLM-5.2's "
      "per-layer shapes "
      "(defaults), for benchmarking colibri-node without a checkpoint. Routed experts int4-g64, "
      "dense weights "
      "int8-row, norms and routers F32; layer 0..first-dense-1 dense, the rest MoE. Memory use is "
      "bounded by "
      "one tensor."};
  app.add_option("output", output, "output directory (created; must not hold safetensors files)")
      ->required();
  auto opt = [&](const char* name, int& value, const char* help) {
    app.add_option(name, value, help)->capture_default_str()->check(CLI::Range(1, 1 << 20));
  };
  opt("--layers", s.layers, "decoder layers");
  opt("--vocab", s.vocab, "vocabulary size");
  opt("--hidden", s.hidden, "hidden size");
  opt("--heads", s.heads, "attention heads");
  opt("--q-lora-rank", s.q_lora_rank, "MLA query low rank");
  opt("--kv-lora-rank", s.kv_lora_rank, "MLA key/value low rank");
  opt("--qk-nope", s.qk_nope, "query/key head dim without rope");
  opt("--qk-rope", s.qk_rope, "query/key rope head dim");
  opt("--v-head", s.v_head, "value head dim");
  opt("--index-heads", s.index_heads, "DSA indexer heads");
  opt("--index-head-dim", s.index_head_dim, "DSA indexer head dim");
  opt("--index-topk", s.index_topk, "DSA indexer top-k");
  opt("--experts", s.experts, "routed experts per MoE layer");
  opt("--moe-intermediate", s.moe_intermediate, "routed/shared expert intermediate size");
  opt("--shared-experts", s.shared_experts, "shared experts per MoE layer");
  opt("--top-k", s.top_k, "experts per token");
  opt("--intermediate", s.dense_intermediate, "dense MLP intermediate size");
  app.add_option("--first-dense", s.first_dense, "leading dense layers")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--group-size", s.group_size, "int4 group size of the routed experts")
      ->capture_default_str();
  app.add_option("--seed", s.seed, "random seed")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    if (s.top_k > s.experts) colibri::fail("--top-k {} exceeds --experts {}", s.top_k, s.experts);
    if (s.qk_rope % 2) colibri::fail("--qk-rope {}: expected an even number", s.qk_rope);
    if (!colibri::kernels::is_valid_group_size(s.group_size))
      colibri::fail("--group-size {}: expected one of 16, 32, 48, 64, 96, 128, 192, 256",
                    s.group_size);
    const fs::path dir = output;
    fs::create_directories(dir);
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.path().extension() == ".safetensors")
        colibri::fail("{}: already holds safetensors files; use a new or empty directory",
                      dir.string());

    std::vector<Shard> shards;
    for (int l = 0; l < s.layers; ++l) shards.push_back(layer_shard(s, l));
    shards.push_back(io_shard(s));
    // Check every shape before writing anything.
    uint64_t total = 0;
    std::vector<std::vector<ShardSlot>> slots(shards.size());
    for (size_t i = 0; i < shards.size(); ++i) {
      for (const auto& unit : shards[i].units) {
        for (const Tensor& t : unit) slots[i].push_back(slots_of(t, s.group_size)[0]);
        for (const Tensor& t : unit) {
          const auto both = slots_of(t, s.group_size);
          if (both.size() == 2) slots[i].push_back(both[1]);
        }
      }
      for (const ShardSlot& slot : slots[i]) total += slot.bytes;
    }
    std::fprintf(stderr, "[colibri-gen-bench-model] %s: %zu shards, %.2f GB\n", dir.c_str(),
                 shards.size(), double(total) / 1e9);

    json weight_map = json::object();
    Rng rng{s.seed};
    uint64_t done = 0;
    const auto start = std::chrono::steady_clock::now();
    auto last = start;
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name =
          fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
      colibri::ShardWriter out(dir / name, slots[i], "colibri-gen-bench-model");
      for (const auto& unit : shards[i].units) {
        std::vector<std::vector<float>> scales(unit.size());
        for (size_t k = 0; k < unit.size(); ++k)
          write_tensor_data(out, unit[k], s.group_size, rng, &scales[k]);
        for (const auto& sc : scales) out.write(sc.data(), sc.size() * 4);
        const auto now = std::chrono::steady_clock::now();
        if (now - last >= std::chrono::seconds(2)) {
          last = now;
          std::fprintf(stderr, "[colibri-gen-bench-model] %s: %.2f / %.2f GB, %.0f MB/s\n",
                       name.c_str(), double(done + out.written()) / 1e9, double(total) / 1e9,
                       double(done + out.written()) / 1e6 /
                           std::chrono::duration<double>(now - start).count());
        }
      }
      done += out.written();
      out.finish();
      for (const ShardSlot& slot : slots[i]) weight_map[slot.name] = name;
    }
    colibri::write_text_atomically(dir / "config.json", config_of(s).dump(2));
    colibri::write_text_atomically(
        dir / "generation_config.json",
        json{{"eos_token_id", s.vocab - 1}, {"pad_token_id", s.vocab - 1}, {"do_sample", false}}
            .dump(2));
    colibri::write_text_atomically(
        dir / "model.safetensors.index.json",
        json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2));
    std::fprintf(stderr, "[colibri-gen-bench-model] done: %.2f GB in %.1f s\n", double(done) / 1e9,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri-gen-bench-model: %s\n", e.what());
    return 1;
  }
  return 0;
}
