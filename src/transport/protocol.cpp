#include "transport/protocol.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

namespace colibri::wire {

uint32_t checksum(const std::byte* data, size_t bytes) {
  // FNV-1a style over 64-bit words in four independent lanes (the multiply latency of one lane
  // would otherwise bound the speed), then the tail bytes.
  constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t lane[4] = {14695981039346656037ull, 1, 2, 3};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t word;
      std::memcpy(&word, data + i + 8 * l, 8);
      lane[l] = (lane[l] ^ word) * kPrime;
    }
  }
  uint64_t hash = ((lane[0] * kPrime ^ lane[1]) * kPrime ^ lane[2]) * kPrime ^ lane[3];
  for (; i < bytes; ++i) hash = (hash ^ uint64_t(data[i])) * kPrime;
  return uint32_t(hash ^ (hash >> 32));
}

std::string check_request(const std::byte* message, size_t bytes, const RequestCheck& check,
                          Header& h) {
  if (bytes < sizeof(Header)) return fmt::format("{} bytes, shorter than a header", bytes);
  std::memcpy(&h, message, sizeof(Header));
  if (h.magic != kMagic) return fmt::format("bad magic {:#x}", h.magic);
  if (h.version != kProtocolVersion) return fmt::format("protocol version {}", h.version);
  if (h.sequence != check.expected_sequence)
    return fmt::format("sequence {} (expected {})", h.sequence, check.expected_sequence);
  if (h.opcode == uint16_t(Opcode::kShutdown)) {
    if (bytes != sizeof(Header) || h.payload_bytes != 0) return "shutdown with a payload";
    return {};
  }
  if (h.opcode != uint16_t(Opcode::kExpertRequest))
    return fmt::format("unknown opcode {}", h.opcode);
  if (h.layer < 0 || h.layer >= check.num_layers)
    return fmt::format("layer {} out of range", h.layer);
  if (h.n_rows == 0 || h.n_rows > uint32_t(check.max_rows))
    return fmt::format("{} rows (at most {})", h.n_rows, check.max_rows);
  if (h.n_pairs < h.n_rows || uint64_t(h.n_pairs) > uint64_t(h.n_rows) * uint32_t(check.top_k))
    return fmt::format("{} pairs for {} rows", h.n_pairs, h.n_rows);
  const size_t expected =
      request_payload_bytes(h.n_rows, h.n_pairs, check.hidden, check.elem_bytes);
  if (h.payload_bytes != expected || bytes != sizeof(Header) + expected)
    return fmt::format("{} bytes (expected {})", bytes, sizeof(Header) + expected);
  const std::byte* payload = message + sizeof(Header);
  if (checksum(payload, expected) != h.checksum) return "payload checksum mismatch";
  const std::byte* pairs = payload + size_t(h.n_rows) * size_t(check.hidden) * check.elem_bytes;
  for (uint32_t i = 0; i < h.n_pairs; ++i) {
    Pair pair;
    std::memcpy(&pair, pairs + size_t(i) * sizeof(Pair), sizeof(Pair));
    if (pair.row >= h.n_rows || pair.expert >= uint32_t(check.num_experts) ||
        !std::isfinite(pair.weight))
      return fmt::format("pair {} = (row {}, expert {}, weight {}) is invalid", i, pair.row,
                         pair.expert, pair.weight);
    if (check.owned && !check.owned(h.layer, pair.expert))
      return fmt::format("expert {} of layer {} is not owned by this rank", pair.expert, h.layer);
  }
  return {};
}

std::string check_reply(const std::byte* message, size_t bytes, const ReplyCheck& check) {
  if (bytes < sizeof(Header)) return fmt::format("{} bytes, shorter than a header", bytes);
  Header h;
  std::memcpy(&h, message, sizeof(Header));
  const size_t expected = reply_payload_bytes(check.n_rows, check.hidden, check.elem_bytes);
  if (h.magic != kMagic) return fmt::format("bad magic {:#x}", h.magic);
  if (h.version != kProtocolVersion)
    return fmt::format("protocol version {} (expected {})", h.version, kProtocolVersion);
  if (h.opcode != uint16_t(Opcode::kExpertReply))
    return fmt::format("opcode {} where a reply was expected", h.opcode);
  if (h.sequence != check.expected_sequence || h.layer != check.layer)
    return fmt::format("sequence {} layer {} (expected {} and {})", h.sequence, h.layer,
                       check.expected_sequence, check.layer);
  if (h.n_rows != check.n_rows || h.payload_bytes != expected || bytes != sizeof(Header) + expected)
    return fmt::format("{} rows in {} bytes (expected {} rows in {})", h.n_rows, bytes,
                       check.n_rows, sizeof(Header) + expected);
  if (checksum(message + sizeof(Header), expected) != h.checksum)
    return "payload checksum mismatch";
  return {};
}

}  // namespace colibri::wire
