#include "tensor_parallel/split_linear.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/error.h"
#include "tensor_parallel/attend_request.h"
#include "transport/deadline.h"
#include "transport/mpi_check.h"

namespace colibri {

namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

wire::Header linear_header(wire::Opcode opcode, uint32_t sequence, int target, int64_t n,
                           size_t payload_bytes, uint32_t checksum, uint32_t n_pairs = 0) {
  return {wire::kMagic, wire::kProtocolVersion,  uint16_t(opcode), sequence, target, uint32_t(n),
          n_pairs,      uint32_t(payload_bytes), checksum};
}

template <typename T>
const std::byte* bytes_of(const T* p) {
  return reinterpret_cast<const std::byte*>(p);
}

// What is wrong with a message of `bytes` that should be `opcode` with `sequence` and 1..max_rows
// rows; "" when nothing. The header is copied out; the caller checks its layer and n_pairs.
std::string check_header(const std::byte* message, size_t bytes, wire::Opcode opcode,
                         uint32_t sequence, int max_rows, wire::Header& h) {
  if (bytes < kHeaderBytes) return fmt::format("{} bytes, shorter than a header", bytes);
  std::memcpy(&h, message, kHeaderBytes);
  if (h.magic != wire::kMagic) return fmt::format("bad magic {:#x}", h.magic);
  if (h.version != wire::kProtocolVersion)
    return fmt::format("protocol version {}, expected {}", h.version, wire::kProtocolVersion);
  if (h.opcode != uint16_t(opcode))
    return fmt::format("opcode {}, expected {}", h.opcode, uint16_t(opcode));
  if (h.sequence != sequence) return fmt::format("sequence {}, expected {}", h.sequence, sequence);
  if (h.n_rows < 1 || h.n_rows > uint32_t(max_rows))
    return fmt::format("{} rows, expected 1..{}", h.n_rows, max_rows);
  if (size_t(h.payload_bytes) != bytes - kHeaderBytes)
    return fmt::format("payload of {} bytes in a message of {}", h.payload_bytes, bytes);
  if (wire::checksum(message + kHeaderBytes, h.payload_bytes) != h.checksum)
    return "payload checksum mismatch";
  return "";
}

// check_header for a split linear's request or reply: `layer` is a target below `targets`.
std::string check_linear_header(const std::byte* message, size_t bytes, wire::Opcode opcode,
                                uint32_t sequence, size_t targets, int max_rows, wire::Header& h) {
  std::string problem = check_header(message, bytes, opcode, sequence, max_rows, h);
  if (!problem.empty()) return problem;
  if (h.layer < 0 || size_t(h.layer) >= targets)
    return fmt::format("split linear {} of {}", h.layer, targets);
  if (h.n_pairs != 0) return fmt::format("{} pairs, expected none", h.n_pairs);
  return "";
}

}  // namespace

// The RemoteRows of one split matrix.
class LinearSplitter::Rows final : public RemoteRows {
 public:
  Rows(LinearSplitter& owner, int index, std::string what, std::vector<int64_t> row_bounds,
       int64_t in)
      : splitter(owner),
        target(index),
        name(std::move(what)),
        where(" for " + name),
        bounds(std::move(row_bounds)),
        cols(in) {}
  void start(const float* x, int64_t n) override { splitter.start(*this, x, n); }
  float* local_buffer(int64_t n) override { return splitter.local_buffer(*this, n); }
  void finish(const float* local, int64_t n, float* y) override {
    splitter.finish(*this, local, n, y);
  }

  LinearSplitter& splitter;
  int target;
  std::string name;
  std::string where;            // " for <name>", for the waits' errors
  std::vector<int64_t> bounds;  // [parts + 1]
  int64_t cols;
};

// The RemoteHeads of one MLA layer.
class LinearSplitter::Heads final : public RemoteHeads {
 public:
  Heads(LinearSplitter& owner, int index, std::vector<int> head_bounds)
      : splitter(owner),
        layer(index),
        where(fmt::format(" for layer {} attention", index)),
        bounds(std::move(head_bounds)) {}
  void start(const Call& call) override { splitter.start(*this, call); }
  void finish(int64_t n, float* out) override { splitter.finish(*this, n, out); }

