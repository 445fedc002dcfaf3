// All safetensors shards of a model directory, memory-mapped, with fp32 loading of single
// tensors (BF16/F16/F32 converted, F8_E4M3 dequantized with its 128x128 weight_scale_inv, colibri
// container weights — U8 + `.qs` — dequantized) and loading of container weights as they are.
#pragma once

#include <array>
#include <atomic>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/huge_pages.h"
#include "common/safetensors.h"
#include "model/container.h"

namespace colibri {

// An FP8 E4M3 weight as stored, with its fp32 block scales ("<name>_scale_inv"): weight [i, j] is
// e4m3(bits[i * cols + j]) * scales[(i / block_rows) * ceil(cols / block_cols) + j / block_cols].
struct Fp8Matrix {
  WeightVector<uint8_t> bits;
  WeightVector<float> scales;
  int64_t block_rows = 0, block_cols = 0;
  bool empty() const { return bits.empty(); }
  uint64_t bytes() const { return bits.size() + 4 * scales.size(); }
};

class Checkpoint {
 public:
  // Opens model.safetensors, or the shards listed in model.safetensors.index.json, or else
  // every *.safetensors file of the directory. Every shard is validated at open.
  explicit Checkpoint(const std::filesystem::path& model_dir,
                      std::optional<std::array<int, 2>> fp8_block = std::nullopt);

  const TensorView* find(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  std::vector<std::string> names() const;
  const std::filesystem::path& dir() const { return dir_; }

  // Returns the tensor as float32, checking its shape. F8_E4M3 tensors are multiplied by
  // `<name>_scale_inv` blocks. Errors name the tensor and its file.
  // A U8 tensor is a container weight (see load_quant) and is dequantized; `shape` must be 2-D.
  std::vector<float> load_f32(const std::string& name, const std::vector<int64_t>& shape) const;

  // True when `name` exists with dtype BF16.
  bool is_bf16(const std::string& name) const;
  // The BF16 tensor's bits as stored, checking its shape and dtype.
  std::vector<uint16_t> load_bf16(const std::string& name, const std::vector<int64_t>& shape) const;

  // True when `name` exists with dtype F8_E4M3.
  bool is_fp8(const std::string& name) const;
  // The 2-D F8_E4M3 tensor's bytes as stored and its block scales, checking shapes and dtypes and
  // refusing NaN bytes (S.1111.111) and non-finite scales, naming the tensor and its file.
  Fp8Matrix load_fp8(const std::string& name, const std::vector<int64_t>& shape) const;

  // True when `name` exists with dtype U8, i.e. as a quantized container weight.
  bool is_quantized(const std::string& name) const;
  // Loads the container weight `name` (U8 packed bytes + `<name>.qs` F32 scales) expected as
  // [rows, cols], keeping it quantized. The format is inferred from the byte and scale counts (the
  // U8 shape is not used); an inconsistent or ambiguous pair is refused with an error naming the
  // file, the tensor and the sizes.
  // With row_end >= 0, only rows [row_begin, row_end) are read (their bytes and scales): a
  // [row_end - row_begin, cols] matrix, as slicing the whole one would give.
  QuantMatrix load_quant(const std::string& name, int64_t rows, int64_t cols, int64_t row_begin = 0,
                         int64_t row_end = -1) const;

  // Bytes of tensor data converted so far (scales included): what this process read.
  uint64_t bytes_loaded() const { return bytes_loaded_.load(); }

  // The safetensors files, in the order they were opened, and the one holding `view`.
  const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }
  const SafetensorsFile& shard_of(const TensorView& view) const;
  // out[numel] = the float tensor `view` converted to fp32, read with pread.
  void read_f32(const TensorView& view, float* out) const;

 private:
  std::filesystem::path dir_;
  std::optional<std::array<int, 2>> fp8_block_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  // The block scales of the F8_E4M3 tensor `name` [rows, cols], checked and read.
  Fp8Matrix fp8_scales(const std::string& name, int64_t rows, int64_t cols) const;
  std::unordered_map<std::string, const TensorView*> tensors_;
  mutable std::atomic<uint64_t> bytes_loaded_{0};
};

std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace colibri
