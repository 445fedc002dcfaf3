// colibri-node: run a Mixture-of-Experts model from a Hugging Face directory.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/npy.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/generate.h"
#include "model/weights.h"

namespace {

std::vector<int> parse_ids(const std::string& text) {
  std::vector<int> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    size_t used = 0;
    long value = -1;
    try {
      value = std::stol(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || value < 0 || value > (1L << 30))
      colibri::fail("--prompt-ids: '{}' is not a token id (expected e.g. 1,2,3)", item);
    ids.push_back(int(value));
    pos = comma + 1;
  }
  return ids;
}

int run(int argc, char** argv) {
  CLI::App app{"colibri-node: Mixture-of-Experts inference across GPUs and CPU memory"};
  std::string model_dir, prompt_ids, logits_out;
  int ngen = 16;
  float temperature = 0.0f, top_p = 1.0f;
  uint64_t seed = 0;
  bool ignore_eos = false;
  app.add_option("--model", model_dir, "Hugging Face model directory")->required()->check(CLI::ExistingDirectory);
  app.add_option("--prompt-ids", prompt_ids, "prompt as comma-separated token ids, e.g. 1,2,3")->required();
  app.add_option("--ngen", ngen, "number of tokens to generate")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  app.add_option("--temp", temperature, "sampling temperature; 0 = greedy")->capture_default_str();
  app.add_option("--top-p", top_p, "nucleus sampling mass in (0, 1]")->capture_default_str();
  app.add_option("--seed", seed, "random seed for sampling")->capture_default_str();
  app.add_flag("--ignore-eos", ignore_eos, "keep generating after an end-of-sequence token");
  app.add_option("--logits-out", logits_out,
                 "write the logits of every position (prompt and generated) as float32 .npy [positions, vocab]");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  const colibri::ModelConfig config = colibri::load_model_config(model_dir);
  const colibri::Checkpoint checkpoint(model_dir, config.fp8_block);
  const colibri::ModelWeights weights = colibri::load_model_weights(config, checkpoint);
  colibri::ReferenceModel model(config, weights);

  colibri::GenerateRequest request;
  request.prompt = parse_ids(prompt_ids);
  request.max_new_tokens = ngen;
  request.sampling = {temperature, top_p, seed};
  if (!ignore_eos) request.stop_ids = config.generation.eos_token_ids;
  request.keep_logits = !logits_out.empty();
  const colibri::GenerateResult result = colibri::generate(model, request, [](int token) {
    std::fprintf(stdout, "%d ", token);
    std::fflush(stdout);
  });
  std::fprintf(stdout, "\n");
  if (!logits_out.empty()) {
    const int64_t rows = int64_t(result.logits.size()) / config.vocab_size;
    const int64_t shape[] = {rows, config.vocab_size};
    colibri::write_npy_f32(logits_out, result.logits, shape);
  }
  const int decoded = int(result.tokens.size()) - 1;
  std::fprintf(stderr, "prefill %zu tok in %.3f s | decode %d tok in %.3f s (%.2f tok/s)\n",
               request.prompt.size(), result.prefill_seconds, decoded, result.decode_seconds,
               decoded > 0 && result.decode_seconds > 0 ? decoded / result.decode_seconds : 0.0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const colibri::Error& e) {
    std::fprintf(stderr, "colibri-node: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri-node: internal error: %s\n", e.what());
    return 2;
  }
}
