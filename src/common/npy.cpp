#include "common/npy.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "common/output_file.h"

namespace colibri {
namespace {

// Limits on what a header may claim; the parity goldens are far below them.
constexpr size_t kMaxHeaderBytes = 1 << 20;
constexpr int64_t kMaxElements = int64_t(1) << 40;

}  // namespace

void write_npy_f32(const std::filesystem::path& path, std::span<const float> data,
                   std::span<const int64_t> shape) {
  std::string dims;
  for (int64_t d : shape) dims += fmt::format("{}, ", d);
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header =
      fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}), }}", dims);
  // Magic (6) + version (2) + header length (2) + header + '\n', padded to 64 bytes.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');

  const uint16_t header_len = uint16_t(header.size());
  write_file_atomically(path, [&](std::FILE* out) {
    std::fwrite("\x93NUMPY\x01\x00", 1, 8, out);
    std::fwrite(&header_len, 1, 2, out);
    std::fwrite(header.data(), 1, header.size(), out);
    std::fwrite(data.data(), 1, data.size_bytes(), out);
  });
}

NpyArray read_npy_f32(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path.string());
  char prefix[10];
  if (!in.read(prefix, 10) || std::memcmp(prefix, "\x93NUMPY", 6) != 0)
    fail("{}: not a .npy file", path.string());
  size_t header_len;
  if (prefix[6] == 1) {
    header_len = uint8_t(prefix[8]) | (size_t(uint8_t(prefix[9])) << 8);
  } else {
    char more[2];
    if (!in.read(more, 2)) fail("{}: truncated header", path.string());
    header_len = uint8_t(prefix[8]) | (size_t(uint8_t(prefix[9])) << 8) |
                 (size_t(uint8_t(more[0])) << 16) | (size_t(uint8_t(more[1])) << 24);
  }
  if (header_len > kMaxHeaderBytes)
    fail("{}: header length {} exceeds the {} byte limit", path.string(), header_len,
         kMaxHeaderBytes);
  std::string header(header_len, '\0');
  if (!in.read(header.data(), std::streamsize(header_len)))
    fail("{}: truncated header", path.string());
  if (header.find("'descr': '<f4'") == std::string::npos ||
      header.find("'fortran_order': False") == std::string::npos)
    fail("{}: only little-endian float32 C-order arrays are supported", path.string());
  const size_t shape_at = header.find("'shape': (");
  const size_t shape_end = shape_at == std::string::npos ? shape_at : header.find(')', shape_at);
  if (shape_end == std::string::npos) fail("{}: header has no shape", path.string());
  NpyArray array;
  int64_t numel = 1;
  std::istringstream dims(header.substr(shape_at + 10, shape_end - shape_at - 10));
  for (std::string dim; std::getline(dims, dim, ',');) {
    const size_t first = dim.find_first_not_of(' ');
    if (first == std::string::npos) continue;  // trailing comma of 1-D shapes
    const size_t last = dim.find_last_not_of(' ');
    int64_t d = -1;
    const char* end = dim.data() + last + 1;
    const auto [ptr, ec] = std::from_chars(dim.data() + first, end, d);
    if (ec != std::errc() || ptr != end || d < 0)
      fail("{}: shape entry {:?} is not a non-negative integer", path.string(), dim);
    if (d != 0 && numel > kMaxElements / d)
      fail("{}: shape has more than {} elements", path.string(), kMaxElements);
    array.shape.push_back(d);
    numel *= d;
  }
  // The data must be in the file before it is allocated: a header cannot claim gigabytes.
  const std::streamoff data_at = in.tellg();
  in.seekg(0, std::ios::end);
  const std::streamoff file_end = in.tellg();
  in.seekg(data_at);
  if (data_at < 0 || file_end < data_at || !in)
    fail("{}: cannot determine the size of the data", path.string());
  if (numel * 4 > file_end - data_at)
    fail("{}: truncated data: shape needs {} bytes, the file has {} after the header",
         path.string(), numel * 4, file_end - data_at);
  array.data.resize(size_t(numel));
  if (!in.read(reinterpret_cast<char*>(array.data.data()), std::streamsize(numel * 4)))
    fail("{}: truncated data", path.string());
  return array;
}

}  // namespace colibri