  LinearSplitter& splitter;
  int layer;
  std::string where;        // " for layer L attention", for the waits' errors
  std::vector<int> bounds;  // [parts + 1] head bounds
};

LinearSplitter::LinearSplitter(MPI_Comm comm, const ModelConfig& config, ModelWeights& weights,
                               const SplitOptions& options, Profiler& profiler)
    : config_(config), comm_(comm), options_(options), profiler_(profiler) {
  const int parts = int(options_.ranks.size());
  if (parts < 2) fail("splitting linears needs two ranks or more, not {}", parts);
  parts_.resize(size_t(parts - 1));
  for (int p = 1; p < parts; ++p) parts_[size_t(p - 1)].rank = options_.ranks[size_t(p)];
  for (Part& part : parts_) {  // parts_ keeps its size: the pointers stay valid
    recv_requests_.push_back(&part.recv_request);
    send_requests_.push_back(&part.send_request);
    part_ranks_.push_back(part.rank);
  }
  const std::vector<SplitTarget> targets = split_targets(weights);
  for (size_t i = 0; i < targets.size(); ++i) {
    Matrix& m = *targets[i].matrix;
    std::vector<int64_t> bounds = split_bounds(m, parts);
    if (bounds.empty()) continue;
    Matrix local = slice_rows(m, 0, bounds[1]);
    local.rows = m.rows;
    local.local_rows = bounds[1];
    local.remote =
        std::make_shared<Rows>(*this, int(i), targets[i].name, std::move(bounds), m.cols);
    m = std::move(local);
    ++split_count_;
  }
  // COLIBRI_SPLIT_HEADS=0: the linears alone (the benchmarks' comparison).
  const char* split_heads = std::getenv("COLIBRI_SPLIT_HEADS");
  const bool keep_heads = split_heads && std::string(split_heads) == "0";
  const int64_t per_head = config.qk_nope_head_dim + config.v_head_dim;
  for (size_t l = 0; l < weights.layers.size() && !keep_heads; ++l) {
    AttentionWeights& a = weights.layers[l].attn;
    std::vector<int> bounds = split_head_bounds(config, a.kv_b_proj, parts);
    if (bounds.empty()) continue;
    a.kv_b_proj = slice_rows(a.kv_b_proj, 0, bounds[1] * per_head);
    a.local_heads = bounds[1];
    a.remote_heads = std::make_shared<Heads>(*this, int(l), std::move(bounds));
    ++split_heads_count_;
  }
}

LinearSplitter::~LinearSplitter() {
  // A linear interrupted by an error leaves its messages posted.
  for (Part& part : parts_) {
    if (part.recv_request != MPI_REQUEST_NULL) {
      MPI_Cancel(&part.recv_request);
      MPI_Request_free(&part.recv_request);
    }
    if (part.send_request != MPI_REQUEST_NULL) MPI_Request_free(&part.send_request);
  }
}

void LinearSplitter::start(const Rows& rows, const float* x, int64_t n) {
  if (n > options_.max_rows)
    fail("{}: {} rows exceed the split linears' buffers of {} rows", rows.name, n,
         options_.max_rows);
  const size_t payload = size_t(n) * size_t(rows.cols) * sizeof(float);
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part& part = parts_[i];
    // Buffers grow to the largest call (finish() has completed the last one's messages).
    if (part.send.size() < kHeaderBytes + payload) part.send.resize(kHeaderBytes + payload);
    wire::Checksum sum;
    sum.add_copy(part.send.data() + kHeaderBytes, reinterpret_cast<const std::byte*>(x), payload);
    const wire::Header h = linear_header(wire::Opcode::kLinearRequest, ++part.sequence, rows.target,
                                         n, payload, sum.value());
    post(part, h, size_t(n) * size_t(rows.bounds[i + 2] - rows.bounds[i + 1]) * sizeof(float));
  }
}

void LinearSplitter::post(Part& part, const wire::Header& h, size_t reply_payload) {
  std::memcpy(part.send.data(), &h, kHeaderBytes);
  const size_t request = kHeaderBytes + h.payload_bytes, reply = kHeaderBytes + reply_payload;
  if (part.recv.size() < reply) part.recv.resize(reply);
  RankReport& counters = profiler_.counters();
  counters.bytes_out += request;
  counters.bytes_in += reply;
  CHECK_MPI(MPI_Irecv(part.recv.data(), int(reply), MPI_BYTE, part.rank, wire::kTagLinearReply,
                      comm_, &part.recv_request));
  CHECK_MPI(MPI_Isend(part.send.data(), int(request), MPI_BYTE, part.rank, wire::kTagLinearRequest,
                      comm_, &part.send_request));
}

