// Fuzz target: the text of a Hugging Face config.json, parsed by parse_model_config (what
// load_model_config does with DIR/config.json). An accepted config must be internally consistent:
// per-layer tables of num_hidden_layers entries, head sizes and a softmax scale that are usable.
#include <cmath>
#include <string>

#include "fuzz_target.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  return colibri::fuzz::run_one([&] {
    const colibri::ModelConfig c = colibri::parse_model_config(text, "config.json");
    fuzz_require(c.num_layers >= 1, "at least one layer");
    fuzz_require(c.layer_is_moe.size() == size_t(c.num_layers), "one MoE flag per layer");
    fuzz_require(c.vocab_size >= 1 && c.hidden_size >= 1, "positive sizes");
    fuzz_require(c.qk_head_dim() > 0 && c.qk_rope_head_dim % 2 == 0, "usable head dims");
    fuzz_require(std::isfinite(c.softmax_scale()) && c.softmax_scale() > 0, "finite softmax scale");
    fuzz_require(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps >= 0, "finite rms_norm_eps");
    fuzz_require(std::isfinite(c.rope.theta) && c.rope.theta > 0, "finite rope theta");
    if (c.num_moe_layers() > 0) {
      fuzz_require(c.num_experts_per_tok >= 1 && c.num_experts_per_tok <= c.n_routed_experts,
                   "top-k within the experts");
      fuzz_require(c.n_group >= 1 && c.n_routed_experts % c.n_group == 0, "whole expert groups");
      fuzz_require(std::isfinite(c.routed_scaling_factor), "finite routed_scaling_factor");
    }
    if (c.has_indexer()) {
      fuzz_require(c.indexer_is_full.size() == size_t(c.num_layers), "one indexer kind per layer");
      fuzz_require(c.indexer_is_full[0], "layer 0 has a full indexer");
    }
    for (const int id : c.generation.eos_token_ids) fuzz_require(id >= 0, "non-negative eos id");
  });
}
