#include "coordinator/kv_record.h"

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstring>

namespace colibri::kv_record {
namespace {

template <class T>
void put(std::vector<uint8_t>& out, const T& value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

template <class T>
T get(std::span<const uint8_t> bytes, size_t offset) {
  T value{};
  std::memcpy(&value, bytes.data() + offset, sizeof value);
  return value;
}

bool indexer_layer(const ModelConfig& c, int layer) {
  return c.has_indexer() && c.indexer_is_full[size_t(layer)];
}

}  // namespace

std::vector<uint8_t> header(const ModelConfig& config, const ModelIdentity& identity) {
  std::vector<uint8_t> h(kHeaderMagic, kHeaderMagic + sizeof kHeaderMagic);
  put(h, kVersion);
  put(h, uint32_t(config.num_layers));
  put(h, uint32_t(config.kv_lora_rank));
  put(h, uint32_t(config.qk_rope_head_dim));
  put(h, uint32_t(config.has_indexer() ? config.index_head_dim : 0));
  const uint32_t words = uint32_t((config.num_layers + 31) / 32);
  put(h, words);
  for (uint32_t w = 0; w < words; ++w) {
    uint32_t bits = 0;
    for (int b = 0; b < 32; ++b) {
      const int l = int(w * 32) + b;
      if (l < config.num_layers && indexer_layer(config, l)) bits |= 1u << b;
    }
    put(h, bits);
  }
  put(h, identity.model_hash);
  put(h, identity.weights_fingerprint);
  put(h, uint64_t(XXH3_64bits(h.data(), h.size())));
  return h;
}

std::string header_mismatch(std::span<const uint8_t> have, std::span<const uint8_t> want) {
  if (have.size() == want.size() && std::memcmp(have.data(), want.data(), have.size()) == 0)
    return {};
  if (have.size() < sizeof kHeaderMagic || have.size() != want.size() ||
      std::memcmp(have.data(), kHeaderMagic, sizeof kHeaderMagic) != 0)
    return "not a colibri-node KV file (no header)";
  const size_t n = have.size();
  if (XXH3_64bits(have.data(), n - 8) != get<uint64_t>(have, n - 8))
    return "its header is damaged (checksum)";
  if (get<uint32_t>(have, 8) != get<uint32_t>(want, 8))
    return fmt::format("a KV file of version {} (this build reads version {})",
                       get<uint32_t>(have, 8), get<uint32_t>(want, 8));
  if (std::memcmp(have.data() + 12, want.data() + 12, n - 12 - 24) != 0)
    return "a KV file of another shape (layers, MLA ranks or indexer layers differ)";
  if (get<uint64_t>(have, n - 24) != get<uint64_t>(want, n - 24))
    return fmt::format("a KV file of another model (model hash {:016x}, this model's {:016x})",
                       get<uint64_t>(have, n - 24), get<uint64_t>(want, n - 24));
  return fmt::format("a KV file of other weights (weights fingerprint {:016x}, these {:016x})",
                     get<uint64_t>(have, n - 16), get<uint64_t>(want, n - 16));
}

size_t position_bytes(const ModelConfig& c) {
  size_t floats = 0;
  for (int l = 0; l < c.num_layers; ++l)
    floats += size_t(c.kv_lora_rank + c.qk_rope_head_dim) +
              (indexer_layer(c, l) ? size_t(c.index_head_dim) : 0);
  return floats * sizeof(float);
}

uint64_t record_bytes(const ModelConfig& config, uint64_t tokens) {
  return kRecordHeadBytes + tokens * (sizeof(int32_t) + position_bytes(config)) + 8;
}

void append_record(std::vector<uint8_t>& out, const ModelConfig& config, const KvManager& kv,
                   int seq, int first, std::span<const int> tokens) {
  const size_t start = out.size();
  out.reserve(start + size_t(record_bytes(config, tokens.size())));
  out.insert(out.end(), kRecordMagic, kRecordMagic + sizeof kRecordMagic);
  put(out, uint32_t(tokens.size()));
  put(out, uint32_t(first));
  for (int id : tokens) put(out, int32_t(id));
  for (int l = 0; l < config.num_layers; ++l) {
    const auto add_rows = [&](const float* store, int dim) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        const auto* p = reinterpret_cast<const uint8_t*>(
            store + size_t(kv.slot(seq, first + int(i))) * size_t(dim));
        out.insert(out.end(), p, p + size_t(dim) * sizeof(float));
      }
    };
    add_rows(kv.latent(l), config.kv_lora_rank);
    add_rows(kv.k_rope(l), config.qk_rope_head_dim);
    if (indexer_layer(config, l)) add_rows(kv.index_k(l), config.index_head_dim);
  }
  put(out, uint64_t(XXH3_64bits(out.data() + start, out.size() - start)));
}

bool checksum_matches(std::span<const uint8_t> record) {
  if (record.size() < 8) return false;
  return XXH3_64bits(record.data(), record.size() - 8) == get<uint64_t>(record, record.size() - 8);
}

std::vector<int> read_ids(const uint8_t* ids, uint32_t tokens) {
  std::vector<int> out(tokens);
  for (uint32_t i = 0; i < tokens; ++i) {
    int32_t id = 0;
    std::memcpy(&id, ids + size_t(i) * sizeof id, sizeof id);
    out[i] = id;
  }
  return out;
}

void copy_rows(KvManager& kv, int seq, const ModelConfig& config, const uint8_t* rows,
               uint32_t tokens, int first, uint32_t skip) {
  const uint8_t* p = rows;
  for (int l = 0; l < config.num_layers; ++l) {
    const auto copy = [&](float* store, int dim) {
      const size_t row = size_t(dim) * sizeof(float);
      for (uint32_t i = skip; i < tokens; ++i)
        std::memcpy(store + size_t(kv.slot(seq, first + int(i))) * size_t(dim), p + i * row, row);
      p += tokens * row;
    };
    copy(kv.latent(l), config.kv_lora_rank);
    copy(kv.k_rope(l), config.qk_rope_head_dim);
    if (indexer_layer(config, l)) copy(kv.index_k(l), config.index_head_dim);
  }
}

}  // namespace colibri::kv_record
