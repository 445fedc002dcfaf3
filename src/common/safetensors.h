// A memory-mapped safetensors file, validated completely at open: every tensor's dtype, shape
// and byte range is checked against the file before any data is touched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace colibri {

struct TensorView {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // points into the mapping
  size_t nbytes = 0;
  const std::filesystem::path* file = nullptr;

  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Headers above this size are refused: real checkpoints stay far below it.
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  explicit SafetensorsFile(std::filesystem::path path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t file_bytes() const { return file_bytes_; }
  // Copies a tensor of this file into dst with pread (one request per call, retried until done),
  // so the bytes land in owned memory without faulting the mapping in page by page.
  void read(const TensorView& view, void* dst) const;
  // Bytes [begin, begin + bytes) of a tensor of this file, likewise.
  void read(const TensorView& view, size_t begin, size_t bytes, void* dst) const;

 private:
  void parse_header(std::string_view header, const std::byte* buffer, uint64_t buffer_bytes);

  std::filesystem::path path_;
  int fd_ = -1;
  void* mapping_ = nullptr;
  uint64_t file_bytes_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace colibri
