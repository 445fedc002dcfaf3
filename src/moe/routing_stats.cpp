#include "moe/routing_stats.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "common/error.h"
#include "common/input_file.h"
#include "common/output_file.h"

namespace colibri {

namespace {

constexpr char kMagic[8] = {'C', 'N', 'R', 'O', 'U', 'T', 'E', 'S'};
// magic, version, layers, experts, model hash, weights fingerprint, tokens
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 4 + 8 + 8 + 8;

template <class T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

template <class T>
T get(const std::string& in, size_t& at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  at += sizeof(T);
  return value;
}

}  // namespace

void RoutingStats::reset(int layers, int experts) {
  num_layers = layers;
  num_experts = experts;
  tokens = 0;
  count.assign(size_t(layers) * size_t(experts), 0.0);
}

void RoutingStats::add_routes(int layer, std::span<const int> experts) {
  double* row = count.data() + size_t(layer) * size_t(num_experts);
  for (int e : experts) row[e] += 1;
}

std::vector<double> RoutingStats::layer_share(int layer) const {
  std::vector<double> share(size_t(num_experts), 0.0);
  double total = 0;
  for (int e = 0; e < num_experts && !count.empty(); ++e) total += at(layer, e);
  for (int e = 0; e < num_experts; ++e)
    share[size_t(e)] = total > 0 ? at(layer, e) / total : 1.0 / num_experts;
  return share;
}

void RoutingStats::merge(const RoutingStats& newer) {
  if (count.empty()) {
    *this = newer;
    return;
  }
  if (newer.num_layers != num_layers || newer.num_experts != num_experts)
    fail("routing statistics of {} x {} cannot merge into {} x {}", newer.num_layers,
         newer.num_experts, num_layers, num_experts);
  const double keep = std::exp2(-newer.tokens / kHalfLifeTokens);
  for (size_t i = 0; i < count.size(); ++i) count[i] = count[i] * keep + newer.count[i];
  tokens = tokens * keep + newer.tokens;
}

std::string encode_routing_stats(const RoutingStats& stats, const ModelIdentity& id) {
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(out, RoutingStats::kVersion);
  put<uint32_t>(out, uint32_t(stats.num_layers));
  put<uint32_t>(out, uint32_t(stats.num_experts));
  put<uint64_t>(out, id.model_hash);
  put<uint64_t>(out, id.weights_fingerprint);
  put<double>(out, stats.tokens);
  for (double c : stats.count) put<double>(out, c);
  put<uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

RoutingStats decode_routing_stats(const std::string& bytes, int layers, int experts,
                                  const ModelIdentity& id, const std::string& name) {
  const auto refuse = [&](const std::string& why) -> RoutingStats {
    fail("{}: routing statistics: {} (delete the file, or give --routing-stats another path)", name,
         why);
  };
  if (bytes.size() < kHeaderBytes + 8 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    return refuse("not a colibri-node routing statistics file");
  size_t at = sizeof(kMagic);
  const auto version = get<uint32_t>(bytes, at);
  if (version != RoutingStats::kVersion)
    return refuse(
        fmt::format("version {}, this build reads version {}", version, RoutingStats::kVersion));
  const auto file_layers = get<uint32_t>(bytes, at), file_experts = get<uint32_t>(bytes, at);
  ModelIdentity file_id;
  file_id.model_hash = get<uint64_t>(bytes, at);
  file_id.weights_fingerprint = get<uint64_t>(bytes, at);
  const uint64_t cells = uint64_t(file_layers) * file_experts;
  if (bytes.size() != kHeaderBytes + cells * sizeof(double) + 8)
    return refuse(fmt::format("{} bytes, expected {} for {} layers x {} experts", bytes.size(),
                              kHeaderBytes + cells * sizeof(double) + 8, file_layers,
                              file_experts));
  const uint64_t stored_sum = [&] {
    size_t end = bytes.size() - 8;
    return get<uint64_t>(bytes, end);
  }();
  if (XXH3_64bits(bytes.data(), bytes.size() - 8) != stored_sum)
    return refuse("checksum mismatch (the file is damaged)");
  if (int(file_layers) != layers || int(file_experts) != experts)
    return refuse(fmt::format("it is for {} layers x {} experts, the model has {} x {}",
                              file_layers, file_experts, layers, experts));
  if (file_id.model_hash != id.model_hash || file_id.weights_fingerprint != id.weights_fingerprint)
    return refuse(fmt::format(
        "it was learned on another model (model {:016x}, weights {:016x}; this one is {:016x}, "
        "{:016x})",
        file_id.model_hash, file_id.weights_fingerprint, id.model_hash, id.weights_fingerprint));
  RoutingStats stats;
  stats.reset(layers, experts);
  stats.tokens = get<double>(bytes, at);
  if (!std::isfinite(stats.tokens) || stats.tokens < 0)
    return refuse(fmt::format("token count {} is not a finite count", stats.tokens));
  for (size_t i = 0; i < stats.count.size(); ++i) {
    stats.count[i] = get<double>(bytes, at);
    if (!std::isfinite(stats.count[i]) || stats.count[i] < 0)
      return refuse(fmt::format("count {} of layer {} expert {} is not a finite count",
                                stats.count[i], i / size_t(experts), i % size_t(experts)));
  }
  return stats;
}

RoutingStats read_routing_stats(const std::filesystem::path& path, int layers, int experts,
                                const ModelIdentity& id) {
  return decode_routing_stats(read_regular_file(path, "routing statistics"), layers, experts, id,
                              path.string());
}

void write_routing_stats(const std::filesystem::path& path, const RoutingStats& stats,
                         const ModelIdentity& id) {
  const std::string bytes = encode_routing_stats(stats, id);
  write_file_atomically(path,
                        [&](std::FILE* file) { std::fwrite(bytes.data(), 1, bytes.size(), file); });
}

}  // namespace colibri
