// The wire checksum (transport/protocol.h): every instruction-set build gives the scalar build's
// value for every length and alignment, added at once or in pieces, and it sees what a transport
// could get wrong; the checks of requests (row indices, empty requests, shared segments) and host
// partials; the counters a rank sends while serving.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/profile.h"
#include "common/serialize.h"
#include "transport/checksum.h"
#include "transport/protocol.h"

namespace colibri::wire {
namespace {

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (std::byte& b : v) b = std::byte(rng() & 0xFF);
  return v;
}

TEST(WireChecksum, EveryBuildGivesTheScalarValue) {
  std::vector<std::pair<const char*, detail::SumBlocks>> builds = {
      {"baseline", detail::sum_blocks_baseline}};
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) builds.push_back({"avx2", detail::sum_blocks_avx2});
  if (__builtin_cpu_supports("avx512f")) builds.push_back({"avx512", detail::sum_blocks_avx512});
#endif
  // Blocks of 64 bytes, a partial last block, and rows of 6144 fp32 values.
  for (size_t n : {0, 1, 3, 4, 63, 64, 65, 127, 128, 129, 1000, 4096, 24576, 49153, 1572864})
    for (size_t offset : {0, 1, 3}) {
      const std::vector<std::byte> v = random_bytes(n + offset, uint32_t(n * 7 + offset));
      const std::byte* data = v.data() + offset;
      const uint32_t reference = checksum_portable(data, n);
      EXPECT_EQ(checksum(data, n), reference) << "dispatched: " << n << " bytes at " << offset;
      for (const auto& [name, build] : builds)
        EXPECT_EQ(detail::checksum_with(build, data, n), reference)
            << name << ": " << n << " bytes at offset " << offset;
    }
}

// Bytes added in pieces give the value of the whole, whatever the pieces' lengths.
TEST(WireChecksum, PiecesGiveTheValueOfTheWhole) {
  const std::vector<std::byte> v = random_bytes(24576 * 3 + 10, 5);
  const uint32_t whole = checksum(v.data(), v.size());
  for (size_t piece : {1, 3, 12, 63, 64, 65, 100, 24576}) {
    Checksum sum;
    for (size_t at = 0; at < v.size(); at += piece)
      sum.add(v.data() + at, std::min(piece, v.size() - at));
    EXPECT_EQ(sum.value(), whole) << "pieces of " << piece;
  }
  Checksum sum;
  sum.add(v.data(), 5);
  sum.add(v.data() + 5, 0);
  sum.add(v.data() + 5, v.size() - 5);
  EXPECT_EQ(sum.value(), whole);
  EXPECT_EQ(sum.value(), whole);  // value() leaves the sums as they were
}

struct SumBuild {
  const char* name;
  detail::SumBlocks sum;
  detail::CopySumBlocks copy_sum;
  detail::AddSumBlocks add_sum;
};

// Every build of the one-pass sums this CPU runs, and the sums alone (two passes).
std::vector<SumBuild> one_pass_builds() {
  std::vector<SumBuild> builds = {
      {"two passes", detail::sum_blocks_baseline, nullptr, nullptr},
      {"baseline", detail::sum_blocks_baseline, detail::copy_sum_blocks_baseline,
       detail::add_sum_blocks_baseline}};
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2"))
    builds.push_back({"avx2", detail::sum_blocks_avx2, detail::copy_sum_blocks_avx2,
                      detail::add_sum_blocks_avx2});
  if (__builtin_cpu_supports("avx512f"))
    builds.push_back({"avx512", detail::sum_blocks_avx512, detail::copy_sum_blocks_avx512,
                      detail::add_sum_blocks_avx512});
#endif
  return builds;
}

