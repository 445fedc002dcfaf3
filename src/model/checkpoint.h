// All safetensors shards of a model directory, memory-mapped, with fp32 loading of single
// tensors (BF16/F16/F32 converted, F8_E4M3 dequantized with its 128x128 weight_scale_inv, colibri
// container weights — U8 + `.qs` — and compressed-tensors INT4 weights dequantized) and loading of
// container and compressed-tensors INT4 weights as they are.
//
// compressed-tensors pack-quantized INT4 (W4A16, symmetric or asymmetric): a Linear's weight
// `<name>` (such as `...down_proj.weight`) is stored as
//   `<name>_packed`      I32 [rows, ceil(cols / 8)]: element i of a row sits in bits 4(i % 8) of
//                        word i / 8, stored as q + 8 (q in [-8, 7]); the tail of the last word is
//                        zero;
//   `<name>_scale`       BF16/F16/F32 [rows, groups], groups = ceil(cols / group_size) (one
//                        column: a scale per row);
//   `<name>_shape`       I64 or I32 [2] = [rows, cols];
//   `<name>_zero_point`  asymmetric only: I32 [ceil(rows / 8), groups], packed along the rows:
//                        zp + 8 (zp in [-8, 7]) of row r and group g in bits 4(r % 8) of word
//                        [r / 8, g];
// W[o, i] = (q - zp) * scale[o, g], g = i / group_size (zp = 0 when symmetric). Read
// little-endian, the words are the int4 container's bytes (element 2j in the low nibble of byte
// j): they are copied row by row, the scales widened to fp32; zero points become the container's
// fp32 offsets -zp * scale[o, g] (QuantMatrix::offsets), so that W = q * s + offset, exactly. A
// `<name>_g_idx` (activation order) is refused.
//
// NVIDIA ModelOpt NVFP4: a Linear's weight `<module>.weight` is stored as
//   `<module>.weight`          U8 [rows, cols / 2]: two E2M1 codes a byte, column 2j in the low
//                              nibble of byte j, 2j + 1 in the high one;
//   `<module>.weight_scale`    F8_E4M3 [rows, cols / 16]: one scale a block of 16 columns;
//   `<module>.weight_scale_2`  F32 scalar: the second-level (per-tensor) scale;
//   `<module>.input_scale`     F32 scalar: the activations' static scale of a W4A4 engine, read
//                              and checked (finite, positive) but not used: the weights are run
//                              with the engine's own activations;
// W[o, i] = e2m1(code) * e4m3(weight_scale[o, i / 16]) * weight_scale_2. Codes and block scales
// are kept as stored (Nvfp4Matrix). Every such weight is found and its shapes and dtypes checked
// at open; the scale bytes (a NaN refused) and the scalars are checked as the weight is loaded.
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

// An NVFP4 weight as stored (see above): codes [rows, cols / 2], E4M3 block scales
// [rows, cols / 16] and the fp32 second-level scale; kernels::Nvfp4Weights reads it.
struct Nvfp4Matrix {
  WeightVector<uint8_t> codes;
  WeightVector<uint8_t> scales;
  float global = 0.0f;
  bool empty() const { return codes.empty(); }
  // What it holds: the stored codes and block scales and the 4 bytes of the global scale.
  uint64_t bytes() const { return empty() ? 0 : codes.size() + scales.size() + sizeof(float); }
};

class Checkpoint {
 public:
  // Opens model.safetensors, or the shards listed in model.safetensors.index.json, or else
  // every *.safetensors file of the directory. Every shard is validated at open.
  // int4_group_size: config.json's compressed-tensors group size (0: a scale per row), checked
  // against every `<name>_scale`; without it the group size is told from the shapes (refused when
  // more than one of the container's fits). Every compressed-tensors weight is checked at open.
  explicit Checkpoint(const std::filesystem::path& model_dir,
                      std::optional<std::array<int, 2>> fp8_block = std::nullopt,
                      std::optional<int> int4_group_size = std::nullopt);

  const TensorView* find(const std::string& name) const;
  // True for a stored tensor and for a compressed-tensors INT4 weight (`<name>_packed`).
  bool contains(const std::string& name) const {
    return find(name) != nullptr || is_packed_int4(name);
  }
  std::vector<std::string> names() const;
  const std::filesystem::path& dir() const { return dir_; }

