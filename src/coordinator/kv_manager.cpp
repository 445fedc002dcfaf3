#include "coordinator/kv_manager.h"

#include "common/error.h"

namespace colibri {

KvManager::KvManager(const ModelConfig& config, int kv_tokens, int max_seqs, int block_tokens)
    : config_(config), block_tokens_(block_tokens) {
  if (block_tokens < 1) fail("KV block size {} must be positive", block_tokens);
  if (kv_tokens < 1) fail("--kv-tokens {} must be positive", kv_tokens);
  if (max_seqs < 1) fail("--max-seqs {} must be positive", max_seqs);
  const int blocks = pool_blocks(kv_tokens, block_tokens);
  const size_t slots = size_t(blocks) * size_t(block_tokens);
  layers_.resize(size_t(config.num_layers));
  // Not initialised: pages are touched only as sequences fill them (huge pages:
  // common/huge_pages.h).
  for (int l = 0; l < config.num_layers; ++l) {
    LayerStore& s = layers_[size_t(l)];
    s.latent = HugePageArray<float>(slots * size_t(config.kv_lora_rank));
    s.k_rope = HugePageArray<float>(slots * size_t(config.qk_rope_head_dim));
    bytes_ += slots * size_t(config.kv_lora_rank + config.qk_rope_head_dim) * sizeof(float);
    if (config.has_indexer() && config.indexer_is_full[size_t(l)]) {
      s.index_k = HugePageArray<float>(slots * size_t(config.index_head_dim));
      bytes_ += slots * size_t(config.index_head_dim) * sizeof(float);
    }
  }
  seqs_.resize(size_t(max_seqs));
  block_owner_.assign(size_t(blocks), -1);
  free_.reserve(size_t(blocks));
  for (int b = blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 handed out first
}

uint64_t KvManager::pool_bytes(const ModelConfig& config, int kv_tokens, int block_tokens,
                               bool indexer) {
  const uint64_t slots = uint64_t(pool_blocks(kv_tokens, block_tokens)) * uint64_t(block_tokens);
  uint64_t values = 0;
  for (int l = 0; l < config.num_layers; ++l) {
    values += uint64_t(config.kv_lora_rank + config.qk_rope_head_dim);
    if (indexer && config.has_indexer() && config.indexer_is_full[size_t(l)])
      values += uint64_t(config.index_head_dim);
  }
  return slots * values * sizeof(float);
}

int KvManager::open() {
  for (size_t s = 0; s < seqs_.size(); ++s) {
    if (seqs_[s].open) continue;
    seqs_[s].open = true;
    seqs_[s].length = 0;
    return int(s);
  }
  fail("all {} sequence slots are in use (--max-seqs)", seqs_.size());
}

bool KvManager::is_open(int seq) const {
  return seq >= 0 && size_t(seq) < seqs_.size() && seqs_[size_t(seq)].open;
}

void KvManager::clear(int seq) {
  if (!is_open(seq)) fail("sequence slot {} is not open", seq);
  Sequence& s = seqs_[size_t(seq)];
  for (int b : s.blocks) {
    block_owner_[size_t(b)] = -1;
    free_.push_back(b);
  }
  s.blocks.clear();
  s.length = 0;
}

void KvManager::close(int seq) {
  clear(seq);
  seqs_[size_t(seq)].open = false;
}

void KvManager::reserve(int seq, int tokens) {
  if (!is_open(seq)) fail("sequence slot {} is not open", seq);
  Sequence& s = seqs_[size_t(seq)];
  if (tokens > config_.max_position_embeddings)
    fail("sequence of {} tokens exceeds the model's context of {} (max_position_embeddings)",
         tokens, config_.max_position_embeddings);
  if (tokens > capacity_tokens())
    fail("sequence of {} tokens does not fit the KV pool of {} tokens (--kv-tokens)", tokens,
         capacity_tokens());
  const size_t needed = size_t((tokens + block_tokens_ - 1) / block_tokens_);
  if (needed <= s.blocks.size()) return;
  const size_t more = needed - s.blocks.size();
  if (more > free_.size())
    fail(
        "KV pool full: sequence {} needs {} more blocks of {} tokens to reach {} tokens, {} of {} "
        "blocks are free (--kv-tokens {})",
        seq, more, block_tokens_, tokens, free_.size(), total_blocks(), capacity_tokens());
  for (size_t i = 0; i < more; ++i) {
    const int b = free_.back();
    free_.pop_back();
    block_owner_[size_t(b)] = seq;
    s.blocks.push_back(b);
  }
}

void KvManager::set_length(int seq, int tokens) {
  Sequence& s = seqs_[size_t(seq)];
  if (size_t(tokens) > s.blocks.size() * size_t(block_tokens_))
    fail("sequence {}: length {} exceeds its reserved blocks", seq, tokens);
  s.length = tokens;
}

int KvManager::length(int seq) const {
  if (!is_open(seq)) fail("sequence slot {} is not open", seq);
  return seqs_[size_t(seq)].length;
}

}  // namespace colibri
