#include "tokenizer/bpe.h"

#include <algorithm>
#include <functional>

#include "common/error.h"
#include "tokenizer/unicode.h"

namespace colibri::tok {

BpeModel::BpeModel(const std::vector<std::pair<std::string, int>>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   BpeOptions options, const std::string& where)
    : options_(options), cache_(new CacheShard[kCacheShards]) {
  byte_id_.fill(-1);
  std::unordered_map<std::string_view, int> string_to_id;
  string_to_id.reserve(vocab.size());
  std::string bytes;
  for (const auto& [token, id] : vocab) {
    string_to_id.emplace(token, id);
    // Entries with characters outside the byte alphabet (special tokens such as
    // "<｜User｜>") can never be spelled by a piece's bytes.
    if (!byte_level_to_bytes(token, bytes)) continue;
    if (bytes.size() == 1) byte_id_[uint8_t(bytes[0])] = id;
    bytes_to_id_.emplace(bytes, id);
  }
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const auto lookup = [&](const std::string& token) {
      const auto it = string_to_id.find(token);
      if (it == string_to_id.end())
        fail("{}.merges[{}]: token \"{}\" is not in {}.vocab", where, rank, token, where);
      return it->second;
    };
    const int left_id = lookup(left);
    const int right_id = lookup(right);
    const int merged_id = lookup(left + right);
    // A pair listed twice keeps its last rank, as in the tokenizers library.
    merges_.insert_or_assign(pair_key(left_id, right_id), Merge{uint32_t(rank), merged_id});
  }
}

void BpeModel::encode_piece(std::string_view bytes, std::vector<int>& out) const {
  if (bytes.empty()) return;
  if (options_.ignore_merges) {
    const auto it = bytes_to_id_.find(std::string(bytes));
    if (it != bytes_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (bytes.size() > kMaxCachedPieceBytes) {
    merge(bytes, out);
    return;
  }
  const std::string key(bytes);
  CacheShard& shard = cache_[std::hash<std::string>{}(key) % kCacheShards];
  {
    std::lock_guard lock(shard.mutex);
    const auto it = shard.entries.find(key);
    if (it != shard.entries.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge(bytes, out);
  std::lock_guard lock(shard.mutex);
  if (shard.entries.size() >= kCacheEntriesPerShard) shard.entries.clear();
  shard.entries.emplace(key, std::vector<int>(out.begin() + ptrdiff_t(first), out.end()));
}

void BpeModel::merge(std::string_view bytes, std::vector<int>& out) const {
  // Symbols form a doubly linked list over an array; a merged-away symbol has id -1. Candidate
  // merges sit in a min-heap on (rank, position): the lowest rank first, leftmost among equals.
  struct Symbol {
    int id;
    int prev;
    int next;
  };
  struct Candidate {
    uint32_t rank;
    int pos;
    int merged_id;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : pos > other.pos;
    }
  };
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap;
  symbols.clear();
  heap.clear();

  // Initial symbols: one per byte. Bytes without a token become unk (fused when asked) or are
  // dropped, which joins their neighbours, as in the tokenizers library.
  bool previous_unk = false;
  for (const char c : bytes) {
    const int id = byte_id_[uint8_t(c)];
    if (id >= 0) {
      symbols.push_back({id, 0, 0});
      previous_unk = false;
    } else if (options_.unk_id) {
      if (!(options_.fuse_unk && previous_unk)) symbols.push_back({*options_.unk_id, 0, 0});
      previous_unk = true;
    }
  }
  const int n = int(symbols.size());
  for (int i = 0; i < n; ++i) {
    symbols[size_t(i)].prev = i - 1;
    symbols[size_t(i)].next = i + 1 < n ? i + 1 : -1;
  }

  const auto push_candidate = [&](int pos) {
    const int next = symbols[size_t(pos)].next;
    if (next < 0) return;
    const auto it = merges_.find(pair_key(symbols[size_t(pos)].id, symbols[size_t(next)].id));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, pos, it->second.merged_id});
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  };
  for (int i = 0; i + 1 < n; ++i) push_candidate(i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[size_t(top.pos)];
    if (left.id < 0 || left.next < 0) continue;
    Symbol& right = symbols[size_t(left.next)];
    // Stale when either side has changed since the candidate was pushed.
    const auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.rank != top.rank) continue;
    left.id = top.merged_id;
    right.id = -1;
    left.next = right.next;
    if (right.next >= 0) symbols[size_t(right.next)].prev = top.pos;
    if (left.prev >= 0) push_candidate(left.prev);
    push_candidate(top.pos);
  }

  for (int i = n > 0 ? 0 : -1; i >= 0; i = symbols[size_t(i)].next)
    out.push_back(symbols[size_t(i)].id);
}

}  // namespace colibri::tok
