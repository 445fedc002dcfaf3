// Fuzz target: generation_config.json, read by load_model_config next to a fixed valid
// config.json (the embedded model's), in a temporary model directory. Accepted files give
// sampling defaults in range and end-of-sequence ids inside the vocabulary.
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include "fuzz_target.h"
#include "model/config.h"

namespace {

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) colibri::fuzz::finding("harness", "cannot read the embedded model's config.json");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static colibri::fuzz::InputFile file("generation_config.json");
  static const bool have_config = [] {
    file.write_sibling("config.json",
                       read_text(COLIBRI_SOURCE_DIR "/models/glm5-tiny-kjv/config.json"));
    return true;
  }();
  (void)have_config;
  file.write(data, size);
  return colibri::fuzz::run_one([&] {
    const colibri::ModelConfig c = colibri::load_model_config(file.dir());
    const colibri::GenerationDefaults& g = c.generation;
    fuzz_require(std::isfinite(g.temperature) && g.temperature >= 0, "temperature in range");
    fuzz_require(std::isfinite(g.top_p) && g.top_p >= 0 && g.top_p <= 1, "top_p in [0, 1]");
    for (const int id : g.eos_token_ids)
      fuzz_require(id >= 0 && id < c.vocab_size, "eos id inside the vocabulary");
    if (g.bos_token_id) fuzz_require(*g.bos_token_id >= 0, "non-negative bos id");
  });
}
