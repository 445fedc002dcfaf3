// Routing statistics: how many routed rows went to each (layer, expert). The coordinator counts
// what it sends; the counts persist across runs in a small file per model (--routing-stats),
// merged with decay, and heat placement (moe/placement.h) reads them.
//
// The file (little-endian, version 1): "CNROUTES", u32 version, u32 layers, u32 experts,
// u64 model hash, u64 weights fingerprint, f64 tokens, f64 counts[layers * experts], u64 XXH3-64 of
// every byte before it. A file of another version, shape or model, a bad checksum, or a negative
// or non-finite count is refused with one line naming the file and the reason.
#pragma once

#include <cereal/types/vector.hpp>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace colibri {

// Which model a statistics file belongs to: the handshake's model hash (config and tensor index)
// and its fingerprint of the weight data.
struct ModelIdentity {
  uint64_t model_hash = 0;
  uint64_t weights_fingerprint = 0;
};

struct RoutingStats {
  int num_layers = 0;
  int num_experts = 0;
  double tokens = 0;          // rows routed through one MoE layer, decayed as the counts are
  std::vector<double> count;  // [num_layers * num_experts]; dense layers stay 0

  static constexpr uint32_t kVersion = 1;
  // The old counts' half-life, in newly routed tokens, when a session is merged into them: what
  // was learned fades as the engine sees more work, not with the number of runs.
  static constexpr double kHalfLifeTokens = 16384;

  void reset(int layers, int experts);
  bool empty() const { return tokens <= 0; }
  double at(int layer, int expert) const {
    return count[size_t(layer) * size_t(num_experts) + size_t(expert)];
  }
  // Counts the top-k experts of n routed rows of `layer` (`experts` [n, top_k]).
  void add_routes(int layer, std::span<const int> experts);
  // Counts n rows routed through the model (once per forward call, whatever its MoE layers).
  void add_tokens(double n) { tokens += n; }
  // Each expert's expected share of layer's routes (sums to 1); uniform when nothing was counted.
  std::vector<double> layer_share(int layer) const;
  // Merges newer counts into these: the old ones decayed by kHalfLifeTokens over newer.tokens.
  void merge(const RoutingStats& newer);

  template <class Archive>
  void serialize(Archive& ar) {
    ar(num_layers, num_experts, tokens, count);
  }
};

// Reads a statistics file for a model of `layers` x `experts` with identity `id`. Every problem
// is an Error "PATH: routing statistics: <reason>".
RoutingStats read_routing_stats(const std::filesystem::path& path, int layers, int experts,
                                const ModelIdentity& id);

// Writes the file crash-safe: a temporary file beside it, fsync, rename over it.
void write_routing_stats(const std::filesystem::path& path, const RoutingStats& stats,
                         const ModelIdentity& id);

// The bytes of the file, and the reverse (for tests of damaged files).
std::string encode_routing_stats(const RoutingStats& stats, const ModelIdentity& id);
RoutingStats decode_routing_stats(const std::string& bytes, int layers, int experts,
                                  const ModelIdentity& id, const std::string& name);

}  // namespace colibri