// add_copy is memcpy then add: the same bytes and the same value, in any pieces and alignment.
TEST(WireChecksum, CopyingGivesTheBytesAndTheValue) {
  for (const SumBuild& build : one_pass_builds())
    for (size_t n : {0, 1, 63, 64, 65, 1000, 24576, 24576 * 3 + 10})
      for (size_t offset : {0, 1})
        for (size_t first_piece : {0, 3, 64, 100}) {
          const std::vector<std::byte> v = random_bytes(n + offset, uint32_t(n + offset));
          const std::byte* src = v.data() + offset;
          std::vector<std::byte> dst(n + 3, std::byte{0x5a});
          Checksum sum(build.sum, build.copy_sum, build.add_sum);
          const size_t head = std::min(first_piece, n);
          sum.add_copy(dst.data() + 1, src, head);
          sum.add_copy(dst.data() + 1 + head, src + head, n - head);
          EXPECT_EQ(sum.value(), checksum_portable(src, n))
              << build.name << ": " << n << " bytes at " << offset << ", first " << head;
          EXPECT_TRUE(std::equal(src, src + n, dst.data() + 1)) << build.name << ": " << n;
          EXPECT_EQ(dst[0], std::byte{0x5a});
          EXPECT_EQ(dst[n + 1], std::byte{0x5a}) << build.name << ": written past the end";
        }
}

// add_accumulate is add, then 0 + src or dst + src value by value: the same value, and the sums
// with the bits of that loop, in any pieces (whole values) and alignment.
TEST(WireChecksum, AccumulatingGivesTheSumsAndTheValue) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (const SumBuild& build : one_pass_builds())
    for (size_t count : {1, 15, 16, 17, 40, 6144, 6144 * 2 + 5})
      for (size_t offset : {0, 4, 1})
        for (size_t first_piece : {0, 3, 16, 33})
          for (bool first : {true, false}) {
            std::vector<float> values(count), before(count + 1);
            for (float& x : values) x = normal(rng);
            for (float& x : before) x = normal(rng);
            values[0] = -0.0f;  // 0 + -0 is +0: the bits of a sum that starts at zero
            std::vector<std::byte> src(count * sizeof(float) + offset);
            std::memcpy(src.data() + offset, values.data(), count * sizeof(float));
            std::vector<float> dst = before;
            Checksum sum(build.sum, build.copy_sum, build.add_sum);
            const size_t head = std::min(first_piece, count);
            sum.add_accumulate(dst.data(), src.data() + offset, head, first);
            sum.add_accumulate(dst.data() + head, src.data() + offset + head * sizeof(float),
                               count - head, first);
            EXPECT_EQ(sum.value(), checksum_portable(src.data() + offset, count * sizeof(float)))
                << build.name << ": " << count << " values at " << offset;
            for (size_t i = 0; i < count; ++i) {
              const float expected = (first ? 0.0f : before[i]) + values[i];
              ASSERT_EQ(std::memcmp(&dst[i], &expected, sizeof(float)), 0)
                  << build.name << ": value " << i << " of " << count << (first ? ", first" : "");
            }
            EXPECT_EQ(dst[count], before[count]) << build.name << ": written past the end";
          }
}

// add_row, the combines' add of a partial row: 0 + src for a row's first partial (so -0 becomes
// +0, as in a sum that starts at zero), dst + src after; nothing written past the row.
TEST(WireAddRow, FirstPartialStartsAtZeroLaterOnesAdd) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (size_t count : {1, 7, 8, 33, 6144})
    for (bool first : {true, false}) {
      std::vector<float> src(count), before(count + 1);
      for (float& x : src) x = normal(rng);
      for (float& x : before) x = normal(rng);
      src[0] = -0.0f;
      std::vector<float> dst = before;
      add_row(dst.data(), src.data(), count, first);
      for (size_t i = 0; i < count; ++i) {
        const float expected = (first ? 0.0f : before[i]) + src[i];
        ASSERT_EQ(std::memcmp(&dst[i], &expected, sizeof(float)), 0)
            << "value " << i << " of " << count << (first ? ", first" : "");
      }
      EXPECT_EQ(dst[count], before[count]) << "written past the end";
    }
}