float* LinearSplitter::local_buffer(const Rows& rows, int64_t n) {
  const size_t values = size_t(n) * size_t(rows.bounds[1]);
  if (local_.size() < values) local_.resize(values);
  return local_.data();
}

void LinearSplitter::wait_all(const char* what, const std::string& where) {
  wait_within(recv_requests_, part_ranks_, options_.rank_timeout_s, what, where, "--rank-timeout");
  wait_within(send_requests_, part_ranks_, options_.rank_timeout_s,
              "receipt of a split linear's input", where, "--rank-timeout");
}

std::string LinearSplitter::check_reply(size_t i, wire::Opcode opcode, int target, int64_t n,
                                        size_t payload) const {
  const Part& part = parts_[i];
  wire::Header h{};
  std::string problem = check_header(part.recv.data(), kHeaderBytes + payload, opcode,
                                     part.sequence, options_.max_rows, h);
  if (problem.empty() && (h.layer != target || h.n_rows != uint32_t(n) || h.n_pairs != 0))
    problem = fmt::format("target {} with {} rows and {} pairs, expected {} with {} and none",
                          h.layer, h.n_rows, h.n_pairs, target, n);
  return problem;
}

void LinearSplitter::finish(const Rows& rows, const float* local, int64_t n, float* y) {
  wait_all("rows of a split linear", rows.where);
  const int64_t out = rows.bounds.back();
  for (int64_t t = 0; t < n; ++t)
    std::copy_n(local + t * rows.bounds[1], rows.bounds[1], y + t * out);
  for (size_t i = 0; i < parts_.size(); ++i) {
    const Part& part = parts_[i];
    const int64_t r0 = rows.bounds[i + 1], r1 = rows.bounds[i + 2];
    const size_t payload = size_t(n) * size_t(r1 - r0) * sizeof(float);
    const std::string problem = check_reply(i, wire::Opcode::kLinearReply, rows.target, n, payload);
    if (!problem.empty())
      abort_job(fmt::format("corrupted rows of {} from {}: {}", rows.name,
                            rank_identity().name_of(part.rank), problem));
    const auto* theirs = reinterpret_cast<const float*>(part.recv.data() + kHeaderBytes);
    for (int64_t t = 0; t < n; ++t) std::copy_n(theirs + t * (r1 - r0), r1 - r0, y + t * out + r0);
  }
}

void LinearSplitter::start(const Heads& heads, const RemoteHeads::Call& call) {
  const int64_t n = call.n;
  if (n > options_.max_rows)
    fail("layer {} attention: {} rows exceed the split linears' buffers of {} rows", heads.layer, n,
         options_.max_rows);
  const int all_heads = config_.num_heads, dq = config_.qk_head_dim(), dv = config_.v_head_dim;
  const size_t cache_row = size_t(config_.kv_lora_rank + config_.qk_rope_head_dim);
  size_t selected = 0;
  for (int64_t t = 0; t < n; ++t) selected += size_t(call.rows[t].selected);
  const size_t tables = size_t(call.tables), blocks = size_t(call.offsets[tables]);
  // What every part gets: rows, tables, blocks, chosen positions and cache rows, then its queries.
  const std::pair<const std::byte*, size_t> common[] = {
      {bytes_of(call.rows), size_t(n) * sizeof(RemoteHeads::Row)},
      {bytes_of(call.offsets), (tables + 1) * sizeof(int32_t)},
      {bytes_of(call.blocks), blocks * sizeof(int32_t)},
      {bytes_of(call.selected), selected * sizeof(int32_t)},
      {bytes_of(call.cache_rows), size_t(n) * cache_row * sizeof(float)}};
  size_t common_bytes = 0;
  for (const auto& [data, bytes] : common) common_bytes += bytes;
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part& part = parts_[i];
    const int h0 = heads.bounds[i + 1], h1 = heads.bounds[i + 2];
    const size_t q_row = size_t(h1 - h0) * size_t(dq) * sizeof(float);
    const size_t payload = common_bytes + size_t(n) * q_row;
    if (part.send.size() < kHeaderBytes + payload) part.send.resize(kHeaderBytes + payload);
    wire::Checksum sum;
    std::byte* at = part.send.data() + kHeaderBytes;
    for (const auto& [data, bytes] : common) {
      if (bytes > 0) sum.add_copy(at, data, bytes);
      at += bytes;
    }
    for (int64_t t = 0; t < n; ++t, at += q_row)
      sum.add_copy(at, bytes_of(call.q + (size_t(t) * all_heads + h0) * dq), q_row);
    const wire::Header h = linear_header(wire::Opcode::kAttendRequest, ++part.sequence, heads.layer,
                                         n, payload, sum.value(), uint32_t(tables));
    post(part, h, size_t(n) * size_t(h1 - h0) * size_t(dv) * sizeof(float));
  }
}

