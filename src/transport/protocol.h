// The coordinator <-> expert-rank data plane of the MPI transport: fixed opcodes and a fixed-size
// header in front of every message. Everything read from the wire is validated before use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "common/buffer.h"
#include "transport/checksum.h"

namespace colibri::wire {

constexpr uint32_t kMagic = 0x43'4f'4c'31;  // "COL1"
// 4: HELLO says why a rank sees no GPU; 5: heartbeat answers; 6: requests carry the coordinator's
// row indices, empty requests to host-mates, host partials (--combine host); 7: HELLO says
// whether NCCL is built, the plan carries the transport, NCCL count headers; 8: rows and
// partials through shared segments on the coordinator's host; 9: the checksum is lane sums of
// the payload (checksum) instead of its XXH3; 10: attention split by heads (kAttendRequest);
// 11: placement changes while the job runs (kPlacement), the plan's table has an epoch, hints
// of the next layer's experts (kPrefetchHint); 12: live counters while serving (kCountersRequest);
// 13: two exchanges in flight, a rank with a segment answers a kExpertRequest in the message
constexpr uint16_t kProtocolVersion = 13;

enum class Opcode : uint16_t {
  kExpertRequest = 1,  // coordinator -> owner: rows + (row, expert, weight) pairs of one layer
  kExpertReply = 2,    // owner -> coordinator: one pre-summed partial row per received row
  kShutdown = 3,       // coordinator -> owner: no more requests; send your report
  kHeartbeat = 4,      // on kTagControl, coordinator -> owner: alive, though no request comes;
                       // owner -> coordinator: the answer (alive, waiting for a request)
  kHostPartial = 5,    // on kTagHostPartial, expert rank -> its host leader (--combine host): its
                       // pre-summed partial rows and their coordinator row indices
  kNcclRequest = 6,    // NCCL transport, coordinator -> owner: the count header of a request
                       // whose payload (nccl_request_payload_bytes) follows in a second message
  kLinearRequest = 7,  // on kTagLinearRequest, coordinator -> a rank holding rows of a split
                       // linear (`layer`: its index in split_targets): the input rows, fp32
  kLinearReply = 8,    // on kTagLinearReply, the answer: that rank's output rows, fp32
  kAttendRequest = 9,  // on kTagLinearRequest, coordinator -> a rank attending for some heads of
                       // an MLA layer (split_linear.h): rows, KV block tables, chosen positions,
                       // new cache rows and the heads' queries; n_pairs: the tables
  kAttendReply = 10,   // on kTagLinearReply, the answer: those heads' outputs, fp32
  kPlacement = 11,  // on kTagRequest between steps, coordinator -> every expert rank: a change of
                    // placement (moe/placement_change.h), n_rows 0 = prepare, 1 = commit;
                    // n_pairs changes, the payload their u32 words; no reply
  kPrefetchHint = 12,     // on kTagRequest before a layer's request, coordinator -> an owner: the
                          // n_pairs experts (u32 each) of `layer` it will likely be asked for soon
                          // (--prefetch-ahead); no reply
  kCountersRequest = 13,  // on kTagRequest between steps, coordinator -> every expert rank: send
                          // your counters now; a header alone
  kCountersReply = 14,    // on kTagCounters, the answer: the rank's LiveCounters (common/
                          // profile.h) in cereal's binary form; n_rows is its rank
  // An expert rank on the coordinator's host that replies to it directly shares a segment of
  // memory with it (set up on kTagSharedSegment): the rows of a request and of a reply are
  // written there, and the message carries the rest.
  kSharedRequest = 16,  // a request whose rows are in the segment: the message has its pairs and
                        // row indices; the checksum is shared_checksum(rows, pairs and indices)
  kSharedReply = 17,    // a reply whose partial rows are in the segment: a header alone; the
                        // checksum is that of the rows. The answer to a kSharedRequest only: a
                        // kExpertRequest (the coordinator's second slot) gets a kExpertReply
};

// MPI tags: requests and replies never share a tag, so preposted receives match by kind.
constexpr int kTagRequest = 101;
constexpr int kTagReply = 102;
constexpr int kTagControl = 103;        // heartbeats and their answers: a header alone
constexpr int kTagCollective = 104;     // start-up and report collectives (transport/deadline.h)
constexpr int kTagHostPartial = 105;    // host-mate -> host leader partials (--combine host)
constexpr int kTagHostName = 106;       // each rank's host, before the first start-up step
constexpr int kTagSharedSegment = 107;  // an expert rank's segment (SharedSegmentOffer), and the
                                        // coordinator's answer (one byte: 1 = mapped)
constexpr int kTagLinearRequest = 108;  // split linears (tensor_parallel/split_linear.h)
constexpr int kTagLinearReply = 109;
constexpr int kTagCounters = 110;  // an expert rank's live counters (kCountersReply)

struct Header {
  uint32_t magic;
  uint16_t version;
  uint16_t opcode;
  uint32_t sequence;  // exchange counter, equal on both sides
  int32_t layer;
  uint32_t n_rows;
  uint32_t n_pairs;
  uint32_t payload_bytes;  // bytes after the header
  uint32_t checksum;       // of the payload
};
static_assert(sizeof(Header) == 32, "the header is part of the protocol");

// A header of this protocol's magic and version.
constexpr Header make_header(Opcode opcode, uint32_t sequence, int32_t layer, uint32_t n_rows,
                             uint32_t n_pairs, uint32_t payload_bytes, uint32_t checksum) {
  return {kMagic, kProtocolVersion, uint16_t(opcode), sequence, layer,
          n_rows, n_pairs,          payload_bytes,    checksum};
}

// (row, expert, weight) of one routed pair; `row` indexes the rows of this message.
struct Pair {
  uint32_t row;
  uint32_t expert;
  float weight;
};
static_assert(sizeof(Pair) == 12, "pairs are part of the protocol");

// dst[i] = 0 + src[i] for a row's first partial (the bits of a sum that starts at zero: 0 + -0
// is +0, with no pass that zeroes the rows first), else dst[i] += src[i]: how a combine adds a
// partial row.
void add_row(float* __restrict dst, const float* __restrict src, size_t count, bool first);

// The payload check: a Fletcher-style pair of sums in 16 lanes of 32-bit words (for each 64-byte
// block, the last one padded with zeros: a[l] += word l, then b[l] += a[l], mod 2^32), then
// XXH3-64 of the 32 sums seeded with the byte count, folded to 32 bits. The same value on every
// CPU, with the widest vectors it has (AVX-512, AVX2, else the build's). A change confined to one
// word is always seen; changes to several words of one lane go unseen where they cancel in both
// of its sums (the top bit of two words an even number of blocks apart). Bytes may be added in
// pieces of any length (the value is that of the whole), so that a pass that writes or reads the
// payload anyway checksums each piece while it is in cache.
class Checksum {
 public:
  Checksum();
  // One build of the sums (the tests'); without the others, add_copy and add_accumulate make two
  // passes.
  explicit Checksum(detail::SumBlocks sum_blocks, detail::CopySumBlocks copy_sum_blocks = nullptr,
                    detail::AddSumBlocks add_sum_blocks = nullptr);
  void add(const std::byte* data, size_t bytes);  // the next `bytes` of the payload
  // memcpy(dst, src, bytes) and add(src, bytes), each block of src loaded once: a sender that
  // writes the payload checksums it without reading it back.
  void add_copy(std::byte* dst, const std::byte* src, size_t bytes);
  // add(src, 4 * count) and, for the `count` fp32 values at src, dst[i] = 0 + src[i] when
  // `first`, else dst[i] += src[i]: a receiver that adds the payload checksums it as it adds.
  void add_accumulate(float* dst, const std::byte* src, size_t count, bool first);
  uint32_t value() const;  // of the bytes added so far