// The values are part of the protocol (version 9): a change to the function shows here.
TEST(WireChecksum, KnownValues) {
  std::vector<std::byte> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::byte(i * 31 + 7);
  EXPECT_EQ(checksum(v.data(), 0), 0x77f3e6d3u);
  EXPECT_EQ(checksum(v.data(), 1), 0x72dd28d5u);
  EXPECT_EQ(checksum(v.data(), 64), 0x3c893dc3u);
  EXPECT_EQ(checksum(v.data(), 100), 0x831b9540u);
  EXPECT_EQ(checksum(v.data(), 1000), 0x4ab75437u);
}

TEST(WireChecksum, SeesFlipsSwapsAndLength) {
  std::vector<std::byte> v = random_bytes(49152, 1);
  const uint32_t base = checksum(v.data(), v.size());
  for (size_t at : {size_t(0), size_t(8191), size_t(16384), size_t(32767), v.size() - 1})
    for (int bit = 0; bit < 8; bit += 3) {
      v[at] ^= std::byte(1 << bit);
      EXPECT_NE(checksum(v.data(), v.size()), base) << "bit " << bit << " of byte " << at;
      v[at] ^= std::byte(1 << bit);
    }
  // Two 8-byte words exchanged: within a block, across blocks in other lanes and in the same
  // lanes, and two whole rows of 6144 fp32 values.
  for (auto [a, b] : {std::pair<size_t, size_t>{0, 8}, {8, 16400}, {8, 16392}}) {
    std::vector<std::byte> w = v;
    std::swap_ranges(w.begin() + long(a), w.begin() + long(a) + 8, w.begin() + long(b));
    EXPECT_NE(checksum(w.data(), w.size()), base) << a << " <-> " << b;
  }
  {
    std::vector<std::byte> w = v;
    std::swap_ranges(w.begin(), w.begin() + 24576, w.begin() + 24576);
    EXPECT_NE(checksum(w.data(), w.size()), base) << "rows exchanged";
  }
  // Every single-byte change (the corrupt_reply_at_layer fault's) anywhere in a block.
  for (size_t at = 0; at < 64; ++at) {
    v[at + 4096] ^= std::byte{0x5a};
    EXPECT_NE(checksum(v.data(), v.size()), base) << "byte " << at + 4096;
    v[at + 4096] ^= std::byte{0x5a};
  }
  // A truncated payload, and one padded with zeros.
  EXPECT_NE(checksum(v.data(), v.size() - 8), base);
  std::vector<std::byte> padded = v;
  padded.resize(v.size() + 8);
  EXPECT_NE(checksum(padded.data(), padded.size()), base);
  EXPECT_EQ(checksum(v.data(), v.size()), base);
}

// A message of `opcode` with `payload`, its header filled in as a sender does.
std::vector<std::byte> message(Opcode opcode, uint32_t n_rows, uint32_t n_pairs,
                               const std::vector<std::byte>& payload) {
  const Header header{kMagic,
                      kProtocolVersion,
                      uint16_t(opcode),
                      1,
                      1,
                      n_rows,
                      n_pairs,
                      uint32_t(payload.size()),
                      checksum(payload.data(), payload.size())};
  std::vector<std::byte> out(sizeof(Header) + payload.size());
  std::memcpy(out.data(), &header, sizeof(Header));
  if (!payload.empty()) std::memcpy(out.data() + sizeof(Header), payload.data(), payload.size());
  return out;
}

void append(std::vector<std::byte>& bytes, const void* data, size_t n) {
  const auto* p = static_cast<const std::byte*>(data);
  bytes.insert(bytes.end(), p, p + n);
}

// Protocol 6: requests carry the coordinator's row indices; a host-mate with nothing to compute
// gets an empty request; host partials carry fp32 rows and their row indices.
// What the first request of a small exchange is checked against: 3 layers, 8 rows of 2 values,
// top-2 of 4 experts.
RequestCheck small_request_check() {
  RequestCheck check;
  check.expected_sequence = 1;
  check.num_layers = 3;
  check.max_rows = 8;
  check.top_k = 2;
  check.hidden = 2;
  check.num_experts = 4;
  return check;
}