  // Returns the tensor as float32, checking its shape. F8_E4M3 tensors are multiplied by
  // `<name>_scale_inv` blocks. Errors name the tensor and its file.
  // A U8 tensor is a container weight (see load_quant) or an NVFP4 weight and is dequantized;
  // `shape` must be 2-D.
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

  // True when `name` is a quantized container weight (U8 with `.qs` scales; any U8 tensor that is
  // not an NVFP4 weight), or a compressed-tensors INT4 weight.
  bool is_quantized(const std::string& name) const;

  // The tensors of an NVFP4 weight, checked at open (input_scale: null when absent).
  struct Nvfp4Tensors {
    const TensorView *weight, *scale, *global, *input_scale;
    int64_t rows, cols;
    // Its stored bytes as held: codes, block scales, global (not input_scale, which is not held).
    uint64_t held_bytes() const { return weight->nbytes + scale->nbytes + sizeof(float); }
  };
  // True when `name` is an NVFP4 weight (U8 `<name>` with `<name>_scale` F8_E4M3 and
  // `<name>_scale_2`).
  bool is_nvfp4(const std::string& name) const { return nvfp4_.count(name) != 0; }
  const Nvfp4Tensors* nvfp4_tensors(const std::string& name) const;
  // The NVFP4 weight `name` expected as [rows, cols], as stored; with row_end >= 0 only rows
  // [row_begin, row_end) (their codes and scales). Refuses a NaN scale byte (naming the tensor and
  // the [row, block]), a second-level scale that is not finite and >= 0, and an input_scale that
  // is not finite and > 0.
  Nvfp4Matrix load_nvfp4(const std::string& name, int64_t rows, int64_t cols, int64_t row_begin = 0,
                         int64_t row_end = -1) const;
  // True when `name` is a compressed-tensors INT4 weight (`<name>_packed` and its companions).
  bool is_packed_int4(const std::string& name) const { return packed_int4_.count(name) != 0; }
  // True when the compressed-tensors INT4 weight `name` has zero points (`<name>_zero_point`).
  bool has_zero_points(const std::string& name) const {
    const auto it = packed_int4_.find(name);
    return it != packed_int4_.end() && it->second.zero_point != nullptr;
  }
  // The compressed-tensors INT4 weight `name`'s [rows, cols] and the container format it loads as.
  struct PackedInt4Shape {
    int64_t rows, cols;
    QuantSpec spec;
  };
  std::optional<PackedInt4Shape> packed_int4_shape(const std::string& name) const;
  // The tensor holding the scales of the quantized weight `name` (`<name>.qs` or `<name>_scale`).
  std::string quant_scale_name(const std::string& name) const;
  // Bytes the quantized weight `name` takes in memory once loaded (QuantMatrix::bytes()).
  uint64_t quant_bytes(const std::string& name, int64_t rows, int64_t cols) const;
  // Loads the container weight `name` (U8 packed bytes + `<name>.qs` F32 scales) expected as
  // [rows, cols], keeping it quantized; a compressed-tensors INT4 weight the same way, in the int4
  // container format of its group size, its zero points (if any) as the offsets. The format is
  // inferred from the byte and scale counts (the U8 shape is not used); an inconsistent or
  // ambiguous pair is refused with an error naming the file, the tensor and the sizes.
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
  // A compressed-tensors INT4 weight, checked at open.
  struct PackedInt4 {
    const TensorView* packed;
    const TensorView* scale;
    const TensorView* zero_point;  // null: symmetric
    int64_t rows, cols;
    int group_size;  // 0: a scale per row
  };
  std::unordered_map<std::string, PackedInt4> packed_int4_;
  std::unordered_map<std::string, Nvfp4Tensors> nvfp4_;
  // Finds and checks the NVFP4 weights (constructor).
  void index_nvfp4();
  // Finds and checks the compressed-tensors weights (constructor).
  void index_packed_int4(std::optional<int> int4_group_size);
  QuantMatrix load_packed_int4(const std::string& name, const PackedInt4& p, int64_t rows,
                               int64_t cols, int64_t row_begin, int64_t row_end) const;
  mutable std::atomic<uint64_t> bytes_loaded_{0};
};

std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace colibri
