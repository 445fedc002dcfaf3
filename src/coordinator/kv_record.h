// The pieces of a KV file shared by --kv-file (kv_file.h) and --kv-cache-dir (kv_cache_dir.h):
// the header naming the model and the cache's shape, and the record of a run of positions with its
// checksum.
//
// Header (little-endian, version 1): "CNKVFILE", u32 version, u32 layers, u32 kv_lora_rank, u32
// rope dim, u32 index dim, u32 indexer-layer mask bits (one u32 per 32 layers, in a count-prefixed
// list), u64 model hash, u64 weights fingerprint, u64 XXH3-64 of the header's bytes.
// Record: "CNKVTURN", u32 tokens n, u32 first position, n token ids (i32), per layer n latent rows,
// n rope rows and (indexer layers) n index rows (f32), u64 XXH3-64 of the record's bytes before it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "coordinator/kv_manager.h"
#include "model/config.h"
#include "moe/routing_stats.h"

namespace colibri::kv_record {

inline constexpr char kHeaderMagic[8] = {'C', 'N', 'K', 'V', 'F', 'I', 'L', 'E'};
inline constexpr char kRecordMagic[8] = {'C', 'N', 'K', 'V', 'T', 'U', 'R', 'N'};
inline constexpr uint32_t kVersion = 1;
// A record's magic and counts (tokens, first position), before its ids.
inline constexpr size_t kRecordHeadBytes = 16;

// The header of this model's files.
std::vector<uint8_t> header(const ModelConfig& config, const ModelIdentity& identity);
// Why `have` (a file's first header().size() bytes) is not the header `want`, for a line naming
// the file: "not a colibri-node KV file", "its header is damaged", "a KV file of another model
// (model hash ...)", ...; empty when they are equal.
std::string header_mismatch(std::span<const uint8_t> have, std::span<const uint8_t> want);

// Bytes of one position's rows over every layer.
size_t position_bytes(const ModelConfig& config);
// Bytes of a whole record of `tokens` positions: head, ids, rows, checksum.
uint64_t record_bytes(const ModelConfig& config, uint64_t tokens);

// Appends the record of positions [first, first + tokens.size()) of `seq`, whose ids are `tokens`.
void append_record(std::vector<uint8_t>& out, const ModelConfig& config, const KvManager& kv,
                   int seq, int first, std::span<const int> tokens);
// Whether `record` (record_bytes() of them) ends in the checksum of the bytes before it.
bool checksum_matches(std::span<const uint8_t> record);
// The ids of a record's `tokens` positions, starting at `ids` (after its head).
std::vector<int> read_ids(const uint8_t* ids, uint32_t tokens);
// Copies a record's rows (`rows`: after its ids) into `seq` (reserved up to first + tokens) at
// positions [first + skip, first + tokens); the positions before first + skip are left alone.
void copy_rows(KvManager& kv, int seq, const ModelConfig& config, const uint8_t* rows,
               uint32_t tokens, int first, uint32_t skip = 0);

}  // namespace colibri::kv_record
