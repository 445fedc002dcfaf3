// NumPy .npy files (format 1.0, little-endian float32, C order): written for --logits-out,
// read by the parity tests.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace colibri {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

void write_npy_f32(const std::filesystem::path& path, std::span<const float> data,
                   std::span<const int64_t> shape);
NpyArray read_npy_f32(const std::filesystem::path& path);

}  // namespace colibri