void LinearSplitter::finish(const Heads& heads, int64_t n, float* out) {
  wait_all("heads of a split attention", heads.where);
  const int all_heads = config_.num_heads, dv = config_.v_head_dim;
  for (size_t i = 0; i < parts_.size(); ++i) {
    const int h0 = heads.bounds[i + 1], h1 = heads.bounds[i + 2];
    const size_t row = size_t(h1 - h0) * size_t(dv);
    const std::string problem =
        check_reply(i, wire::Opcode::kAttendReply, heads.layer, n, size_t(n) * row * sizeof(float));
    if (!problem.empty())
      abort_job(fmt::format("corrupted heads of layer {} attention from {}: {}", heads.layer,
                            rank_identity().name_of(parts_[i].rank), problem));
    const auto* theirs = reinterpret_cast<const float*>(parts_[i].recv.data() + kHeaderBytes);
    for (int64_t t = 0; t < n; ++t)
      std::copy_n(theirs + size_t(t) * row, row, out + (size_t(t) * all_heads + h0) * dv);
  }
}

LinearServer::LinearServer(MPI_Comm comm, const ModelConfig& config, ModelWeights& weights,
                           int part, const SplitOptions& options, Profiler& profiler)
    : config_(config),
      comm_(comm),
      coordinator_(options.ranks.at(0)),
      options_(options),
      profiler_(profiler),
      mla_(config) {
  const int parts = int(options_.ranks.size());
  if (part < 1 || part >= parts) fail("part {} of a split into {}", part, parts);
  const std::vector<SplitTarget> targets = split_targets(weights);
  int64_t max_cols = 0;
  for (const SplitTarget& target : targets) {
    Slice& slice = slices_.emplace_back();
    slice.layer = target.layer;
    const std::vector<int64_t> bounds = split_bounds(*target.matrix, parts);
    if (!bounds.empty()) {
      slice.rows = slice_rows(*target.matrix, bounds[size_t(part)], bounds[size_t(part) + 1]);
      max_cols = std::max(max_cols, slice.rows.cols);
    }
    *target.matrix = Matrix();
  }
  max_request_bytes_ = kHeaderBytes + size_t(options_.max_rows) * size_t(max_cols) * sizeof(float);

  // Each layer's heads of this part, and a copy of the cache, untouched until used.
  const int64_t per_head = config.qk_nope_head_dim + config.v_head_dim;
  const size_t slots = size_t(options_.kv_blocks) * size_t(options_.kv_block_tokens);
  int max_heads = 0;
  heads_.resize(weights.layers.size());
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    Matrix& kv_b = weights.layers[l].attn.kv_b_proj;
    const std::vector<int> bounds = split_head_bounds(config, kv_b, parts);
    if (!bounds.empty()) {
      if (slots == 0) fail("attention split by heads: no KV pool size");
      HeadsSlice& h = heads_[l];
      const int h0 = bounds[size_t(part)], h1 = bounds[size_t(part) + 1];
      h.heads = h1 - h0;
      h.kv_b = slice_rows(kv_b, h0 * per_head, h1 * per_head);
      h.latent.reset(new float[slots * size_t(config.kv_lora_rank)]);
      h.k_rope.reset(new float[slots * size_t(config.qk_rope_head_dim)]);
      max_heads = std::max(max_heads, h.heads);
    }
    kv_b = Matrix();
  }
  if (max_heads > 0) {
    const size_t rows = size_t(options_.max_rows);
    const size_t max_selected = config.has_indexer() ? size_t(config.index_topk) : 0;
    const size_t per_row = sizeof(RemoteHeads::Row) + sizeof(int32_t) * (1 + max_selected) +
                           sizeof(float) * size_t(config.kv_lora_rank + config.qk_rope_head_dim) +
                           sizeof(float) * size_t(max_heads) * size_t(config.qk_head_dim());
    max_request_bytes_ =
        std::max(max_request_bytes_, kHeaderBytes + rows * per_row +
                                         sizeof(int32_t) * (1 + size_t(options_.kv_blocks)));
  }
}