TEST(WireMessages, RowIndicesEmptyRequestsAndHostPartials) {
  const RequestCheck request_check = small_request_check();
  Header h;
  EXPECT_EQ(check_request(message(Opcode::kExpertRequest, 0, 0, {}).data(), sizeof(Header),
                          request_check, h),
            "");
  const auto request = [&](uint32_t first_row, uint32_t second_row) {
    std::vector<std::byte> payload;
    const float rows[4] = {1, 2, 3, 4};
    append(payload, rows, sizeof(rows));
    const Pair pairs[2] = {{0, 1, 0.5f}, {1, 2, 0.5f}};
    append(payload, pairs, sizeof(pairs));
    const uint32_t indices[2] = {first_row, second_row};
    append(payload, indices, sizeof(indices));
    const std::vector<std::byte> m = message(Opcode::kExpertRequest, 2, 2, payload);
    return check_request(m.data(), m.size(), request_check, h);
  };
  EXPECT_EQ(request(3, 7), "");
  EXPECT_NE(request(7, 3).find("out of order"), std::string::npos);
  EXPECT_NE(request(3, 3).find("out of order"), std::string::npos);
  EXPECT_NE(request(3, 8).find("out of range"), std::string::npos);

  HostPartialCheck partial_check;
  partial_check.expected_sequence = 1;
  partial_check.layer = 1;
  partial_check.max_rows = 8;
  partial_check.hidden = 2;
  const auto partial = [&](uint32_t n_rows, std::vector<uint32_t> indices) {
    std::vector<std::byte> payload;
    const std::vector<float> rows(size_t(n_rows) * 2, 1.0f);
    append(payload, rows.data(), rows.size() * sizeof(float));
    append(payload, indices.data(), indices.size() * sizeof(uint32_t));
    const std::vector<std::byte> m = message(Opcode::kHostPartial, n_rows, 0, payload);
    return check_host_partial(m.data(), m.size(), partial_check, h);
  };
  EXPECT_EQ(partial(0, {}), "");
  EXPECT_EQ(partial(2, {0, 5}), "");
  EXPECT_NE(partial(2, {5, 0}).find("out of order"), std::string::npos);
  EXPECT_NE(partial(2, {0}).find("bytes"), std::string::npos);
  // A reply where a host partial is expected.
  std::vector<std::byte> reply_payload(2 * 2 * sizeof(float));
  const std::vector<std::byte> reply = message(Opcode::kExpertReply, 2, 0, reply_payload);
  EXPECT_NE(check_host_partial(reply.data(), reply.size(), partial_check, h).find("opcode"),
            std::string::npos);
}

// Protocol 11: a change of placement (layer -1, phase 0 or 1 in n_rows, u32 words) and a hint
// of a later layer's experts (in range, one u32 each) are accepted; a bad phase, a layer on a
// change, an expert out of range or a payload that disagrees with its count are refused.
TEST(WireMessages, PlacementChangesAndPrefetchHints) {
  const RequestCheck check = small_request_check();
  Header h;
  const auto with_layer = [](std::vector<std::byte> m, int32_t layer) {
    std::memcpy(m.data() + offsetof(Header, layer), &layer, sizeof(layer));
    return m;
  };
  const auto words = [](std::vector<uint32_t> w) {
    std::vector<std::byte> bytes;
    append(bytes, w.data(), w.size() * 4);
    return bytes;
  };
  const auto verdict = [&](const std::vector<std::byte>& m) {
    return check_request(m.data(), m.size(), check, h);
  };
  const std::vector<std::byte> change = words({7, 1, 2, 1, 3});  // epoch 7: (1, 2) -> rank 3
  EXPECT_EQ(verdict(with_layer(message(Opcode::kPlacement, 0, 1, change), -1)), "");
  EXPECT_EQ(verdict(with_layer(message(Opcode::kPlacement, 1, 1, change), -1)), "");
  EXPECT_NE(verdict(with_layer(message(Opcode::kPlacement, 2, 1, change), -1)).find("phase"),
            std::string::npos);
  EXPECT_NE(verdict(message(Opcode::kPlacement, 0, 1, change)).find("layer"), std::string::npos);
  std::vector<std::byte> odd = change;
  odd.pop_back();
  EXPECT_NE(verdict(with_layer(message(Opcode::kPlacement, 0, 1, odd), -1)).find("bytes"),
            std::string::npos);

  EXPECT_EQ(verdict(message(Opcode::kPrefetchHint, 0, 2, words({0, 3}))), "");
  EXPECT_NE(verdict(message(Opcode::kPrefetchHint, 0, 2, words({0, 4}))).find("out of range"),
            std::string::npos);
  EXPECT_NE(verdict(message(Opcode::kPrefetchHint, 0, 3, words({0, 3}))).find("a hint of 3"),
            std::string::npos);
  EXPECT_NE(
      verdict(with_layer(message(Opcode::kPrefetchHint, 0, 1, words({0})), 3)).find("layer 3"),
      std::string::npos);
  std::vector<std::byte> flipped = message(Opcode::kPrefetchHint, 0, 2, words({0, 3}));
  flipped.back() ^= std::byte{1};
  EXPECT_NE(verdict(flipped).find("checksum"), std::string::npos);
}

