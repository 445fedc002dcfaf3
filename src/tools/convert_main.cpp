// colibri-convert: a Hugging Face checkpoint directory to colibri's int4/int8 container.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "common/error.h"
#include "tools/convert.h"

int main(int argc, char** argv) {
  colibri::ConvertOptions options;
  std::string input, output;
  CLI::App app{
      "colibri-convert: converts a Hugging Face checkpoint (BF16/F16/F32, FP8 with block "
      "scales, compressed-tensors INT4, whose weights keep their numbers and group size (with "
      "zero points: dequantized and quantized as the float weights of their kind), or "
      "NVIDIA ModelOpt NVFP4, whose weights are copied as stored unless --nvfp4 requantize) to "
      "colibri's int4/int8 container: U8 packed weights with F32 '.qs' scales, HF tensor names, "
      "one output "
      "shard per input shard. Interrupted runs resume: shards are written as '.partial' and "
      "renamed when "
      "complete; the parameters are recorded in " +
      std::string(colibri::kConvertManifest) + " and a resume with other parameters is refused."};
  app.add_option("input", input, "Hugging Face model directory (config.json + safetensors)")
      ->required();
  app.add_option("output", output,
                 "output directory (created; config and tokenizer files are copied)")
      ->required();
  app.add_option("--expert-bits", options.expert_bits, "routed experts: 4 (int4) or 8 (int8-row)")
      ->capture_default_str();
  app.add_option("--group-size", options.group_size,
                 "int4 group size: 0 (per row) or 16, 32, 48, 64, 96, 128, 192, 256")
      ->capture_default_str();
  app.add_option("--dense-bits", options.dense_bits,
                 "attention, dense MLPs, shared experts, indexer: 4, 8, 16 (BF16) or 32 (F32)")
      ->capture_default_str();
  app.add_option("--io-bits", options.io_bits, "embeddings and lm_head: 8, 16 (BF16) or 32 (F32)")
      ->capture_default_str();
  std::string nvfp4 = "keep";
  app.add_option("--nvfp4", nvfp4,
                 "NVFP4 (ModelOpt) weights: keep (copied as stored with their scales, loaded as "
                 "NVFP4) or requantize (dequantized, then quantized as the float weights of their "
                 "kind)")
      ->check(CLI::IsMember({"keep", "requantize"}))
      ->capture_default_str();
  app.footer("Norms, routers (mlp.gate.weight), e_score_correction_bias and biases stay F32.");
  CLI11_PARSE(app, argc, argv);
  options.nvfp4_as_stored = nvfp4 == "keep";
  options.input_dir = input;
  options.output_dir = output;
  options.progress = [](const std::string& line) {
    std::fprintf(stderr, "[colibri-convert] %s\n", line.c_str());
  };
  try {
    const colibri::ConvertResult r = colibri::convert_checkpoint(options);
    std::fprintf(stderr, "[colibri-convert] done: %d shards written, %d kept, %.1f MB written\n",
                 r.shards_written, r.shards_skipped, double(r.bytes_written) / 1e6);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri-convert: %s\n", e.what());
    return 1;
  }
  return 0;
}
