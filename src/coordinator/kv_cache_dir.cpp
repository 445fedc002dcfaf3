#include "coordinator/kv_cache_dir.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "common/error.h"
#include "coordinator/kv_record.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
constexpr int kC = KvCacheDir::kChunkTokens;
constexpr const char* kSuffix = ".cnkv";
constexpr const char* kTempPrefix = ".tmp-";
constexpr int64_t kStaleTempNs = int64_t(3600) * 1000000000;
// Files are opened for reading without blocking: a FIFO put at a file's name after it was listed
// must not stall the engine thread (fstat then refuses it).

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t mtime_ns(const struct stat& st) {
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

timespec to_timespec(int64_t ns) {
  timespec t{};
  t.tv_sec = time_t(ns / 1000000000);
  t.tv_nsec = long(ns % 1000000000);
  return t;
}

// Reads up to `n` bytes at `offset`; the bytes read (short at the end of the file), -1 on error.
ssize_t read_at(int fd, uint64_t offset, uint8_t* out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, n - done, off_t(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return -1;
    if (got == 0) break;
    done += size_t(got);
  }
  return ssize_t(done);
}

bool is_key_name(const std::string& name) {
  if (name.size() != 16 + std::strlen(kSuffix) || !name.ends_with(kSuffix)) return false;
  return std::all_of(name.begin(), name.begin() + 16,
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

struct RecordHead {
  bool magic = false;
  uint32_t tokens = 0, first = 0;
};

RecordHead record_head(const uint8_t* p) {
  RecordHead h;
  h.magic = std::memcmp(p, kv_record::kRecordMagic, sizeof kv_record::kRecordMagic) == 0;
  std::memcpy(&h.tokens, p + 8, 4);
  std::memcpy(&h.first, p + 12, 4);
  return h;
}

void fsync_folder(const fs::path& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

KvCacheDir::KvCacheDir(const KvCacheDirOptions& options, const ModelConfig& config,
                       std::vector<std::string>& notes)
    : config_(config), options_(options) {
  static_assert(sizeof(int) == sizeof(int32_t));
  header_ = kv_record::header(config_, options_.identity);
  folder_hash_ = XXH3_64bits_withSeed(header_.data(), header_.size(), uint64_t(kC));
  folder_ = options_.dir / fmt::format("{:016x}", folder_hash_);
  for (const fs::path& d : {options_.dir, folder_}) {
    std::error_code ec;
    fs::create_directories(d, ec);
    if (!fs::is_directory(d))
      fail("{}: --kv-cache-dir: not a directory and cannot be made one{}", d.string(),
           ec ? ": " + ec.message() : "");
  }
  if (::access(folder_.c_str(), R_OK | W_OK | X_OK) != 0)
    fail("{}: --kv-cache-dir: cannot write there: {}", folder_.string(), std::strerror(errno));
  scan(notes);
  writer_ = std::thread([this] { write_loop(); });
}

KvCacheDir::~KvCacheDir() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
    counters_.writes_dropped += queue_.size();
    for (const Job& job : queue_)
      for (const File& f : job) entries_.erase(f.key);
    queue_.clear();
    queued_bytes_ = 0;
  }
  queued_.notify_all();
  writer_.join();
}

fs::path KvCacheDir::path_of(uint64_t key) const {
  return folder_ / fmt::format("{:016x}{}", key, kSuffix);
}

std::vector<uint64_t> KvCacheDir::prefix_keys(std::span<const int> ids, int limit) const {
  std::vector<uint64_t> keys;
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset_withSeed(&state, folder_hash_);
  for (int end = kC; end <= limit && end <= int(ids.size()); end += kC) {
    XXH3_64bits_update(&state, ids.data() + (end - kC), size_t(kC) * sizeof(int32_t));
    keys.push_back(XXH3_64bits_digest(&state));
  }
  return keys;
}

fs::path KvCacheDir::file_of(std::span<const int> ids, int chunk) const {
  const std::vector<uint64_t> keys = prefix_keys(ids, (chunk + 1) * kC);
  if (int(keys.size()) != chunk + 1)
    fail("KvCacheDir::file_of: the ids do not hold chunk {} whole", chunk);
  return path_of(keys.back());
}

void KvCacheDir::forget(uint64_t key) {
  const auto it = entries_.find(key);
  if (it == entries_.end()) return;
  if (it->second.written) {
    counters_.bytes -= it->second.bytes;
    --counters_.files;
  }
  entries_.erase(it);
}

void KvCacheDir::touch(const std::vector<uint64_t>& chain_keys, int64_t now_ns) {
  for (uint64_t k : chain_keys)
    if (auto it = entries_.find(k); it != entries_.end()) it->second.used_ns = now_ns;
}

void KvCacheDir::touch_files(const std::vector<uint64_t>& chain_keys, int64_t now_ns) const {
  const timespec times[2] = {to_timespec(now_ns), to_timespec(now_ns)};
  for (uint64_t k : chain_keys) ::utimensat(AT_FDCWD, path_of(k).c_str(), times, 0);
}

void KvCacheDir::scan(std::vector<std::string>& notes) {
  std::error_code ec;
  const int64_t now = wall_ns();
  const size_t head_bytes = header_.size() + kv_record::kRecordHeadBytes;
  std::vector<uint8_t> head(head_bytes);
  for (const fs::directory_entry& de : fs::directory_iterator(folder_, ec)) {
    const fs::path path = de.path();
    const std::string name = path.filename().string();
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) continue;
    if (name.starts_with(kTempPrefix)) {
      // A crashed writer's: an hour old, no write of a live one can be on it.
      if (S_ISREG(st.st_mode) && now - mtime_ns(st) > kStaleTempNs) ::unlink(path.c_str());
      continue;
    }
    if (!is_key_name(name)) continue;  // not a cache file: left alone
    const auto refuse = [&](const std::string& why) {
      notes.push_back(fmt::format("{}: {}; not used", path.string(), why));
      ++counters_.files_refused;
    };
    if (!S_ISREG(st.st_mode)) {
      refuse("not a regular file (left alone)");
      continue;
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
      refuse(fmt::format("cannot be opened: {}", std::strerror(errno)));
      continue;
    }
    const ssize_t got = read_at(fd, 0, head.data(), head.size());
    ::close(fd);
    if (got < 0) {
      refuse("cannot be read");
      continue;
    }
    const std::string mismatch = kv_record::header_mismatch(
        std::span(head.data(), std::min(size_t(got), header_.size())), header_);
    if (!mismatch.empty()) {
      refuse(mismatch);
      continue;
    }
    if (size_t(got) < head_bytes) {
      refuse(fmt::format("truncated ({} bytes, no whole record)", st.st_size));
      continue;
    }
    const RecordHead r = record_head(head.data() + header_.size());
    const uint64_t end = uint64_t(r.first) + r.tokens;
    if (!r.magic) {
      refuse("has no record header (damaged)");
      continue;
    }
    if (r.tokens != uint32_t(kC) || r.first % kC != 0 ||
        end > uint64_t(config_.max_position_embeddings)) {
      refuse(fmt::format("holds positions [{}, {}), not a chunk of {} in the context (damaged)",
                         r.first, end, kC));
      continue;
    }
    const uint64_t want = header_.size() + kv_record::record_bytes(config_, r.tokens);
    if (uint64_t(st.st_size) != want) {
      refuse(fmt::format("{} ({} bytes where its record of {} positions needs {})",
                         uint64_t(st.st_size) < want ? "truncated" : "longer than its record",
                         st.st_size, r.tokens, want));
      continue;
    }
    const uint64_t key = std::stoull(name.substr(0, 16), nullptr, 16);
    Entry e;
    e.chunk = int(r.first) / kC;
    e.bytes = want;
    e.used_ns = mtime_ns(st);
    e.written = true;
    entries_[key] = e;
    ++counters_.files;
    counters_.bytes += want;
  }
  if (ec) fail("{}: --kv-cache-dir: cannot list: {}", folder_.string(), ec.message());
  evict();
}

std::string KvCacheDir::read_file(const fs::path& path, int chunk, std::span<const int> prompt,
                                  std::vector<uint8_t>& bytes) const {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0)
    return errno == ENOENT ? std::string("gone since start-up")
                           : fmt::format("cannot be opened: {}", std::strerror(errno));
  struct stat st {};
  const uint32_t n = uint32_t(kC);
  const int first = chunk * kC;
  const uint64_t want = header_.size() + kv_record::record_bytes(config_, n);
  std::string why;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    why = "not a regular file";
  } else if (uint64_t(st.st_size) != want) {
    why = fmt::format("{} ({} bytes where its record of {} positions needs {})",
                      uint64_t(st.st_size) < want ? "truncated" : "longer than its record",
                      st.st_size, n, want);
  } else {
    bytes.resize(size_t(want));
    const ssize_t got = read_at(fd, 0, bytes.data(), bytes.size());
    if (got < 0) why = fmt::format("cannot be read: {}", std::strerror(errno));
    if (got >= 0 && uint64_t(got) != want) why = fmt::format("truncated ({} bytes)", got);
  }
  ::close(fd);
  if (!why.empty()) return why;
  why = kv_record::header_mismatch(std::span(bytes.data(), header_.size()), header_);
  if (!why.empty()) return why;
  const std::span<const uint8_t> record(bytes.data() + header_.size(),
                                        bytes.size() - header_.size());
  const RecordHead r = record_head(record.data());
  if (!r.magic) return "has no record header (damaged)";
  if (r.tokens != n || int(r.first) != first)
    return fmt::format("holds positions [{}, {}), not [{}, {}) (damaged)", r.first,
                       uint64_t(r.first) + r.tokens, first, first + kC);
  if (!kv_record::checksum_matches(record)) return "fails its checksum (damaged)";
  const std::vector<int> ids = kv_record::read_ids(record.data() + kv_record::kRecordHeadBytes, n);
  if (!std::equal(ids.begin(), ids.end(), prompt.begin() + first))
    return "holds other token ids than the prompt's (a key collision)";
  return {};
}

