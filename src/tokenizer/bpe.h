// The BPE model of a byte-level tokenizer.json: vocabulary, ranked merges and the merge loop,
// working on raw bytes (vocabulary entries are mapped back from GPT-2's byte alphabet at load).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colibri::tok {

struct BpeOptions {
  bool ignore_merges = false;  // a piece that is a vocabulary entry is one token, unmerged
  std::optional<int> unk_id;   // id for bytes without a token; dropped when absent
  bool fuse_unk = false;       // consecutive unknown bytes become one unk
};

class BpeModel {
 public:
  // Pieces up to this many bytes have their result cached.
  static constexpr size_t kMaxCachedPieceBytes = 256;
  // Cached pieces per shard; a full shard is emptied and starts over.
  static constexpr size_t kCacheEntriesPerShard = 4096;

  // vocab: byte-level token string -> id. merges: pairs of byte-level token strings in rank
  // order. Entries are validated; errors name `where` (the JSON path of the model).
  BpeModel(const std::vector<std::pair<std::string, int>>& vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options,
           const std::string& where);

  // Appends the ids of one pre-tokenized piece of raw bytes.
  void encode_piece(std::string_view bytes, std::vector<int>& out) const;

 private:
  struct Merge {
    uint32_t rank;
    int merged_id;
  };
  static uint64_t pair_key(int left, int right) {
    return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
  }
  void merge(std::string_view bytes, std::vector<int>& out) const;

  BpeOptions options_;
  std::array<int, 256> byte_id_{};                    // one-byte token, -1 when absent
  std::unordered_map<std::string, int> bytes_to_id_;  // for ignore_merges
  std::unordered_map<uint64_t, Merge> merges_;        // (left id, right id) -> merge

  struct CacheShard {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int>> entries;
  };
  static constexpr size_t kCacheShards = 16;
  std::unique_ptr<CacheShard[]> cache_;
};

}  // namespace colibri::tok
