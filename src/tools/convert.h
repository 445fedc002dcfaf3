// colibri-convert: a Hugging Face checkpoint (BF16/F16/F32, FP8 with 128x128 block scales,
// compressed-tensors pack-quantized INT4, whose weights keep their numbers and group size when
// symmetric and are dequantized with their zero points and quantized as the float weights of
// their kind when asymmetric, or NVIDIA ModelOpt NVFP4, whose weights are copied as stored) to
// colibri's int4/int8 container
// (model/container.h). One output shard per input shard,
// written one tensor at a time; every shard is written as `<name>.partial` and renamed when
// complete, so an interrupted run leaves nothing loadable, and a rerun with the same parameters
// keeps the shards already complete.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "model/container.h"

namespace colibri {

// One header entry of a safetensors shard, in file order (tensors lie back to back).
struct ShardSlot {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t bytes;
};

// The header entries of a quantized [rows, cols] weight: `<name>` (U8 packed bytes) and
// `<name>.qs` (F32 scales), in that order.
std::vector<ShardSlot> quant_slots(const std::string& name, QuantSpec spec, int64_t rows,
                                   int64_t cols);

// The safetensors header text (JSON, padded to 8 bytes) of a shard holding `slots`, with
// `producer` recorded in its metadata.
std::string shard_header(const std::vector<ShardSlot>& slots, const std::string& producer);

// Writes one shard as `<path>.partial` (header first, then the caller's tensor bytes in slot
// order) and renames it to `path` in finish(), once exactly the bytes the header names were
// written; a writer destroyed before finish() leaves only the partial file.
class ShardWriter {
 public:
  ShardWriter(const std::filesystem::path& path, const std::vector<ShardSlot>& slots,
              const std::string& producer);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  void write(const void* data, size_t bytes);
  // Bytes written so far, header included.
  uint64_t written() const { return written_; }
  // Flushes to disk, checks the size, renames.
  void finish();

 private:
  std::filesystem::path path_, partial_;
  std::FILE* file_ = nullptr;
  uint64_t written_ = 0, expected_ = 0;
};

// Writes `text` to `<path>.partial`, flushes it and renames it to `path`.
void write_text_atomically(const std::filesystem::path& path, const std::string& text);

struct ConvertOptions {
  std::filesystem::path input_dir, output_dir;
  int expert_bits = 4;  // routed experts: 4 or 8
  int group_size = 64;  // int4 group size (a container candidate), 0 = per row
  int dense_bits =
      8;            // attention, dense MLPs, shared experts, indexer: 4, 8, 16 (BF16) or 32 (F32)
  int io_bits = 8;  // embeddings and lm_head: 8, 16 (BF16) or 32 (F32)
  // NVFP4 weights (NVIDIA ModelOpt): true: copied as stored with their scales (the container holds
  // no format with their numbers; the copied config.json and hf_quant_config.json declare them, so
  // they load as NVFP4); false ("requantize"): dequantized and quantized as the float weights of
  // their kind (expert_bits, dense_bits, io_bits).
  bool nvfp4_as_stored = true;
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