int KvCacheDir::load(KvManager& kv, int seq, std::span<const int> prompt, int from, int limit,
                     std::vector<std::string>& notes) {
  const auto start = std::chrono::steady_clock::now();
  limit = std::min(limit, int(prompt.size()));
  if (limit / kC * kC <= from) return from;
  std::vector<uint64_t> keys = prefix_keys(prompt, limit);
  const int64_t now = wall_ns();
  {
    std::lock_guard lock(mutex_);
    size_t n = 0;  // chunks on disk from the first on
    while (n < keys.size()) {
      const auto it = entries_.find(keys[n]);
      if (it == entries_.end() || !it->second.written) break;
      ++n;
    }
    keys.resize(n);
    if (int(n) * kC <= from) return from;
    touch(keys, now);
  }
  kv.reserve(seq, int(keys.size()) * kC);
  int held = from;
  std::vector<uint8_t> bytes;
  for (int k = 0; k < int(keys.size()); ++k) {
    const int first = k * kC;
    if (first + kC <= from) continue;
    const fs::path path = path_of(keys[size_t(k)]);
    const std::string why = read_file(path, k, prompt, bytes);
    if (!why.empty()) {
      notes.push_back(
          fmt::format("{}: {}; not used (its positions are computed)", path.string(), why));
      std::lock_guard lock(mutex_);
      forget(keys[size_t(k)]);
      ++counters_.files_refused;
      break;
    }
    const uint8_t* ids = bytes.data() + header_.size() + kv_record::kRecordHeadBytes;
    kv_record::copy_rows(kv, seq, config_, ids + size_t(kC) * sizeof(int32_t), uint32_t(kC), first,
                         uint32_t(std::max(0, from - first)));
    held = first + kC;
  }
  kv.set_length(seq, held);
  keys.resize(size_t(held / kC));
  touch_files(keys, now);
  std::lock_guard lock(mutex_);
  if (held > from) {
    ++counters_.loads;
    counters_.tokens_loaded += uint64_t(held - from);
  }
  counters_.load_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return held;
}

