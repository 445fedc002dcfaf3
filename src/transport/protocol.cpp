#include "transport/protocol.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include <fmt/format.h>

#include <cmath>
#include <cstring>

namespace colibri::wire {

namespace {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the one SSE4.2's crc32 instruction
// computes: a table for CPUs without it, giving the same values.
struct Crc32cTable {
  uint32_t t[8][256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? 0x82F63B78u : 0u);
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
};

uint32_t crc_words_table(uint32_t crc, const std::byte* p, size_t words) {
  static const Crc32cTable table;
  for (size_t w = 0; w < words; ++w, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = table.t[7][v & 0xFF] ^ table.t[6][(v >> 8) & 0xFF] ^ table.t[5][(v >> 16) & 0xFF] ^
          table.t[4][(v >> 24) & 0xFF] ^ table.t[3][(v >> 32) & 0xFF] ^
          table.t[2][(v >> 40) & 0xFF] ^ table.t[1][(v >> 48) & 0xFF] ^ table.t[0][v >> 56];
  }
  return crc;
}

uint32_t crc_byte(uint32_t crc, std::byte b) {
  crc ^= uint32_t(b);
  for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78u : 0u);
  return crc;
}

#if defined(__x86_64__)
// Three independent streams keep the crc32 unit busy (latency 3, one per cycle).
__attribute__((target("sse4.2"))) void crc_lanes_hw(uint32_t crc[3], const std::byte* p,
                                                    size_t words) {
  uint64_t c0 = crc[0], c1 = crc[1], c2 = crc[2];
  const std::byte *p0 = p, *p1 = p + 8 * words, *p2 = p + 16 * words;
  for (size_t w = 0; w < words; ++w) {
    uint64_t v0, v1, v2;
    std::memcpy(&v0, p0 + 8 * w, 8);
    std::memcpy(&v1, p1 + 8 * w, 8);
    std::memcpy(&v2, p2 + 8 * w, 8);
    c0 = _mm_crc32_u64(c0, v0);
    c1 = _mm_crc32_u64(c1, v1);
    c2 = _mm_crc32_u64(c2, v2);
  }
  crc[0] = uint32_t(c0);
  crc[1] = uint32_t(c1);
  crc[2] = uint32_t(c2);
}
#endif

// The CRC-32C of three equal runs of 8-byte words, the rest (under 24 bytes) added to the third,
// mixed with the length; hardware crc32 when `hw`, else the table: the same value either way.
uint32_t checksum_with(const std::byte* data, size_t bytes, bool hw) {
  const size_t words = bytes / 24;
  uint32_t crc[3] = {0xFFFFFFFFu, 0x9E3779B9u, 0x7F4A7C15u};
  if (hw) {
#if defined(__x86_64__)
    crc_lanes_hw(crc, data, words);
#endif
  } else {
    for (int l = 0; l < 3; ++l)
      crc[l] = crc_words_table(crc[l], data + size_t(l) * 8 * words, words);
  }
  for (size_t i = 24 * words; i < bytes; ++i) crc[2] = crc_byte(crc[2], data[i]);
  const uint64_t mixed = (uint64_t(crc[0]) << 32 | crc[1]) * 0x9E3779B97F4A7C15ull ^
                         (uint64_t(crc[2]) << 32 | uint32_t(bytes)) * 0xC2B2AE3D27D4EB4Full;
  return uint32_t(mixed ^ (mixed >> 32));
}

// n row indices (uint32, unaligned), strictly ascending and below max_rows.
std::string check_row_indices(const std::byte* indices, uint32_t n, int max_rows) {
  uint32_t previous = 0;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t row;
    std::memcpy(&row, indices + size_t(i) * sizeof(row), sizeof(row));
    if (row >= uint32_t(max_rows) || (i > 0 && row <= previous))
      return fmt::format("row index {} = {} is out of range or out of order", i, row);
    previous = row;
  }
  return {};
}

}  // namespace

uint32_t checksum(const std::byte* data, size_t bytes) {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
#else
  constexpr bool hw = false;
#endif
  return checksum_with(data, bytes, hw);
}

