// A conversation's KV cache on disk (--chat --kv-file FILE): after every turn the positions the
// turn added (their token ids and, per layer, MLA's compressed cache rows and the indexer keys)
// are appended, so that a chat reopened later continues with no prefill and the logits of one
// never interrupted.
//
// The file (its header and records in coordinator/kv_record.h): a header naming the model and
// the cache's shape, then one record per turn, each written whole and fsync'ed before the next.
//
// Reading: a file of another model or shape, or a damaged header, is refused with a line naming
// the file and the reason. Records are read in order up to the first one that is torn (a crash
// while writing) or damaged (a checksum or a position that does not follow): that one and those
// after it are dropped with a line saying so, and the file is cut back to what was used.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "coordinator/kv_manager.h"
#include "model/config.h"
#include "moe/routing_stats.h"

namespace colibri {

class KvFile {
 public:
  // Opens `path` for this model, creating it (a header only) when it does not exist. A path that
  // is not a regular file is refused.
  KvFile(std::filesystem::path path, const ModelConfig& config, const ModelIdentity& identity);
  ~KvFile();
  KvFile(const KvFile&) = delete;
  KvFile& operator=(const KvFile&) = delete;

  // The conversation the file holds: writes its positions into `seq` (empty) of `kv` and returns
  // their token ids. `notes` gets a line for every record dropped.
  std::vector<int> restore(KvManager& kv, int seq, std::vector<std::string>& notes);
  // Appends positions [first, first + tokens.size()) of `seq`, whose ids are `tokens`.
  void append(const KvManager& kv, int seq, int first, std::span<const int> tokens);
  // Drops every record (a new conversation).
  void reset();

  const std::filesystem::path& path() const { return path_; }

 private:
  std::vector<uint8_t> header() const;
  void cut(uint64_t size);

  std::filesystem::path path_;
  const ModelConfig& config_;
  ModelIdentity identity_;
  int fd_ = -1;
  uint64_t header_bytes_ = 0;
  int positions_ = 0;  // positions in the file's records
};

}  // namespace colibri
