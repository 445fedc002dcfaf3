#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/input_file.h"

namespace colibri {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

void release(void*& mapping, uint64_t mapped_bytes, int& fd) {
  if (mapping) ::munmap(mapping, mapped_bytes);
  if (fd >= 0) ::close(fd);
  mapping = nullptr;
  fd = -1;
}

}  // namespace

SafetensorsFile::SafetensorsFile(std::filesystem::path path) : path_(std::move(path)) {
  // A throwing constructor runs no destructor: the guard gives back descriptor and mapping.
  struct ReleaseOnThrow {
    SafetensorsFile& file;
    bool armed = true;
    ~ReleaseOnThrow() {
      if (armed) release(file.mapping_, file.file_bytes_, file.fd_);
    }
  } guard{*this};
  fd_ = open_regular_file(path_, "the safetensors file");
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail("{}: cannot stat: {}", path_.string(), std::strerror(errno));
  file_bytes_ = uint64_t(st.st_size);
  if (file_bytes_ < 8)
    fail("{}: truncated: {} bytes, shorter than the 8-byte header length", path_.string(),
         file_bytes_);
  mapping_ = ::mmap(nullptr, file_bytes_, PROT_READ, MAP_PRIVATE, fd_, 0);
  if (mapping_ == MAP_FAILED) {
    mapping_ = nullptr;
    fail("{}: mmap failed: {}", path_.string(), std::strerror(errno));
  }
  const auto* bytes = static_cast<const std::byte*>(mapping_);
  uint64_t header_bytes;
  std::memcpy(&header_bytes, bytes, 8);
  if (header_bytes > kMaxHeaderBytes)
    fail("{}: header length {} exceeds the {} byte limit", path_.string(), header_bytes,
         kMaxHeaderBytes);
  if (header_bytes > file_bytes_ - 8)
    fail("{}: header length {} runs past the end of the {} byte file (truncated?)", path_.string(),
         header_bytes, file_bytes_);
  const std::string_view header(reinterpret_cast<const char*>(bytes + 8), header_bytes);
  parse_header(header, bytes + 8 + header_bytes, file_bytes_ - 8 - header_bytes);
  guard.armed = false;
}

SafetensorsFile::~SafetensorsFile() {
  release(mapping_, file_bytes_, fd_);
}

void SafetensorsFile::read(const TensorView& view, void* dst) const {
  read(view, 0, view.nbytes, dst);
}

void SafetensorsFile::read(const TensorView& view, size_t begin, size_t bytes, void* dst) const {
  if (begin > view.nbytes || bytes > view.nbytes - begin)
    fail("{}: tensor '{}': bytes {}..{} are outside its {} bytes", path_.string(), view.name, begin,
         begin + bytes, view.nbytes);
  const auto* base = static_cast<const std::byte*>(mapping_);
  auto offset = off_t(view.data - base) + off_t(begin);
  auto* out = static_cast<char*>(dst);
  size_t left = bytes;
  while (left > 0) {
    const ssize_t got = ::pread(fd_, out, left, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      fail("{}: tensor '{}': read failed at offset {}: {}", path_.string(), view.name, offset,
           got == 0 ? "unexpected end of file" : std::strerror(errno));
    out += got;
    offset += got;
    left -= size_t(got);
  }
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void SafetensorsFile::parse_header(std::string_view header, const std::byte* buffer,
                                   uint64_t buffer_bytes) {
  const std::string file = path_.string();
  if (header.empty() || header.front() != '{') fail("{}: header does not start with '{{'", file);
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: header is not valid JSON: {}", file, e.what());
  }
  if (!root.is_object()) fail("{}: header is not a JSON object", file);

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("{}: __metadata__ is not an object", file);
      for (auto& [key, value] : entry.items())
        if (value.is_string()) metadata_[key] = value.get<std::string>();
      continue;
    }
    if (!entry.is_object()) fail("{}: tensor '{}': entry is not an object", file, name);
    const auto dtype_it = entry.find("dtype");
    const auto shape_it = entry.find("shape");
    const auto offsets_it = entry.find("data_offsets");
    if (dtype_it == entry.end() || !dtype_it->is_string())
      fail("{}: tensor '{}': missing or non-string 'dtype'", file, name);
    if (shape_it == entry.end() || !shape_it->is_array())
      fail("{}: tensor '{}': missing or non-array 'shape'", file, name);
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2)
      fail("{}: tensor '{}': 'data_offsets' must be [begin, end]", file, name);

    TensorView view;
    view.name = name;
    view.file = &path_;
    const std::string dtype_string = dtype_it->get<std::string>();
    const auto dtype = parse_dtype(dtype_string);
    if (!dtype) fail("{}: tensor '{}': unknown dtype '{}'", file, name, dtype_string);
    view.dtype = *dtype;

    uint64_t numel = 1;
    for (const auto& dim : *shape_it) {
      if (!dim.is_number_unsigned())
        fail("{}: tensor '{}': shape entries must be non-negative integers", file, name);
      const uint64_t d = dim.get<uint64_t>();
      if (d > (1ull << 40) || (d != 0 && numel > (1ull << 48) / d))
        fail("{}: tensor '{}': shape is implausibly large", file, name);
      numel *= d;
      view.shape.push_back(int64_t(d));
    }
    for (const auto& offset : *offsets_it)
      if (!offset.is_number_unsigned())
        fail("{}: tensor '{}': data_offsets must be non-negative integers", file, name);
    const uint64_t begin = (*offsets_it)[0].get<uint64_t>();
    const uint64_t end = (*offsets_it)[1].get<uint64_t>();
    if (begin > end)
      fail("{}: tensor '{}': data_offsets begin {} > end {}", file, name, begin, end);
    if (end > buffer_bytes)
      fail("{}: tensor '{}': data_offsets end {} beyond the {} byte data section (truncated?)",
           file, name, end, buffer_bytes);
    const uint64_t expected = numel * dtype_size(view.dtype);
    if (end - begin != expected)
      fail("{}: tensor '{}': {} bytes in data_offsets but dtype {} and shape need {}", file, name,
           end - begin, dtype_string, expected);
    view.data = buffer + begin;
    view.nbytes = end - begin;
    auto [it, inserted] = tensors_.emplace(name, std::move(view));
    ranges.push_back({begin, end, &it->first});
  }

  // By (begin, end): an empty tensor at another's begin sorts first and overlaps nothing.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].begin < ranges[i - 1].end)
      fail("{}: tensors '{}' and '{}' overlap in the data section", file, *ranges[i - 1].name,
           *ranges[i].name);
}

}  // namespace colibri