// Protocol 12: a request for counters is a header alone; the answer names its rank in n_rows,
// layer -1, the request's sequence, and carries the rank's LiveCounters, which read back equal.
TEST(WireMessages, CountersRequestsAndReplies) {
  const RequestCheck check = small_request_check();
  Header h;
  const auto with_layer = [](std::vector<std::byte> m, int32_t layer) {
    std::memcpy(m.data() + offsetof(Header, layer), &layer, sizeof(layer));
    return m;
  };
  const std::vector<std::byte> ask = message(Opcode::kCountersRequest, 0, 0, {});
  EXPECT_EQ(check_request(ask.data(), ask.size(), check, h), "");
  const std::vector<std::byte> ask_more = message(Opcode::kCountersRequest, 0, 0, {std::byte{1}});
  EXPECT_NE(check_request(ask_more.data(), ask_more.size(), check, h).find("payload"),
            std::string::npos);

  LiveCounters c;
  c.rank = 2;
  c.wall_us = 1e6;
  c.busy_us = 1234.5;
  c.wait_us = 9e5;
  c.rows = 7;
  c.experts = 28;
  c.bytes_in = 100;
  c.bytes_out = 200;
  c.store.pinned_hits = 3;
  c.store.disk_hits = 4;
  c.store.disk_bytes_read = 5 << 20;
  c.device.vram_uploads = 6;
  const std::string bytes = to_bytes(c);
  std::vector<std::byte> payload(bytes.size());
  std::memcpy(payload.data(), bytes.data(), bytes.size());
  const std::vector<std::byte> answer =
      with_layer(message(Opcode::kCountersReply, 2, 0, payload), -1);
  ASSERT_EQ(check_counters_reply(answer.data(), answer.size(), 1, 2, h), "");
  const auto back = from_bytes<LiveCounters>(
      std::string(reinterpret_cast<const char*>(answer.data()) + sizeof(Header), h.payload_bytes));
  EXPECT_EQ(back.rank, 2);
  EXPECT_EQ(back.busy_us, c.busy_us);
  EXPECT_EQ(back.experts, c.experts);
  EXPECT_EQ(back.store.disk_hits, c.store.disk_hits);
  EXPECT_EQ(back.store.disk_bytes_read, c.store.disk_bytes_read);
  EXPECT_EQ(back.device.vram_uploads, c.device.vram_uploads);

  EXPECT_NE(check_counters_reply(answer.data(), answer.size(), 2, 2, h).find("sequence"),
            std::string::npos);
  EXPECT_NE(check_counters_reply(answer.data(), answer.size(), 1, 1, h).find("rank 2"),
            std::string::npos);
  EXPECT_NE(check_counters_reply(answer.data(), answer.size() - 1, 1, 2, h).find("bytes"),
            std::string::npos);
  std::vector<std::byte> flipped = answer;
  flipped.back() ^= std::byte{1};
  EXPECT_NE(check_counters_reply(flipped.data(), flipped.size(), 1, 2, h).find("checksum"),
            std::string::npos);
  const std::vector<std::byte> reply = with_layer(message(Opcode::kExpertReply, 2, 0, payload), -1);
  EXPECT_NE(check_counters_reply(reply.data(), reply.size(), 1, 2, h).find("opcode"),
            std::string::npos);
}

