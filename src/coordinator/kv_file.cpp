#include "coordinator/kv_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"
#include "coordinator/kv_record.h"

namespace colibri {
namespace {

using kv_record::kHeaderMagic;
using kv_record::kRecordMagic;

// Reads exactly `n` bytes at `offset`; false at the end of the file before that.
bool read_at(int fd, uint64_t offset, void* out, size_t n, const std::filesystem::path& path) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("{}: cannot read: {}", path.string(), std::strerror(errno));
    if (got == 0) return false;
    p += got;
    n -= size_t(got);
    offset += uint64_t(got);
  }
  return true;
}

}  // namespace

KvFile::KvFile(std::filesystem::path path, const ModelConfig& config, const ModelIdentity& identity)
    : path_(std::move(path)), config_(config), identity_(identity) {
  struct stat st {};
  const bool exists = ::lstat(path_.c_str(), &st) == 0;
  if (exists && !S_ISREG(st.st_mode))
    fail("{}: the --kv-file is not a regular file; it is left alone", path_.string());
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0) fail("{}: cannot open the --kv-file: {}", path_.string(), std::strerror(errno));
  const std::vector<uint8_t> want = header();
  header_bytes_ = want.size();
  if (!exists || ::lseek(fd_, 0, SEEK_END) == 0) {
    reset();
    return;
  }
  std::vector<uint8_t> have(want.size());
  if (!read_at(fd_, 0, have.data(), have.size(), path_) ||
      std::memcmp(have.data(), kHeaderMagic, sizeof kHeaderMagic) != 0) {
    ::close(fd_);
    fail("{}: not a colibri-node KV file (its header is missing or damaged); it is left alone",
         path_.string());
  }
  if (have != want) {
    ::close(fd_);
    fail(
        "{}: a KV file of another model, shape or version (its header differs from this "
        "model's); it is left alone",
        path_.string());
  }
}

KvFile::~KvFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<uint8_t> KvFile::header() const {
  return kv_record::header(config_, identity_);
}

void KvFile::cut(uint64_t size) {
  if (::ftruncate(fd_, off_t(size)) != 0 || ::fsync(fd_) != 0)
    fail("{}: cannot cut the --kv-file back to {} bytes: {}", path_.string(), size,
         std::strerror(errno));
}

void KvFile::reset() {
  cut(0);
  const std::vector<uint8_t> h = header();
  if (::pwrite(fd_, h.data(), h.size(), 0) != ssize_t(h.size()) || ::fsync(fd_) != 0)
    fail("{}: cannot write the --kv-file's header: {}", path_.string(), std::strerror(errno));
  positions_ = 0;
}

std::vector<int> KvFile::restore(KvManager& kv, int seq, std::vector<std::string>& notes) {
  if (kv.length(seq) != 0) fail("KvFile::restore: sequence {} is not empty", seq);
  std::vector<int> ids;
  uint64_t offset = header_bytes_;
  std::vector<uint8_t> record;
  for (int turn = 1;; ++turn) {
    char magic[8];
    uint32_t counts[2];  // tokens, first position
    const bool complete_head = read_at(fd_, offset, magic, sizeof magic, path_) &&
                               read_at(fd_, offset + 8, counts, sizeof counts, path_);
    const uint64_t end = uint64_t(::lseek(fd_, 0, SEEK_END));
    if (!complete_head) {
      if (offset < end)
        notes.push_back(fmt::format("{}: turn {} is torn (the file ends inside it); dropped",
                                    path_.string(), turn));
      break;
    }
    const uint32_t n = counts[0];
    const uint64_t whole_bytes = kv_record::record_bytes(config_, n);  // with its checksum
    const bool fits = n > 0 && offset + whole_bytes <= end;
    record.resize(fits ? size_t(whole_bytes) : 0);
    const bool whole = fits && read_at(fd_, offset, record.data(), record.size(), path_);
    std::string why;
    if (std::memcmp(magic, kRecordMagic, sizeof magic) != 0)
      why = "has no record header (damaged)";
    else if (!whole)
      why = "is torn (the file ends inside it)";
    else if (!kv_record::checksum_matches(record))
      why = "fails its checksum (damaged)";
    else if (counts[1] != ids.size())
      why = fmt::format("starts at position {}, not {}", counts[1], ids.size());
    else if (ids.size() + n > size_t(config_.max_position_embeddings))
      why = "goes past the model's context";
    if (!why.empty()) {
      notes.push_back(fmt::format("{}: turn {} {}; it and what follows are dropped", path_.string(),
                                  turn, why));
      break;
    }
    const int first = int(ids.size());
    kv.reserve(seq, first + int(n));
    const uint8_t* p = record.data() + 8 + sizeof counts;
    for (uint32_t i = 0; i < n; ++i) {
      int32_t id = 0;
      std::memcpy(&id, p + i * sizeof id, sizeof id);
      if (id < 0 || id >= config_.vocab_size) {
        why = fmt::format("holds token id {}", id);
        break;
      }
      ids.push_back(id);
    }
    if (!why.empty()) {
      ids.resize(size_t(first));
      notes.push_back(fmt::format("{}: turn {} {}; it and what follows are dropped", path_.string(),
                                  turn, why));
      break;
    }
    p += size_t(n) * sizeof(int32_t);
    kv_record::copy_rows(kv, seq, config_, p, n, first);
    kv.set_length(seq, first + int(n));
    offset += whole_bytes;
  }
  if (offset < uint64_t(::lseek(fd_, 0, SEEK_END))) cut(offset);
  positions_ = int(ids.size());
  return ids;
}

void KvFile::append(const KvManager& kv, int seq, int first, std::span<const int> tokens) {
  if (first != positions_)
    fail("{}: a turn from position {} does not follow the file's {} positions", path_.string(),
         first, positions_);
  if (first + int(tokens.size()) > kv.length(seq))
    fail("{}: positions up to {} are not in the sequence ({})", path_.string(),
         first + int(tokens.size()), kv.length(seq));
  if (tokens.empty()) return;
  std::vector<uint8_t> r;
  kv_record::append_record(r, config_, kv, seq, first, tokens);
  const uint64_t at = uint64_t(::lseek(fd_, 0, SEEK_END));
  size_t done = 0;
  while (done < r.size()) {
    const ssize_t wrote = ::pwrite(fd_, r.data() + done, r.size() - done, off_t(at + done));
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) {
      const int error = errno;
      cut(at);  // no torn record is left behind when the write can be undone
      fail("{}: cannot append a turn to the --kv-file: {}", path_.string(), std::strerror(error));
    }
    done += size_t(wrote);
  }
  if (::fsync(fd_) != 0)
    fail("{}: cannot sync the --kv-file: {}", path_.string(), std::strerror(errno));
  positions_ = first + int(tokens.size());
}

}  // namespace colibri