LinearServer::~LinearServer() {
  if (send_ != MPI_REQUEST_NULL) MPI_Request_free(&send_);
}

bool LinearServer::ready() {
  if (arrived_) return true;
  int flag = 0;
  CHECK_MPI(MPI_Improbe(coordinator_, wire::kTagLinearRequest, comm_, &flag, &message_, &status_));
  arrived_ = flag != 0;
  return arrived_;
}

uint64_t LinearServer::bytes() const {
  uint64_t total = 0;
  for (const Slice& slice : slices_) total += slice.rows.bytes();
  for (const HeadsSlice& h : heads_) total += h.kv_b.bytes();
  return total;
}

uint64_t LinearServer::kv_copy_bytes() const {
  uint64_t total = 0;
  const uint64_t slots = uint64_t(options_.kv_blocks) * uint64_t(options_.kv_block_tokens);
  for (const HeadsSlice& h : heads_)
    if (h.heads > 0) total += slots * uint64_t(config_.kv_lora_rank + config_.qk_rope_head_dim) * 4;
  return total;
}

void LinearServer::serve() {
  if (!arrived_) fail("no split linear request has arrived");
  arrived_ = false;
  int count = 0;
  CHECK_MPI(MPI_Get_count(&status_, MPI_BYTE, &count));
  // The buffers grow to the largest request, which the split linears bound.
  if (size_t(count) > max_request_bytes_)
    abort_job(fmt::format("corrupted split linear request from {}: {} bytes, more than {}",
                          rank_identity().name_of(coordinator_), count, max_request_bytes_));
  if (request_.size() < size_t(count)) request_.resize(size_t(count));
  CHECK_MPI(MPI_Mrecv(request_.data(), count, MPI_BYTE, &message_, MPI_STATUS_IGNORE));
  uint16_t opcode = 0;
  if (size_t(count) >= kHeaderBytes)
    std::memcpy(&opcode, request_.data() + offsetof(wire::Header, opcode), sizeof(opcode));
  if (opcode == uint16_t(wire::Opcode::kAttendRequest)) return attend(count);
  wire::Header h{};
  std::string problem =
      check_linear_header(request_.data(), size_t(std::max(count, 0)), wire::Opcode::kLinearRequest,
                          sequence_ + 1, slices_.size(), options_.max_rows, h);
  const Slice* slice = problem.empty() ? &slices_[size_t(h.layer)] : nullptr;
  if (slice && slice->rows.empty())
    problem = fmt::format("split linear {}, which is not split", h.layer);
  else if (slice && size_t(h.payload_bytes) != size_t(h.n_rows) * size_t(slice->rows.cols) * 4)
    problem = fmt::format("{} bytes of input for {} rows of {} columns", h.payload_bytes, h.n_rows,
                          slice->rows.cols);
  if (!problem.empty())
    abort_job(fmt::format("corrupted split linear request from {}: {}",
                          rank_identity().name_of(coordinator_), problem));
  sequence_ = h.sequence;
  if (request_hook_) request_hook_(slice->layer);
  wait_reply_sent();
  const int64_t n = h.n_rows;
  const size_t payload = size_t(n) * size_t(slice->rows.rows) * sizeof(float);
  if (reply_.size() < kHeaderBytes + payload) reply_.resize(kHeaderBytes + payload);
  {
    auto scope = profiler_.scope(Phase::kCompute, slice->layer);
    linear(slice->rows, reinterpret_cast<const float*>(request_.data() + kHeaderBytes), n,
           reinterpret_cast<float*>(reply_.data() + kHeaderBytes));
  }
  send_reply(wire::Opcode::kLinearReply, h, payload, size_t(count));
}