void KvCacheDir::save(const KvManager& kv, int seq, std::span<const int> ids) {
  const std::vector<uint64_t> keys = prefix_keys(ids, int(ids.size()));
  if (keys.empty()) return;
  const int64_t now = wall_ns();
  std::vector<int> missing;  // chunks
  {
    std::lock_guard lock(mutex_);
    for (size_t k = 0; k < keys.size(); ++k)
      if (!entries_.count(keys[k])) missing.push_back(int(k));
    touch(keys, now);
    const uint64_t bytes = missing.size() * (header_.size() + kv_record::record_bytes(config_, kC));
    if (!missing.empty() && queued_bytes_ + bytes > kMaxQueuedBytes) {
      ++counters_.writes_dropped;
      missing.clear();
    }
  }
  touch_files(keys, now);
  if (missing.empty()) return;
  Job job;
  uint64_t bytes = 0;
  for (int k : missing) {
    File f;
    f.key = keys[size_t(k)];
    f.bytes = header_;
    kv_record::append_record(f.bytes, config_, kv, seq, k * kC,
                             ids.subspan(size_t(k) * kC, size_t(kC)));
    bytes += f.bytes.size();
    job.push_back(std::move(f));
  }
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < job.size(); ++i) {
      Entry& e = entries_[job[i].key];
      e.chunk = missing[i];
      e.bytes = job[i].bytes.size();
      e.used_ns = now;
      e.written = false;
    }
    queued_bytes_ += bytes;
    queue_.push_back(std::move(job));
  }
  queued_.notify_all();
}

