// A conversation's KV cache on disk (--chat --kv-file FILE): after every turn the positions the
// turn added (their token ids and, per layer, MLA's compressed cache rows and the indexer keys)
// are appended, so that a chat reopened later continues with no prefill and the logits of one
// never interrupted.
//
// The file (little-endian, version 1): a header, "CNKVFILE", u32 version, u32 layers,
// u32 kv_lora_rank, u32 rope dim, u32 index dim, u32 indexer-layer mask bits (one u32 per 32
// layers, in a count-prefixed list), u64 model hash, u64 weights fingerprint, u64 XXH3-64 of the
// header's bytes; then records, "CNKVTURN", u32 tokens n, u32 first position, n token ids (i32),
// per layer n latent rows, n rope rows and (indexer layers) n index rows (f32), u64 XXH3-64 of the
// record's bytes. A record is written whole and fsync'ed before the next turn.
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