void LinearServer::wait_reply_sent() {
  std::vector<MPI_Request*> previous{&send_};
  wait_within(previous, {coordinator_}, options_.rank_timeout_s, "receipt of split linear rows", "",
              "--rank-timeout");
}

void LinearServer::send_reply(wire::Opcode opcode, const wire::Header& request, size_t payload,
                              size_t request_bytes) {
  const wire::Header reply =
      linear_header(opcode, request.sequence, request.layer, request.n_rows, payload,
                    wire::checksum(reply_.data() + kHeaderBytes, payload));
  std::memcpy(reply_.data(), &reply, kHeaderBytes);
  if (opcode == wire::Opcode::kAttendReply && request.layer == corrupt_attention_at_ && payload > 0)
    reply_[kHeaderBytes + payload / 2] ^= std::byte{0x5a};
  RankReport& counters = profiler_.counters();
  counters.bytes_in += request_bytes;
  counters.bytes_out += kHeaderBytes + payload;
  CHECK_MPI(MPI_Isend(reply_.data(), int(kHeaderBytes + payload), MPI_BYTE, coordinator_,
                      wire::kTagLinearReply, comm_, &send_));
}

void LinearServer::attend(int count) {
  wire::Header h{};
  std::string problem =
      check_header(request_.data(), size_t(std::max(count, 0)), wire::Opcode::kAttendRequest,
                   sequence_ + 1, options_.max_rows, h);
  const HeadsSlice* slice = nullptr;
  if (problem.empty()) {
    if (h.layer < 0 || size_t(h.layer) >= heads_.size() || heads_[size_t(h.layer)].heads == 0)
      problem = fmt::format("layer {} attention, whose heads are not split here", h.layer);
    else
      slice = &heads_[size_t(h.layer)];
  }
  if (problem.empty()) {
    AttendLimits limits;
    limits.kv_blocks = options_.kv_blocks;
    limits.block_tokens = options_.kv_block_tokens;
    limits.max_selected = config_.has_indexer() ? config_.index_topk : 0;
    limits.cache_row = config_.kv_lora_rank + config_.qk_rope_head_dim;
    limits.heads = slice->heads;
    limits.qk_head_dim = config_.qk_head_dim();
    problem = parse_attend_request(h, request_.data() + kHeaderBytes, limits, attend_);
  }
  if (!problem.empty())
    abort_job(fmt::format("corrupted attention request from {}: {}",
                          rank_identity().name_of(coordinator_), problem));
  sequence_ = h.sequence;
  if (request_hook_) request_hook_(h.layer);
  wait_reply_sent();
  const AttendRequest& a = attend_;
  const int bt = options_.kv_block_tokens, heads = slice->heads;
  const size_t payload = size_t(a.n) * size_t(heads) * size_t(config_.v_head_dim) * sizeof(float);
  if (reply_.size() < kHeaderBytes + payload) reply_.resize(kHeaderBytes + payload);
  {
    auto scope = profiler_.scope(Phase::kCompute, h.layer);
    // The rows' cache rows first, as the coordinator wrote them before attending.
    const int r = config_.kv_lora_rank, dr = config_.qk_rope_head_dim;
    for (int t = 0; t < a.n; ++t) {
      const size_t slot = size_t(a.slot(t, a.rows[t].pos, bt));
      const float* from = a.cache_rows + size_t(t) * size_t(r + dr);
      std::copy_n(from, r, slice->latent.get() + slot * size_t(r));
      std::copy_n(from + r, dr, slice->k_rope.get() + slot * size_t(dr));
    }
    const RequestKeys keys(a, bt);
    MlaHeads::Call call;
    call.n = a.n;
    call.heads = heads;
    call.q = a.q;
    call.q_stride = heads;
    call.kv_b = &slice->kv_b;
    call.latent = slice->latent.get();
    call.k_rope = slice->k_rope.get();
    call.keys = &keys;
    call.max_keys = a.max_keys;
    call.out = reinterpret_cast<float*>(reply_.data() + kHeaderBytes);
    call.out_stride = heads;
    mla_.run(call, !attention_blocked());
  }
  send_reply(wire::Opcode::kAttendReply, h, payload, size_t(count));
}

}  // namespace colibri