// Protocol 7: rows in a shared segment. A request's message holds its pairs and row indices and
// a checksum over those and the segment's rows; a reply is a header whose checksum covers the
// segment's partial rows. Either is refused by a rank without a segment, and a byte changed in
// the segment after the checksum was taken is seen.
TEST(WireMessages, SharedSegmentRequestsAndReplies) {
  RequestCheck request_check;
  request_check.expected_sequence = 1;
  request_check.num_layers = 3;
  request_check.max_rows = 8;
  request_check.top_k = 2;
  request_check.hidden = 2;
  request_check.num_experts = 4;
  std::vector<std::byte> segment_rows;
  const float rows[4] = {1, 2, 3, 4};
  append(segment_rows, rows, sizeof(rows));
  std::vector<std::byte> payload;
  const Pair pairs[2] = {{0, 1, 0.5f}, {1, 2, 0.5f}};
  append(payload, pairs, sizeof(pairs));
  const uint32_t indices[2] = {3, 7};
  append(payload, indices, sizeof(indices));
  ASSERT_EQ(payload.size(), shared_request_payload_bytes(2, 2));
  std::vector<std::byte> m = message(Opcode::kSharedRequest, 2, 2, payload);
  const uint32_t sum =
      shared_checksum(segment_rows.data(), segment_rows.size(), payload.data(), payload.size());
  std::memcpy(m.data() + offsetof(Header, checksum), &sum, sizeof(sum));
  Header h;
  EXPECT_EQ(check_request(m.data(), m.size(), request_check, h, segment_rows.data()), "");
  EXPECT_EQ(h.opcode, uint16_t(Opcode::kSharedRequest));
  EXPECT_NE(check_request(m.data(), m.size(), request_check, h).find("shared segment"),
            std::string::npos);
  segment_rows[5] ^= std::byte{0x10};
  EXPECT_NE(
      check_request(m.data(), m.size(), request_check, h, segment_rows.data()).find("checksum"),
      std::string::npos);
  segment_rows[5] ^= std::byte{0x10};
  // The same bytes as a plain request (rows in the message) are not a shared request.
  std::vector<std::byte> plain_payload = segment_rows;
  append(plain_payload, payload.data(), payload.size());
  const std::vector<std::byte> plain = message(Opcode::kExpertRequest, 2, 2, plain_payload);
  EXPECT_EQ(check_request(plain.data(), plain.size(), request_check, h, segment_rows.data()), "");

  ReplyCheck reply_check;
  reply_check.expected_sequence = 1;
  reply_check.layer = 1;
  reply_check.n_rows = 2;
  reply_check.hidden = 2;
  std::vector<std::byte> reply = message(Opcode::kSharedReply, 2, 0, {});
  const uint32_t reply_sum = checksum(segment_rows.data(), segment_rows.size());
  std::memcpy(reply.data() + offsetof(Header, checksum), &reply_sum, sizeof(reply_sum));
  EXPECT_EQ(check_reply(reply.data(), reply.size(), reply_check, segment_rows.data()), "");
  EXPECT_NE(check_reply(reply.data(), reply.size(), reply_check).find("opcode"), std::string::npos);
  segment_rows[0] ^= std::byte{0x01};
  EXPECT_NE(
      check_reply(reply.data(), reply.size(), reply_check, segment_rows.data()).find("checksum"),
      std::string::npos);
  // A plain reply where the segment holds the rows: refused.
  const std::vector<std::byte> plain_reply = message(Opcode::kExpertReply, 2, 0, segment_rows);
  EXPECT_NE(check_reply(plain_reply.data(), plain_reply.size(), reply_check, segment_rows.data())
                .find("opcode"),
            std::string::npos);
}

}  // namespace
}  // namespace colibri::wire
