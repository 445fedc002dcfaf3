// Fuzz target: one message of the MPI exchange as an expert rank (request or shutdown) or the
// coordinator (reply) receives it, through wire::check_request / wire::check_reply. The first
// byte chooses: bit 0 recomputes the payload checksum (so mutations reach the checks after it),
// bit 1 checks a reply instead of a request, bit 2 uses a bf16 wire, bit 3 (with bit 1 clear)
// checks a host partial as a host leader receives it (wire::check_host_partial; fp32 rows
// whatever the wire), bit 4 an NCCL count header and the pairs after it (the rows, which stay in
// device memory, left out; wire::check_nccl_count_header, wire::check_nccl_pairs), bit 5 gives
// the receiver a shared segment (8 rows of a fixed pattern) for kSharedRequest / kSharedReply
// messages, bit 6 checks a rank's counters as the coordinator receives them
// (wire::check_counters_reply, then the counters read). Limits: hidden
// 4, at most 8 rows, top-2 of 8 experts, 3 layers, this rank owning the even experts. An accepted
// request's rows, pairs and row indices lie inside the message, its pairs are valid and its row
// indices ascend below 8; so do an accepted host partial's.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/profile.h"
#include "common/serialize.h"
#include "fuzz_target.h"
#include "transport/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace colibri;
  if (size < 1) return 0;
  const uint8_t flags = data[0];
  std::vector<std::byte> message(size - 1);
  if (!message.empty()) std::memcpy(message.data(), data + 1, message.size());
  const size_t elem_bytes = (flags & 4) ? 2 : 4;
  std::vector<std::byte> segment;
  if (flags & 32) {
    segment.resize(8 * 4 * elem_bytes);
    for (size_t i = 0; i < segment.size(); ++i) segment[i] = std::byte(i * 37 % 251);
  }
  const std::byte* shared_rows = segment.empty() ? nullptr : segment.data();
  if ((flags & 1) && message.size() >= sizeof(wire::Header)) {
    const std::byte* payload = message.data() + sizeof(wire::Header);
    const size_t payload_bytes = message.size() - sizeof(wire::Header);
    uint32_t sum = wire::checksum(payload, payload_bytes);
    if (shared_rows && (flags & 2)) {  // a reply's rows are all in the segment: 2 rows
      sum = wire::checksum(shared_rows, 2 * 4 * elem_bytes);
    } else if (shared_rows) {
      uint32_t n_rows;
      std::memcpy(&n_rows, message.data() + offsetof(wire::Header, n_rows), sizeof(n_rows));
      const size_t rows_bytes = size_t(n_rows <= 8 ? n_rows : 8) * 4 * elem_bytes;
      sum = wire::shared_checksum(shared_rows, rows_bytes, payload, payload_bytes);
    }
    std::memcpy(message.data() + offsetof(wire::Header, checksum), &sum, sizeof(sum));
  }
  return fuzz::run_one([&] {
    if (flags & 64) {
      wire::Header h;
      const std::string problem =
          wire::check_counters_reply(message.data(), message.size(), 1, 2, h);
      if (!problem.empty()) throw Error(problem);
      fuzz_require(message.size() == sizeof(wire::Header) + h.payload_bytes, "exact size");
      try {
        const auto counters = from_bytes<LiveCounters>(std::string(
            reinterpret_cast<const char*>(message.data()) + sizeof(wire::Header), h.payload_bytes));
        (void)counters;
      } catch (const cereal::Exception& e) {
        throw Error(e.what());
      }
      return;
    }
    if (flags & 16) {
      wire::RequestCheck check;
      check.expected_sequence = 1;
      check.num_layers = 3;
      check.max_rows = 8;
      check.top_k = 2;
      check.hidden = 4;
      check.num_experts = 8;
      check.elem_bytes = elem_bytes;
      check.owned = [](int, uint32_t expert) { return expert % 2 == 0; };
      wire::Header h;
      const size_t header_bytes = std::min(message.size(), sizeof(wire::Header));
      std::string problem = wire::check_nccl_count_header(message.data(), header_bytes, check, h);
      if (!problem.empty()) throw Error(problem);
      if (h.opcode == uint16_t(wire::Opcode::kShutdown)) return;
      fuzz_require(h.n_rows <= 8 && h.n_pairs <= 16, "counts within the limits");
      fuzz_require(h.payload_bytes == h.n_rows * 4 * elem_bytes + h.n_pairs * sizeof(wire::Pair),
                   "payload sized by the counts");
      // The receive is sized by the header: the pairs are there or the message is not this one.
      if (message.size() - sizeof(wire::Header) < h.n_pairs * sizeof(wire::Pair))
        throw Error("pairs missing");
      problem = wire::check_nccl_pairs(message.data() + sizeof(wire::Header), h, check);
      if (!problem.empty()) throw Error(problem);
      for (uint32_t i = 0; i < h.n_pairs; ++i) {
        wire::Pair pair;
        std::memcpy(&pair, message.data() + sizeof(wire::Header) + i * sizeof(wire::Pair),
                    sizeof(pair));
        fuzz_require(pair.row < h.n_rows && pair.expert < 8 && pair.expert % 2 == 0 &&
                         std::isfinite(pair.weight),
                     "valid pair");
      }
      return;
    }
    if (flags & 2) {
      wire::ReplyCheck check;
      check.expected_sequence = 1;
      check.layer = 1;
      check.n_rows = 2;
      check.hidden = 4;
      check.elem_bytes = elem_bytes;
      const std::string problem =
          wire::check_reply(message.data(), message.size(), check, shared_rows);
      if (!problem.empty()) throw Error(problem);
      fuzz_require(message.size() == sizeof(wire::Header) + (shared_rows ? 0 : 2 * 4 * elem_bytes),
                   "exact size");
      return;
    }
    if (flags & 8) {
      wire::HostPartialCheck check;
      check.expected_sequence = 1;
      check.layer = 1;
      check.max_rows = 8;
      check.hidden = 4;
      check.elem_bytes = 4;
      wire::Header h;
      const std::string problem =
          wire::check_host_partial(message.data(), message.size(), check, h);
      if (!problem.empty()) throw Error(problem);
      fuzz_require(h.n_rows <= 8, "rows within the limit");
      fuzz_require(message.size() == sizeof(wire::Header) + h.n_rows * (4 * 4 + 4),
                   "rows and row indices fill the message");
      uint32_t previous = 0;
      for (uint32_t i = 0; i < h.n_rows; ++i) {
        uint32_t row;
        std::memcpy(&row, message.data() + sizeof(wire::Header) + h.n_rows * 4 * 4 + i * 4,
                    sizeof(row));
        fuzz_require(row < 8 && (i == 0 || row > previous), "ascending row indices");
        previous = row;
      }
      return;
    }
    wire::RequestCheck check;
    check.expected_sequence = 1;
    check.num_layers = 3;
    check.max_rows = 8;
    check.top_k = 2;
    check.hidden = 4;
    check.num_experts = 8;
    check.elem_bytes = elem_bytes;
    check.owned = [](int, uint32_t expert) { return expert % 2 == 0; };
    wire::Header h;
    const std::string problem =
        wire::check_request(message.data(), message.size(), check, h, shared_rows);
    if (!problem.empty()) throw Error(problem);
    if (h.opcode == uint16_t(wire::Opcode::kShutdown) ||
        h.opcode == uint16_t(wire::Opcode::kCountersRequest)) {
      fuzz_require(message.size() == sizeof(wire::Header), "a header alone");
      return;
    }
    // A change of placement and a hint are words after the header, checked by their own rules.
    if (h.opcode == uint16_t(wire::Opcode::kPlacement) ||
        h.opcode == uint16_t(wire::Opcode::kPrefetchHint)) {
      fuzz_require(
          message.size() == sizeof(wire::Header) + h.payload_bytes && h.payload_bytes % 4 == 0,
          "whole words");
      return;
    }
    const bool shared = h.opcode == uint16_t(wire::Opcode::kSharedRequest);
    fuzz_require(!shared || shared_rows, "a shared request only with a segment");
    const size_t rows_bytes = shared ? 0 : size_t(h.n_rows) * 4 * elem_bytes;
    fuzz_require(h.n_rows <= 8, "rows within the limit");
    fuzz_require(sizeof(wire::Header) + rows_bytes + size_t(h.n_pairs) * sizeof(wire::Pair) +
                         size_t(h.n_rows) * 4 ==
                     message.size(),
                 "rows, pairs and row indices fill the message");
    for (uint32_t i = 0; i < h.n_pairs; ++i) {
      wire::Pair pair;
      std::memcpy(&pair,
                  message.data() + sizeof(wire::Header) + rows_bytes + i * sizeof(wire::Pair),
                  sizeof(pair));
      fuzz_require(pair.row < h.n_rows && pair.expert < 8 && pair.expert % 2 == 0 &&
                       std::isfinite(pair.weight),
                   "valid pair");
    }
  });
}
