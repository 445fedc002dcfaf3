// The server's prefix cache on disk (--serve --kv-cache-dir DIR): finished sequences' KV rows
// outlive the process, so that a server restarted on the same directory serves a prompt it saw
// before with its prefix loaded from disk instead of recomputed.
//
// Layout: DIR/<model>/<prefix key>.cnkv, one file per chunk of kChunkTokens positions. The folder
// is named by the XXH3-64 of this model's KV file header (kv_record.h: model hash, weights
// fingerprint, cache shape) and the chunk size, so models sharing DIR never meet each other's
// files. A file is that header and one record of the chunk's positions [k C, (k + 1) C); its name
// is the XXH3-64 (seeded with the folder's hash) of the token ids [0, (k + 1) C), so a prefix of
// n chunks is found as the files of its n keys. Loading compares each file's ids with the prompt's
// and checks its checksum.
//
// Writing: save() is called when a sequence ends; it encodes the chunks not yet on disk (up to its
// last whole chunk) on the calling thread (a copy of their rows) and hands the bytes to a writer
// thread, which writes each to a temporary file in the folder, fsyncs it, renames it over its name
// (a regular file or nothing: anything else there is left alone and the chunk dropped) and fsyncs
// the folder. A crash leaves a whole file or none; temporary files of a crashed process are
// removed when an hour old.
//
// Eviction: with a cap (max_bytes > 0), after every write the least recently used files go until
// the folder's files fit it. Loading or saving a prefix marks all its chunks used at once (their
// mtime, so the order outlives a restart) and ties go to the later chunk first, so a chunk is
// never evicted before the chunks after it.
//
// Refusal: a file of another model or shape, a damaged or truncated one is never used: it gets
// a line naming it and the reason (at start-up, or when a load finds it), and its positions are
// computed instead. It stays on disk until a save of the same chunk replaces it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "coordinator/kv_manager.h"
#include "model/config.h"
#include "moe/routing_stats.h"

namespace colibri {

struct KvCacheDirOptions {
  KvCacheDirOptions() = default;
  KvCacheDirOptions(std::filesystem::path dir_, uint64_t max_bytes_, const ModelIdentity& identity_)
      : dir(std::move(dir_)), max_bytes(max_bytes_), identity(identity_) {}
  std::filesystem::path dir;
  uint64_t max_bytes = 0;  // 0: no cap
  ModelIdentity identity;
};

struct KvCacheDirCounters {
  uint64_t loads = 0;          // load() calls that loaded positions
  uint64_t tokens_loaded = 0;  // positions loaded
  uint64_t files_written = 0, bytes_written = 0;
  uint64_t files_refused = 0;     // of another model or shape, truncated or damaged
  uint64_t files_evicted = 0;     // removed for the cap
  uint64_t writes_failed = 0;     // an I/O error, or something other than a file at the name
  uint64_t writes_dropped = 0;    // not queued: the writer was kMaxQueuedBytes behind
  uint64_t files = 0, bytes = 0;  // written files in the folder's index now
  double load_seconds = 0;        // spent in load(), the calling thread's time
};

class KvCacheDir {
 public:
  static constexpr int kChunkTokens = 32;
  static constexpr uint64_t kMaxQueuedBytes = uint64_t(2) << 30;

  // Creates DIR and the model's folder when missing and indexes the files there; each one that
  // cannot be used gets a line in `notes`. An Error when DIR or the folder is not a directory or
  // cannot be made.
  KvCacheDir(const KvCacheDirOptions& options, const ModelConfig& config,
             std::vector<std::string>& notes);
  // Finishes the write in progress; what is still queued is dropped (flush() first).
  ~KvCacheDir();
  KvCacheDir(const KvCacheDir&) = delete;
  KvCacheDir& operator=(const KvCacheDir&) = delete;

  // `seq` holds the positions [0, from) of `prompt`: loads positions [from, n) of the longest
  // prefix of `prompt` of at most `limit` positions whose chunks are on disk, reserving them in
  // `seq`. Returns the positions `seq` holds afterwards (`from` when nothing was loaded; short of
  // n when a file on the way is refused, with a line in `notes`).
  int load(KvManager& kv, int seq, std::span<const int> prompt, int from, int limit,
           std::vector<std::string>& notes);
  // `ids`: the tokens in `seq`'s KV. Queues the files of its chunks not yet on disk, up to the
  // last whole one.
  void save(const KvManager& kv, int seq, std::span<const int> ids);
  // Waits up to `timeout_s` for the queued writes; false if some are left. (The writer prints a
  // line for each write that fails.)
  bool flush(double timeout_s);

  KvCacheDirCounters counters() const;
  const std::filesystem::path& folder() const { return folder_; }

  // The file of chunk `chunk` of a sequence starting with `ids` (for tests).
  std::filesystem::path file_of(std::span<const int> ids, int chunk) const;

 private:
  struct Entry {
    int chunk = 0;
    uint64_t bytes = 0;
    int64_t used_ns = 0;   // last use, as the file's mtime
    bool written = false;  // false: queued
  };
  struct File {
    uint64_t key = 0;
    std::vector<uint8_t> bytes;
  };
  using Job = std::vector<File>;

  // Keys of the prefixes of `ids` ending at each chunk's end up to `limit`: [k] for chunk k.
  std::vector<uint64_t> prefix_keys(std::span<const int> ids, int limit) const;
  // Marks the entries used at `now_ns` (mutex_ held); touch_files sets their files' mtime.
  void touch(const std::vector<uint64_t>& chain_keys, int64_t now_ns);
  void touch_files(const std::vector<uint64_t>& chain_keys, int64_t now_ns) const;
  std::filesystem::path path_of(uint64_t key) const;
  void scan(std::vector<std::string>& notes);
  // Why the file `path` of chunk `chunk` cannot be used, after reading it into `bytes`; empty when
  // it can.
  std::string read_file(const std::filesystem::path& path, int chunk, std::span<const int> prompt,
                        std::vector<uint8_t>& bytes) const;
  void write_loop();
  void write(const Job& job);
  void forget(uint64_t key);  // drops a written entry from the index; mutex_ held
  void evict();               // mutex_ held

  const ModelConfig& config_;
  KvCacheDirOptions options_;
  std::vector<uint8_t> header_;
  uint64_t folder_hash_ = 0;  // of the header and the chunk size
  std::filesystem::path folder_;

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable queued_, idle_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::deque<Job> queue_;
  uint64_t queued_bytes_ = 0;
  bool writing_ = false, stop_ = false;
  KvCacheDirCounters counters_;
  uint64_t temp_serial_ = 0;
  std::thread writer_;
};

}  // namespace colibri
