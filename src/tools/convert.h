// colibri-convert: a Hugging Face checkpoint (BF16/F16/F32, or FP8 with 128x128 block scales)
// to colibri's int4/int8 container (model/container.h). One output shard per input shard,
// written one tensor at a time; every shard is written as `<name>.partial` and renamed when
// complete, so an interrupted run leaves nothing loadable, and a rerun with the same parameters
// keeps the shards already complete.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

namespace colibri {

struct ConvertOptions {
  std::filesystem::path input_dir, output_dir;
  int expert_bits = 4;  // routed experts: 4 or 8
  int group_size = 64;  // int4 group size (a container candidate), 0 = per row
  int dense_bits = 8;   // attention, dense MLPs, shared experts, indexer: 4, 8, 16 (BF16) or 32 (F32)
  int io_bits = 8;      // embeddings and lm_head: 8, 16 (BF16) or 32 (F32)
  // Called once per tensor written, and once per shard skipped because it was already complete.
  std::function<void(const std::string& line)> progress;
  // For tests: stop (throwing Error) after writing this many tensors in this run; < 0 = never.
  int stop_after_tensors = -1;
};

struct ConvertResult {
  int shards_written = 0, shards_skipped = 0;
  uint64_t bytes_written = 0;
};

// Name of the parameter record kept in the output directory.
inline constexpr const char* kConvertManifest = "colibri-convert.json";

// Throws Error (one line naming the file or tensor) on bad input, a refused resume, or an
// output the reader could not resolve unambiguously.
ConvertResult convert_checkpoint(const ConvertOptions& options);

}  // namespace colibri