bool KvCacheDir::flush(double timeout_s) {
  std::unique_lock lock(mutex_);
  return idle_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                        [&] { return queue_.empty() && !writing_; });
}

KvCacheDirCounters KvCacheDir::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

void KvCacheDir::write_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock lock(mutex_);
      queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped
      job = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;
    }
    write(job);
    {
      std::lock_guard lock(mutex_);
      writing_ = false;
      uint64_t bytes = 0;
      for (const File& f : job) bytes += f.bytes.size();
      queued_bytes_ -= std::min(queued_bytes_, bytes);
    }
    idle_.notify_all();
  }
}

void KvCacheDir::write(const Job& job) {
  // Every file to a temporary name and synced, then each renamed, then the folder synced once.
  std::vector<fs::path> temps(job.size());
  std::vector<std::string> why(job.size());
  for (size_t i = 0; i < job.size(); ++i) {
    const File& f = job[i];
    int64_t used_ns = 0;
    {
      std::lock_guard lock(mutex_);
      const auto it = entries_.find(f.key);
      if (it == entries_.end()) {
        why[i] = "dropped";
        continue;
      }
      used_ns = it->second.used_ns;
    }
    temps[i] = folder_ / fmt::format("{}{}-{}", kTempPrefix, ::getpid(), ++temp_serial_);
    const int fd =
        ::open(temps[i].c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
      why[i] = fmt::format("cannot create {}: {}", temps[i].string(), std::strerror(errno));
      temps[i].clear();
      continue;
    }
    size_t done = 0;
    while (done < f.bytes.size() && why[i].empty()) {
      const ssize_t wrote = ::write(fd, f.bytes.data() + done, f.bytes.size() - done);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0)
        why[i] = fmt::format("cannot write: {}", std::strerror(errno));
      else
        done += size_t(wrote);
    }
    // Its mtime is its last use, as the prefix's other chunks have: the eviction order holds
    // across a restart.
    const timespec times[2] = {to_timespec(used_ns), to_timespec(used_ns)};
    if (why[i].empty() && ::futimens(fd, times) != 0)
      why[i] = fmt::format("cannot set its time: {}", std::strerror(errno));
    if (why[i].empty() && ::fsync(fd) != 0)
      why[i] = fmt::format("cannot sync: {}", std::strerror(errno));
    if (::close(fd) != 0 && why[i].empty())
      why[i] = fmt::format("cannot close: {}", std::strerror(errno));
  }
  for (size_t i = 0; i < job.size(); ++i) {
    if (temps[i].empty()) continue;
    const fs::path target = path_of(job[i].key);
    struct stat st {};
    if (why[i].empty() && ::lstat(target.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      why[i] = "something other than a regular file is there (left alone)";
    if (why[i].empty() && ::rename(temps[i].c_str(), target.c_str()) != 0)
      why[i] = fmt::format("cannot rename {} to it: {}", temps[i].string(), std::strerror(errno));
    if (!why[i].empty()) ::unlink(temps[i].c_str());
  }
  fsync_folder(folder_);
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < job.size(); ++i) {
    const auto it = entries_.find(job[i].key);
    if (why[i] == "dropped") continue;
    if (!why[i].empty()) {
      std::fprintf(stderr, "colibri-node: --kv-cache-dir: %s: %s; the chunk is not kept on disk\n",
                   path_of(job[i].key).c_str(), why[i].c_str());
      ++counters_.writes_failed;
      if (it != entries_.end() && !it->second.written) entries_.erase(it);
      continue;
    }
    ++counters_.files_written;
    counters_.bytes_written += job[i].bytes.size();
    if (it != entries_.end() && !it->second.written) {
      it->second.written = true;
      ++counters_.files;
      counters_.bytes += it->second.bytes;
    }
  }
  evict();
}

void KvCacheDir::evict() {
  if (options_.max_bytes == 0) return;
  while (counters_.bytes > options_.max_bytes) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (!it->second.written) continue;
      if (victim == entries_.end() || it->second.used_ns < victim->second.used_ns ||
          (it->second.used_ns == victim->second.used_ns && it->second.chunk > victim->second.chunk))
        victim = it;
    }
    if (victim == entries_.end()) return;
    const fs::path path = path_of(victim->first);
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(path.c_str());
    ++counters_.files_evicted;
    forget(victim->first);
  }
}

}  // namespace colibri