uint32_t checksum_portable(const std::byte* data, size_t bytes) {
  return checksum_with(data, bytes, false);
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
  if (h.n_rows > uint32_t(check.max_rows))
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
  return check_row_indices(pairs + size_t(h.n_pairs) * sizeof(Pair), h.n_rows, check.max_rows);
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

std::string check_host_partial(const std::byte* message, size_t bytes,
                               const HostPartialCheck& check, Header& h) {
  if (bytes < sizeof(Header)) return fmt::format("{} bytes, shorter than a header", bytes);
  std::memcpy(&h, message, sizeof(Header));
  if (h.magic != kMagic) return fmt::format("bad magic {:#x}", h.magic);
  if (h.version != kProtocolVersion)
    return fmt::format("protocol version {} (expected {})", h.version, kProtocolVersion);
  if (h.opcode != uint16_t(Opcode::kHostPartial))
    return fmt::format("opcode {} where a host partial was expected", h.opcode);
  if (h.sequence != check.expected_sequence || h.layer != check.layer)
    return fmt::format("sequence {} layer {} (expected {} and {})", h.sequence, h.layer,
                       check.expected_sequence, check.layer);
  if (h.n_rows > uint32_t(check.max_rows) || h.n_pairs != 0)
    return fmt::format("{} rows (at most {}), {} pairs", h.n_rows, check.max_rows, h.n_pairs);
  const size_t expected = host_partial_payload_bytes(h.n_rows, check.hidden, check.elem_bytes);
  if (h.payload_bytes != expected || bytes != sizeof(Header) + expected)
    return fmt::format("{} bytes (expected {})", bytes, sizeof(Header) + expected);
  const std::byte* payload = message + sizeof(Header);
  if (checksum(payload, expected) != h.checksum) return "payload checksum mismatch";
  return check_row_indices(payload + size_t(h.n_rows) * size_t(check.hidden) * check.elem_bytes,
                           h.n_rows, check.max_rows);
}

Header nccl_count_header(Opcode opcode, uint32_t sequence, int layer, uint32_t n_rows,
                         uint32_t n_pairs, int hidden, size_t elem_bytes, const std::byte* pairs) {
  const size_t pairs_bytes = size_t(n_pairs) * sizeof(Pair);
  return {kMagic,
          kProtocolVersion,
          uint16_t(opcode),
          sequence,
          layer,
          n_rows,
          n_pairs,
          uint32_t(nccl_request_payload_bytes(n_rows, n_pairs, hidden, elem_bytes)),
          checksum(pairs, pairs ? pairs_bytes : 0)};
}

std::string check_nccl_count_header(const std::byte* message, size_t bytes,
                                    const RequestCheck& check, Header& h) {
  if (bytes != sizeof(Header)) return fmt::format("{} bytes, not a count header", bytes);
  std::memcpy(&h, message, sizeof(Header));
  if (h.magic != kMagic) return fmt::format("bad magic {:#x}", h.magic);
  if (h.version != kProtocolVersion) return fmt::format("protocol version {}", h.version);
  if (h.sequence != check.expected_sequence)
    return fmt::format("sequence {} (expected {})", h.sequence, check.expected_sequence);
  if (h.opcode == uint16_t(Opcode::kShutdown)) {
    if (h.n_rows != 0 || h.n_pairs != 0 || h.payload_bytes != 0) return "shutdown with a payload";
    return {};
  }
  if (h.opcode != uint16_t(Opcode::kNcclRequest))
    return fmt::format("opcode {} where a count header was expected", h.opcode);
  if (h.layer < 0 || h.layer >= check.num_layers)
    return fmt::format("layer {} out of range", h.layer);
  if (h.n_rows > uint32_t(check.max_rows))
    return fmt::format("{} rows (at most {})", h.n_rows, check.max_rows);
  if (h.n_pairs < h.n_rows || uint64_t(h.n_pairs) > uint64_t(h.n_rows) * uint32_t(check.top_k))
    return fmt::format("{} pairs for {} rows", h.n_pairs, h.n_rows);
  const size_t expected =
      nccl_request_payload_bytes(h.n_rows, h.n_pairs, check.hidden, check.elem_bytes);
  if (h.payload_bytes != expected)
    return fmt::format("payload of {} bytes (expected {})", h.payload_bytes, expected);
  return {};
}

std::string check_nccl_pairs(const std::byte* pairs, const Header& h, const RequestCheck& check) {
  if (checksum(pairs, size_t(h.n_pairs) * sizeof(Pair)) != h.checksum)
    return "pairs checksum mismatch";
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

}  // namespace colibri::wire