 private:
  detail::SumBlocks sum_blocks_;
  detail::CopySumBlocks copy_sum_blocks_;
  detail::AddSumBlocks add_sum_blocks_;
  uint32_t a_[detail::kLanes] = {}, b_[detail::kLanes] = {};
  std::byte pending_[detail::kBlockBytes] = {};  // the start of a block not yet summed
  size_t pending_bytes_ = 0;
  uint64_t bytes_ = 0;
};

// Writes `values` floats at src to dst in the wire type and adds the bytes written to `sum`: an
// fp32 wire copies and sums in one pass (Checksum::add_copy), without reading dst back.
void write_summed(const float* src, size_t values, ElemType wire_type, std::byte* dst,
                  Checksum& sum);

// The Checksum of `bytes` at `data`.
uint32_t checksum(const std::byte* data, size_t bytes);
// Of a message whose rows are in a shared segment: the rows' and the message payload's.
uint32_t shared_checksum(const std::byte* rows, size_t row_bytes, const std::byte* payload,
                         size_t payload_bytes);
// The same from the checksums of the rows and of the payload.
uint32_t shared_checksum(uint32_t rows_checksum, uint32_t payload_checksum);

// What an expert rank offers the coordinator on kTagSharedSegment: a memfd of `bytes` the
// coordinator maps through /proc/<pid>/fd/<fd> (pid -1: none). The segment's first 8 bytes hold
// `nonce` until the coordinator has mapped it: a pid that names another process (the ranks in
// different pid namespaces) is not taken for the rank's.
struct SharedSegmentOffer {
  int32_t pid;
  int32_t fd;
  uint64_t bytes;
  uint64_t nonce;
};
static_assert(sizeof(SharedSegmentOffer) == 24, "offers are part of the protocol");
// The same value computed without vector instructions, for the tests that check every build
// agrees with it.
uint32_t checksum_portable(const std::byte* data, size_t bytes);

// Request payload: rows [n_rows, hidden] in the wire element type (`elem_bytes` each, agreed at
// start-up), then n_pairs Pairs (unaligned when the rows are bf16 and hidden is odd), then n_rows
// uint32 coordinator row indices, strictly ascending. A request with no rows (and no pairs) goes
// to an expert rank with nothing to compute whose host leader waits for its (empty) partial.
constexpr size_t request_payload_bytes(uint32_t n_rows, uint32_t n_pairs, int hidden,
                                       size_t elem_bytes) {
  return size_t(n_rows) * size_t(hidden) * elem_bytes + size_t(n_pairs) * sizeof(Pair) +
         size_t(n_rows) * sizeof(uint32_t);
}
// Host partial payload: rows [n_rows, hidden] (fp32 whatever the wire type, so that a host's sum
// is rounded to the wire type once, by its leader; `elem_bytes` 4), then n_rows uint32
// coordinator row indices, strictly ascending.
constexpr size_t host_partial_payload_bytes(uint32_t n_rows, int hidden, size_t elem_bytes) {
  return size_t(n_rows) * size_t(hidden) * elem_bytes + size_t(n_rows) * sizeof(uint32_t);
}
constexpr size_t reply_payload_bytes(uint32_t n_rows, int hidden, size_t elem_bytes) {
  return size_t(n_rows) * size_t(hidden) * elem_bytes;
}
// A kSharedRequest's message payload: the pairs and row indices of request_payload_bytes.
constexpr size_t shared_request_payload_bytes(uint32_t n_rows, uint32_t n_pairs) {
  return size_t(n_pairs) * sizeof(Pair) + size_t(n_rows) * sizeof(uint32_t);
}

// What a valid request must agree with on the receiving expert rank.
struct RequestCheck {
  uint32_t expected_sequence = 0;
  int num_layers = 0, max_rows = 0, top_k = 0, hidden = 0, num_experts = 0;
  size_t elem_bytes = 4;
  std::function<bool(int layer, uint32_t expert)> owned;  // this rank owns it; empty: any
};

// Checks a kCountersReply of `bytes` from expert rank `rank` (its header, sequence and payload
// checksum); returns "" when valid, else what is wrong with it. The payload is its counters.
std::string check_counters_reply(const std::byte* message, size_t bytes, uint32_t expected_sequence,
                                 int rank, Header& header);

// Validates one request message (header + payload, `bytes` long) and copies its header out.
// Returns "" when valid (a shutdown carries no payload), else what is wrong with it. A
// kSharedRequest's rows are read from `shared_rows` (null: this rank has no segment, and such a
// request is invalid).
std::string check_request(const std::byte* message, size_t bytes, const RequestCheck& check,
                          Header& header, const std::byte* shared_rows = nullptr);

// What a valid reply must agree with on the coordinator.
struct ReplyCheck {
  uint32_t expected_sequence = 0;
  int layer = 0;
  uint32_t n_rows = 0;  // rows sent to that owner
  int hidden = 0;
  size_t elem_bytes = 4;
};

// NCCL transport (transport/nccl_transport.h): a receive must be sized before it is posted, so
// every request is a count header alone (opcode kNcclRequest, or kShutdown with no counts), then
// the payload: rows [n_rows, hidden] in the wire type, then n_pairs Pairs (no row indices). The
// header's checksum covers the pairs only (the rows stay in device memory).
constexpr size_t nccl_request_payload_bytes(uint32_t n_rows, uint32_t n_pairs, int hidden,
                                            size_t elem_bytes) {
  return size_t(n_rows) * size_t(hidden) * elem_bytes + size_t(n_pairs) * sizeof(Pair);
}
// The count header of a request (kNcclRequest) or of a shutdown (n_rows = n_pairs = 0,
// `pairs` null).
Header nccl_count_header(Opcode opcode, uint32_t sequence, int layer, uint32_t n_rows,
                         uint32_t n_pairs, int hidden, size_t elem_bytes, const std::byte* pairs);
// Validates a count header (`bytes` long) against the limits in `check` (its `owned` is not used
// here) and copies it out. Returns "" when valid, else what is wrong with it.
std::string check_nccl_count_header(const std::byte* message, size_t bytes,
                                    const RequestCheck& check, Header& header);
// Validates the pairs that followed a valid count header: checksum, rows, experts, ownership.
std::string check_nccl_pairs(const std::byte* pairs, const Header& header,
                             const RequestCheck& check);

// Validates one reply message (header + partial rows; or, when `shared_rows` is set, a
// kSharedReply header whose rows are there). Returns "" when valid, else what is wrong.
std::string check_reply(const std::byte* message, size_t bytes, const ReplyCheck& check,
                        const std::byte* shared_rows = nullptr);
// check_reply but for the checksum, which the caller compares with the Checksum of the partial
// rows as it reads them (in the message after the header, or in the segment when `shared`).
// Copies the header out.
std::string check_reply_header(const std::byte* message, size_t bytes, const ReplyCheck& check,
                               bool shared, Header& header);

// What a valid host partial must agree with on the host leader.
struct HostPartialCheck {
  uint32_t expected_sequence = 0;  // the leader's own request's: host-mates get every request
  int layer = 0;
  int max_rows = 0;
  int hidden = 0;
  size_t elem_bytes = 4;
};

// Validates one host partial (header + rows + row indices) and copies its header out. Returns ""
// when valid, else what is wrong.
std::string check_host_partial(const std::byte* message, size_t bytes,
                               const HostPartialCheck& check, Header& header);

}  // namespace colibri::wire
