// KV memory of every sequence, in blocks of a fixed pool: MLA's compressed cache (normalised
// latent and rotated rope key per token) and, on full DSA indexer layers, the indexer key. The
// pool is allocated once at start-up from a token budget (--kv-tokens); sequences get blocks as
// they grow and give them back when they end. Nothing is allocated per token.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/huge_pages.h"
#include "model/config.h"

namespace colibri {

class KvManager {
 public:
  static constexpr int kDefaultBlockTokens = 16;

  // A pool of at least `kv_tokens` token slots (rounded up to whole blocks) for at most
  // `max_seqs` sequences at once.
  KvManager(const ModelConfig& config, int kv_tokens, int max_seqs,
            int block_tokens = kDefaultBlockTokens);
  // Blocks of the pool for `kv_tokens`.
  static int pool_blocks(int kv_tokens, int block_tokens = kDefaultBlockTokens) {
    return (kv_tokens + block_tokens - 1) / block_tokens;
  }
  // Bytes of the pool for `kv_tokens`; `indexer` false: the MLA cache alone (a rank's copy for
  // split heads).
  static uint64_t pool_bytes(const ModelConfig& config, int kv_tokens,
                             int block_tokens = kDefaultBlockTokens, bool indexer = true);

  // A free sequence slot, empty; an Error when all max_seqs slots are in use.
  int open();
  // Frees the slot and its blocks.
  void close(int seq);
  // Drops the sequence's tokens but keeps its slot.
  void clear(int seq);
  bool is_open(int seq) const;

  // Grows `seq` to hold `tokens` positions, taking blocks from the pool. Refuses (Error with the
  // numbers) a length beyond the model's context or a pool that cannot fit it; on refusal nothing
  // changes.
  void reserve(int seq, int tokens);
  // Sets how many positions `seq` holds (after a forward wrote them); at most what is reserved.
  void set_length(int seq, int tokens);
  int length(int seq) const;
  // Blocks `seq` holds (reserved, possibly beyond its length).
  int blocks(int seq) const { return int(seqs_[size_t(seq)].blocks.size()); }

  // The blocks `seq` holds, in position order.
  std::span<const int> block_list(int seq) const { return seqs_[size_t(seq)].blocks; }

  // Pool slot of position `pos` of `seq` (reserved).
  int slot(int seq, int pos) const {
    const Sequence& s = seqs_[size_t(seq)];
    return s.blocks[size_t(pos / block_tokens_)] * block_tokens_ + pos % block_tokens_;
  }

  // Per-layer storage indexed by slot: latent [slots, kv_lora_rank], k_rope [slots, rope dim],
  // index_k [slots, index_head_dim] (full indexer layers only, else null).
  float* latent(int layer) { return layers_[size_t(layer)].latent.get(); }
  float* k_rope(int layer) { return layers_[size_t(layer)].k_rope.get(); }
  float* index_k(int layer) { return layers_[size_t(layer)].index_k.get(); }
  const float* latent(int layer) const { return layers_[size_t(layer)].latent.get(); }
  const float* k_rope(int layer) const { return layers_[size_t(layer)].k_rope.get(); }
  const float* index_k(int layer) const { return layers_[size_t(layer)].index_k.get(); }

  int block_tokens() const { return block_tokens_; }
  int total_blocks() const { return int(block_owner_.size()); }
  int free_blocks() const { return int(free_.size()); }
  int capacity_tokens() const { return total_blocks() * block_tokens_; }
  int max_seqs() const { return int(seqs_.size()); }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Sequence {
    bool open = false;
    int length = 0;
    std::vector<int> blocks;
  };
  struct LayerStore {
    HugePageArray<float> latent, k_rope, index_k;
  };

  const ModelConfig& config_;
  int block_tokens_;
  std::vector<LayerStore> layers_;
  std::vector<Sequence> seqs_;
  std::vector<int> free_;         // free block ids, popped from the back
  std::vector<int> block_owner_;  // [blocks] sequence slot or -1
  uint64_t bytes_ = 0;
};

}  // namespace colibri
