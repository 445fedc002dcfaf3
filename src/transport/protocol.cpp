#include "transport/protocol.h"

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "transport/checksum.h"

namespace colibri::wire {

namespace {

// The header's n_pairs pairs (unaligned): rows below n_rows, experts in range and owned, finite
// weights.
std::string check_pairs(const std::byte* pairs, const Header& h, const RequestCheck& check) {
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

namespace {

// The widest builds of the block sums this CPU runs (AVX-512, AVX2, else the build's).
struct SumBuilds {
  detail::SumBlocks sum;
  detail::CopySumBlocks copy_sum;
  detail::AddSumBlocks add_sum;
};

const SumBuilds& widest() {
  static const SumBuilds builds =
#if defined(__x86_64__)
      __builtin_cpu_supports("avx512f")
          ? SumBuilds{detail::sum_blocks_avx512, detail::copy_sum_blocks_avx512,
                      detail::add_sum_blocks_avx512}
      : __builtin_cpu_supports("avx2")
          ? SumBuilds{detail::sum_blocks_avx2, detail::copy_sum_blocks_avx2,
                      detail::add_sum_blocks_avx2}
          :
#endif
          SumBuilds{detail::sum_blocks_baseline, detail::copy_sum_blocks_baseline,
                    detail::add_sum_blocks_baseline};
  return builds;
}

// dst[i] = 0 + src[i] (first) or dst[i] += src[i] for `count` fp32 values at src (any alignment).
void add_values(float* dst, const std::byte* src, size_t count, bool first) {
  for (size_t i = 0; i < count; ++i) {
    float v;
    std::memcpy(&v, src + i * sizeof(float), sizeof(float));
    dst[i] = (first ? 0.0f : dst[i]) + v;
  }
}

}  // namespace

// Vectorised on request: -O2's cost model leaves loops of unknown length scalar.
void add_row(float* __restrict dst, const float* __restrict src, size_t count, bool first) {
  if (first) {
#pragma omp simd
    for (size_t i = 0; i < count; ++i) dst[i] = 0.0f + src[i];
  } else {
#pragma omp simd
    for (size_t i = 0; i < count; ++i) dst[i] += src[i];
  }
}

Checksum::Checksum()
    : sum_blocks_(widest().sum),
      copy_sum_blocks_(widest().copy_sum),
      add_sum_blocks_(widest().add_sum) {}

Checksum::Checksum(detail::SumBlocks sum_blocks, detail::CopySumBlocks copy_sum_blocks,
                   detail::AddSumBlocks add_sum_blocks)
    : sum_blocks_(sum_blocks), copy_sum_blocks_(copy_sum_blocks), add_sum_blocks_(add_sum_blocks) {}

void Checksum::add_accumulate(float* dst, const std::byte* src, size_t count, bool first) {
  // As add_copy: a pending block's rest and the tail apart, the whole blocks in one pass.
  size_t bytes = count * sizeof(float);
  size_t head =
      pending_bytes_ > 0 ? std::min(bytes, detail::kBlockBytes - pending_bytes_) : size_t{0};
  head -= head % sizeof(float);  // whole values; the pending bytes go on in the tail then
  if (head > 0) {
    add(src, head);
    add_values(dst, src, head / sizeof(float), first);
    dst += head / sizeof(float);
    src += head;
    bytes -= head;
  }
  const size_t blocks =
      add_sum_blocks_ && pending_bytes_ == 0 ? bytes / detail::kBlockBytes : size_t{0};
  if (blocks > 0) {
    add_sum_blocks_(a_, b_, dst, src, blocks, first);
    bytes_ += blocks * detail::kBlockBytes;
    dst += blocks * detail::kLanes;
    src += blocks * detail::kBlockBytes;
    bytes -= blocks * detail::kBlockBytes;
  }
  if (bytes > 0) {
    add(src, bytes);
    add_values(dst, src, bytes / sizeof(float), first);
  }
}

void Checksum::add_copy(std::byte* dst, const std::byte* src, size_t bytes) {
  // Up to the end of a pending block, and the tail, as memcpy then add; the blocks between in one
  // pass.
  const size_t head =
      pending_bytes_ > 0 ? std::min(bytes, detail::kBlockBytes - pending_bytes_) : 0;
  if (head > 0) {
    std::memcpy(dst, src, head);
    add(src, head);
    dst += head;
    src += head;
    bytes -= head;
  }
  const size_t blocks = copy_sum_blocks_ ? bytes / detail::kBlockBytes : 0;
  if (blocks > 0) {
    copy_sum_blocks_(a_, b_, dst, src, blocks);
    bytes_ += blocks * detail::kBlockBytes;
    dst += blocks * detail::kBlockBytes;
    src += blocks * detail::kBlockBytes;
    bytes -= blocks * detail::kBlockBytes;
  }
  if (bytes > 0) {
    std::memcpy(dst, src, bytes);
    add(src, bytes);
  }
}

void Checksum::add(const std::byte* data, size_t bytes) {
  if (bytes == 0) return;
  bytes_ += bytes;
  if (pending_bytes_ > 0) {
    const size_t take = std::min(bytes, detail::kBlockBytes - pending_bytes_);
    std::memcpy(pending_ + pending_bytes_, data, take);
    pending_bytes_ += take;
    data += take;
    bytes -= take;
    if (pending_bytes_ < detail::kBlockBytes) return;
    sum_blocks_(a_, b_, pending_, 1);
    pending_bytes_ = 0;
  }
  const size_t blocks = bytes / detail::kBlockBytes;
  if (blocks > 0) sum_blocks_(a_, b_, data, blocks);
  pending_bytes_ = bytes - blocks * detail::kBlockBytes;
  if (pending_bytes_ > 0)
    std::memcpy(pending_, data + blocks * detail::kBlockBytes, pending_bytes_);
}

uint32_t Checksum::value() const {
  uint32_t sums[2 * detail::kLanes];
  std::memcpy(sums, a_, sizeof(a_));
  std::memcpy(sums + detail::kLanes, b_, sizeof(b_));
  if (pending_bytes_ > 0) {  // the last block, padded with zeros
    std::byte last[detail::kBlockBytes] = {};
    std::memcpy(last, pending_, pending_bytes_);
    sum_blocks_(sums, sums + detail::kLanes, last, 1);
  }
  const uint64_t h = XXH3_64bits_withSeed(sums, sizeof(sums), bytes_);
  return uint32_t(h) ^ uint32_t(h >> 32);
}

uint32_t checksum(const std::byte* data, size_t bytes) {
  return detail::checksum_with(widest().sum, data, bytes);
}

void write_summed(const float* src, size_t values, ElemType wire_type, std::byte* dst,
                  Checksum& sum) {
  if (wire_type == ElemType::kF32) {
    sum.add_copy(dst, reinterpret_cast<const std::byte*>(src), values * sizeof(float));
    return;
  }
  from_f32(src, values, wire_type, dst);
  sum.add(dst, values * elem_bytes(wire_type));
}

uint32_t checksum_portable(const std::byte* data, size_t bytes) {
  return detail::checksum_with(detail::sum_blocks_scalar, data, bytes);
}

uint32_t detail::checksum_with(SumBlocks sum_blocks, const std::byte* data, size_t bytes) {
  Checksum sum(sum_blocks);
  sum.add(data, bytes);
  return sum.value();
}

uint32_t shared_checksum(uint32_t rows_checksum, uint32_t payload_checksum) {
  const uint32_t b = payload_checksum;
  return rows_checksum ^ (b << 1 | b >> 31);
}

uint32_t shared_checksum(const std::byte* rows, size_t row_bytes, const std::byte* payload,
                         size_t payload_bytes) {
  return shared_checksum(checksum(rows, row_bytes), checksum(payload, payload_bytes));
}

namespace {

// Copies the header out of a message of `bytes` and checks its magic and version.
std::string read_header(const std::byte* message, size_t bytes, Header& h) {
  if (bytes < sizeof(Header)) return fmt::format("{} bytes, shorter than a header", bytes);
  std::memcpy(&h, message, sizeof(Header));
  if (h.magic != kMagic) return fmt::format("bad magic {:#x}", h.magic);
  if (h.version != kProtocolVersion)
    return fmt::format("protocol version {} (expected {})", h.version, kProtocolVersion);
  return {};
}

// A request's layer, rows and pairs within what the receiving rank agreed to.
std::string check_counts(const Header& h, const RequestCheck& check) {
  if (h.layer < 0 || h.layer >= check.num_layers)
    return fmt::format("layer {} out of range", h.layer);
  if (h.n_rows > uint32_t(check.max_rows))
    return fmt::format("{} rows (at most {})", h.n_rows, check.max_rows);
  if (h.n_pairs < h.n_rows || uint64_t(h.n_pairs) > uint64_t(h.n_rows) * uint32_t(check.top_k))
    return fmt::format("{} pairs for {} rows", h.n_pairs, h.n_rows);
  return {};
}

// An answer's opcode, sequence and layer (a reply's or a host partial's).
std::string check_answer(const Header& h, Opcode opcode, const char* what,
                         uint32_t expected_sequence, int layer) {
  if (h.opcode != uint16_t(opcode))
    return fmt::format("opcode {} where {} was expected", h.opcode, what);
  if (h.sequence != expected_sequence || h.layer != layer)
    return fmt::format("sequence {} layer {} (expected {} and {})", h.sequence, h.layer,
                       expected_sequence, layer);
  return {};
}

}  // namespace

std::string check_request(const std::byte* message, size_t bytes, const RequestCheck& check,
                          Header& h, const std::byte* shared_rows) {
  if (std::string problem = read_header(message, bytes, h); !problem.empty()) return problem;
  if (h.sequence != check.expected_sequence)
    return fmt::format("sequence {} (expected {})", h.sequence, check.expected_sequence);
  if (h.opcode == uint16_t(Opcode::kShutdown)) {
    if (bytes != sizeof(Header) || h.payload_bytes != 0) return "shutdown with a payload";
    return {};
  }
  if (h.opcode == uint16_t(Opcode::kPlacement)) {
    if (h.layer != -1 || h.n_rows > 1) return "a placement change with a layer or a bad phase";
    if (h.payload_bytes % 4 != 0 || bytes != sizeof(Header) + h.payload_bytes)
      return fmt::format("a placement change of {} bytes", bytes);
    if (checksum(message + sizeof(Header), h.payload_bytes) != h.checksum)
      return "payload checksum mismatch";
    return {};
  }
  if (h.opcode == uint16_t(Opcode::kCountersRequest)) {
    if (bytes != sizeof(Header) || h.payload_bytes != 0) return "a counters request with a payload";
    return {};
  }
  if (h.opcode == uint16_t(Opcode::kPrefetchHint)) {
    if (h.layer < 0 || h.layer >= check.num_layers || h.n_rows != 0 ||
        h.n_pairs > uint32_t(check.num_experts) || h.payload_bytes != h.n_pairs * 4 ||
        bytes != sizeof(Header) + h.payload_bytes)
      return fmt::format("a hint of {} experts for layer {} in {} bytes", h.n_pairs, h.layer,
                         bytes);
    if (checksum(message + sizeof(Header), h.payload_bytes) != h.checksum)
      return "payload checksum mismatch";
    for (uint32_t i = 0; i < h.n_pairs; ++i) {
      uint32_t expert = 0;
      std::memcpy(&expert, message + sizeof(Header) + 4 * i, 4);
      if (expert >= uint32_t(check.num_experts))
        return fmt::format("hinted expert {} out of range", expert);
    }
    return {};
  }
  const bool shared = h.opcode == uint16_t(Opcode::kSharedRequest);
  if (h.opcode != uint16_t(Opcode::kExpertRequest) && !shared)
    return fmt::format("unknown opcode {}", h.opcode);
  if (shared && shared_rows == nullptr) return "rows in a shared segment this rank does not have";
  if (std::string problem = check_counts(h, check); !problem.empty()) return problem;
  const size_t row_bytes = size_t(h.n_rows) * size_t(check.hidden) * check.elem_bytes;
  const size_t expected =
      shared ? shared_request_payload_bytes(h.n_rows, h.n_pairs)
             : request_payload_bytes(h.n_rows, h.n_pairs, check.hidden, check.elem_bytes);
  if (h.payload_bytes != expected || bytes != sizeof(Header) + expected)
    return fmt::format("{} bytes (expected {})", bytes, sizeof(Header) + expected);
  const std::byte* payload = message + sizeof(Header);
  const uint32_t sum = shared ? shared_checksum(shared_rows, row_bytes, payload, expected)
                              : checksum(payload, expected);
  if (sum != h.checksum) return "payload checksum mismatch";
  const std::byte* pairs = shared ? payload : payload + row_bytes;
  if (std::string problem = check_pairs(pairs, h, check); !problem.empty()) return problem;
  return check_row_indices(pairs + size_t(h.n_pairs) * sizeof(Pair), h.n_rows, check.max_rows);
}

std::string check_counters_reply(const std::byte* message, size_t bytes, uint32_t expected_sequence,
                                 int rank, Header& h) {
  if (std::string problem = read_header(message, bytes, h); !problem.empty()) return problem;
  if (std::string problem =
          check_answer(h, Opcode::kCountersReply, "its counters", expected_sequence, -1);
      !problem.empty())
    return problem;
  if (h.n_rows != uint32_t(rank) || bytes != sizeof(Header) + h.payload_bytes)
    return fmt::format("counters of rank {} in {} bytes", h.n_rows, bytes);
  if (checksum(message + sizeof(Header), h.payload_bytes) != h.checksum)
    return "payload checksum mismatch";
  return {};
}

std::string check_reply_header(const std::byte* message, size_t bytes, const ReplyCheck& check,
                               bool shared, Header& h) {
  if (std::string problem = read_header(message, bytes, h); !problem.empty()) return problem;
  const size_t row_bytes = reply_payload_bytes(check.n_rows, check.hidden, check.elem_bytes);
  const size_t expected = shared ? 0 : row_bytes;
  if (std::string problem = check_answer(h, shared ? Opcode::kSharedReply : Opcode::kExpertReply,
                                         shared ? "a shared-segment reply" : "a reply",
                                         check.expected_sequence, check.layer);
      !problem.empty())
    return problem;
  if (h.n_rows != check.n_rows || h.payload_bytes != expected || bytes != sizeof(Header) + expected)
    return fmt::format("{} rows in {} bytes (expected {} rows in {})", h.n_rows, bytes,
                       check.n_rows, sizeof(Header) + expected);
  return {};
}

std::string check_reply(const std::byte* message, size_t bytes, const ReplyCheck& check,
                        const std::byte* shared_rows) {
  Header h;
  if (std::string problem = check_reply_header(message, bytes, check, shared_rows != nullptr, h);
      !problem.empty())
    return problem;
  const size_t row_bytes = reply_payload_bytes(check.n_rows, check.hidden, check.elem_bytes);
  const std::byte* rows = shared_rows ? shared_rows : message + sizeof(Header);
  if (checksum(rows, row_bytes) != h.checksum) return "payload checksum mismatch";
  return {};
}

std::string check_host_partial(const std::byte* message, size_t bytes,
                               const HostPartialCheck& check, Header& h) {
  if (std::string problem = read_header(message, bytes, h); !problem.empty()) return problem;
  if (std::string problem = check_answer(h, Opcode::kHostPartial, "a host partial",
                                         check.expected_sequence, check.layer);
      !problem.empty())
    return problem;
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
  return make_header(opcode, sequence, layer, n_rows, n_pairs,
                     uint32_t(nccl_request_payload_bytes(n_rows, n_pairs, hidden, elem_bytes)),
                     checksum(pairs, pairs ? pairs_bytes : 0));
}

std::string check_nccl_count_header(const std::byte* message, size_t bytes,
                                    const RequestCheck& check, Header& h) {
  if (bytes != sizeof(Header)) return fmt::format("{} bytes, not a count header", bytes);
  if (std::string problem = read_header(message, bytes, h); !problem.empty()) return problem;
  if (h.sequence != check.expected_sequence)
    return fmt::format("sequence {} (expected {})", h.sequence, check.expected_sequence);
  if (h.opcode == uint16_t(Opcode::kShutdown)) {
    if (h.n_rows != 0 || h.n_pairs != 0 || h.payload_bytes != 0) return "shutdown with a payload";
    return {};
  }
  if (h.opcode != uint16_t(Opcode::kNcclRequest))
    return fmt::format("opcode {} where a count header was expected", h.opcode);
  if (std::string problem = check_counts(h, check); !problem.empty()) return problem;
  const size_t expected =
      nccl_request_payload_bytes(h.n_rows, h.n_pairs, check.hidden, check.elem_bytes);
  if (h.payload_bytes != expected)
    return fmt::format("payload of {} bytes (expected {})", h.payload_bytes, expected);
  return {};
}

std::string check_nccl_pairs(const std::byte* pairs, const Header& h, const RequestCheck& check) {
  if (checksum(pairs, size_t(h.n_pairs) * sizeof(Pair)) != h.checksum)
    return "pairs checksum mismatch";
  return check_pairs(pairs, h, check);
}

}  // namespace colibri::wire
