// The payload of an attention request (tensor_parallel/attend_request.h): a well-formed one is read
// in place and its rows' key slots come from their KV tables; each field out of range, and a
// payload too short or too long, is refused with what is wrong, before anything is read past it.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tensor_parallel/attend_request.h"

namespace colibri {
namespace {

// Three rows of two sequences in a pool of 10 blocks of 4 tokens: row 0 sees positions 0..6 of
// table 0 (blocks 7, 2), row 1 the indexer's 1, 4, 7 of the same table, row 2 positions 0..2 of
// table 1 (block 5). Cache rows of 3 floats, 2 heads of 2 query values.
struct Request {
  std::vector<RemoteHeads::Row> rows{{0, 6, 0}, {0, 7, 3}, {1, 2, 0}};
  std::vector<int32_t> offsets{0, 2, 3};
  std::vector<int32_t> blocks{7, 2, 5};
  std::vector<int32_t> selected{1, 4, 7};
  std::vector<float> cache_rows = std::vector<float>(9, 0.5f);
  std::vector<float> q = std::vector<float>(12, 0.25f);
  uint32_t tables = 2;
  int extra_bytes = 0;  // added to (or, negative, cut from) the payload's stated size

  std::vector<std::byte> payload() const {
    std::vector<std::byte> p;
    const auto add = [&](const void* data, size_t bytes) {
      const auto* b = static_cast<const std::byte*>(data);
      p.insert(p.end(), b, b + bytes);
    };
    add(rows.data(), rows.size() * sizeof(RemoteHeads::Row));
    add(offsets.data(), offsets.size() * 4);
    add(blocks.data(), blocks.size() * 4);
    add(selected.data(), selected.size() * 4);
    add(cache_rows.data(), cache_rows.size() * 4);
    add(q.data(), q.size() * 4);
    p.resize(p.size() + 8);  // room past the stated end
    return p;
  }

  // parse_attend_request's verdict on it ("" when well formed).
  std::string parse(AttendRequest& out) const {
    const std::vector<std::byte> p = payload();
    wire::Header h{};
    h.n_rows = uint32_t(rows.size());
    h.n_pairs = tables;
    h.payload_bytes = uint32_t(int(p.size()) - 8 + extra_bytes);
    AttendLimits limits;
    limits.kv_blocks = 10;
    limits.block_tokens = 4;
    limits.max_selected = 4;
    limits.cache_row = 3;
    limits.heads = 2;
    limits.qk_head_dim = 2;
    bytes_ = p;
    return parse_attend_request(h, bytes_.data(), limits, out);
  }
  std::string parse() const {
    AttendRequest out;
    return parse(out);
  }
  mutable std::vector<std::byte> bytes_;  // what the last parse read, kept for its pointers
};

TEST(AttendRequest, AWellFormedRequestIsReadInPlaceWithItsRowsKeySlots) {
  const Request r;
  AttendRequest a;
  ASSERT_EQ(r.parse(a), "");
  EXPECT_EQ(a.n, 3);
  EXPECT_EQ(a.tables, 2);
  EXPECT_EQ(a.max_keys, 7);
  EXPECT_EQ(a.cache_rows[8], 0.5f);
  EXPECT_EQ(a.q[11], 0.25f);
  const RequestKeys keys(a, 4);
  std::vector<int32_t> slots(8, -1);
  ASSERT_EQ(keys.fill(0, slots.data()), 7);
  EXPECT_EQ(slots, (std::vector<int32_t>{28, 29, 30, 31, 8, 9, 10, -1}));
  ASSERT_EQ(keys.fill(1, slots.data()), 3);
  EXPECT_EQ(std::vector<int32_t>(slots.begin(), slots.begin() + 3),
            (std::vector<int32_t>{29, 8, 11}));
  ASSERT_EQ(keys.fill(2, slots.data()), 3);
  EXPECT_EQ(std::vector<int32_t>(slots.begin(), slots.begin() + 3),
            (std::vector<int32_t>{20, 21, 22}));
  EXPECT_EQ(a.slot(2, 2, 4), 22);  // where row 2's own cache row goes
}

TEST(AttendRequest, EachFieldOutOfRangeIsRefusedWithWhatIsWrong) {
  struct Case {
    const char* what;
    void (*change)(Request&);
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"no table", [](Request& r) { r.tables = 0; }, "0 KV tables for 3 rows"},
      {"more tables than rows", [](Request& r) { r.tables = 4; }, "4 KV tables for 3 rows"},
      {"a table past the pool", [](Request& r) { r.offsets[2] = 11; },
       "KV table 1 at blocks 2..11"},
      {"tables out of order",
       [](Request& r) {
         r.offsets = {0, 3, 2};
       },
       "KV table 1 at blocks 3..2"},
      {"offsets not from 0", [](Request& r) { r.offsets[0] = 1; }, "KV table 0 at blocks 1..2"},
      {"a block past the pool", [](Request& r) { r.blocks[1] = 10; },
       "KV block 10 of a pool of 10"},
      {"a negative block", [](Request& r) { r.blocks[0] = -1; }, "KV block -1"},
      {"a position past its table", [](Request& r) { r.rows[2].pos = 4; },
       "row 2: position 4 of KV table 1 (4 positions)"},
      {"a negative position", [](Request& r) { r.rows[0].pos = -1; }, "row 0: position -1"},
      {"a table that does not exist", [](Request& r) { r.rows[0].table = 2; },
       "row 0: position 6 of KV table 2 (0 positions)"},
      {"more chosen than the top-k", [](Request& r) { r.rows[1].selected = 5; },
       "5 chosen of at most 4"},
      {"a negative count chosen", [](Request& r) { r.rows[1].selected = -1; }, "-1 chosen"},
      {"a chosen position after the row's", [](Request& r) { r.selected[2] = 8; },
       "row 1 chose position 8, outside its 0..7"},
      {"a negative chosen position", [](Request& r) { r.selected[0] = -3; },
       "row 1 chose position -3"},
      {"a payload cut short", [](Request& r) { r.extra_bytes = -4; }, "too short for its queries"},
      {"a payload without its blocks", [](Request& r) { r.extra_bytes = -100; },
       "too short for its"},
      {"bytes past the queries", [](Request& r) { r.extra_bytes = 4; }, "4 bytes past the queries"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Request r;
    c.change(r);
    const std::string problem = r.parse();
    EXPECT_NE(problem.find(c.expected), std::string::npos) << problem;
  }
}

}  // namespace
}  // namespace colibri
