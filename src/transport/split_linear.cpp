#include "transport/split_linear.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common/error.h"
#include "transport/mpi_check.h"
#include "transport/mpi_transport.h"

namespace colibri {

namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

wire::Header linear_header(wire::Opcode opcode, uint32_t sequence, int target, int64_t n,
                           size_t payload_bytes, uint32_t checksum) {
  return {wire::kMagic,
          wire::kProtocolVersion,
          uint16_t(opcode),
          sequence,
          target,
          uint32_t(n),
          0,
          uint32_t(payload_bytes),
          checksum};
}

// What is wrong with a message of `bytes` that should be `opcode` with `sequence` for a target
// below `targets`; "" when nothing. The header is copied out.
std::string check_linear_header(const std::byte* message, size_t bytes, wire::Opcode opcode,
                                uint32_t sequence, size_t targets, int max_rows, wire::Header& h) {
  if (bytes < kHeaderBytes) return fmt::format("{} bytes, shorter than a header", bytes);
  std::memcpy(&h, message, kHeaderBytes);
  if (h.magic != wire::kMagic) return fmt::format("bad magic {:#x}", h.magic);
  if (h.version != wire::kProtocolVersion)
    return fmt::format("protocol version {}, expected {}", h.version, wire::kProtocolVersion);
  if (h.opcode != uint16_t(opcode))
    return fmt::format("opcode {}, expected {}", h.opcode, uint16_t(opcode));
  if (h.sequence != sequence) return fmt::format("sequence {}, expected {}", h.sequence, sequence);
  if (h.layer < 0 || size_t(h.layer) >= targets)
    return fmt::format("split linear {} of {}", h.layer, targets);
  if (h.n_rows < 1 || h.n_rows > uint32_t(max_rows))
    return fmt::format("{} rows, expected 1..{}", h.n_rows, max_rows);
  if (h.n_pairs != 0) return fmt::format("{} pairs, expected none", h.n_pairs);
  if (size_t(h.payload_bytes) != bytes - kHeaderBytes)
    return fmt::format("payload of {} bytes in a message of {}", h.payload_bytes, bytes);
  if (wire::checksum(message + kHeaderBytes, h.payload_bytes) != h.checksum)
    return "payload checksum mismatch";
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

LinearSplitter::LinearSplitter(MPI_Comm comm, ModelWeights& weights, const SplitOptions& options,
                               Profiler& profiler)
    : comm_(comm), options_(options), profiler_(profiler) {
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
  RankReport& counters = profiler_.counters();
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part& part = parts_[i];
    // Buffers grow to the largest call (finish() has completed the last one's messages).
    if (part.send.size() < kHeaderBytes + payload) part.send.resize(kHeaderBytes + payload);
    wire::Checksum sum;
    sum.add_copy(part.send.data() + kHeaderBytes, reinterpret_cast<const std::byte*>(x), payload);
    const wire::Header h = linear_header(wire::Opcode::kLinearRequest, ++part.sequence, rows.target,
                                         n, payload, sum.value());
    std::memcpy(part.send.data(), &h, kHeaderBytes);
    const size_t reply =
        kHeaderBytes + size_t(n) * size_t(rows.bounds[i + 2] - rows.bounds[i + 1]) * sizeof(float);
    if (part.recv.size() < reply) part.recv.resize(reply);
    counters.bytes_out += kHeaderBytes + payload;
    counters.bytes_in += reply;
    CHECK_MPI(MPI_Irecv(part.recv.data(), int(reply), MPI_BYTE, part.rank, wire::kTagLinearReply,
                        comm_, &part.recv_request));
    CHECK_MPI(MPI_Isend(part.send.data(), int(kHeaderBytes + payload), MPI_BYTE, part.rank,
                        wire::kTagLinearRequest, comm_, &part.send_request));
  }
}

float* LinearSplitter::local_buffer(const Rows& rows, int64_t n) {
  const size_t values = size_t(n) * size_t(rows.bounds[1]);
  if (local_.size() < values) local_.resize(values);
  return local_.data();
}

void LinearSplitter::finish(const Rows& rows, const float* local, int64_t n, float* y) {
  wait_within(recv_requests_, part_ranks_, options_.rank_timeout_s, "rows of a split linear",
              rows.where, "--rank-timeout");
  wait_within(send_requests_, part_ranks_, options_.rank_timeout_s,
              "receipt of a split linear's input", rows.where, "--rank-timeout");
  const int64_t out = rows.bounds.back();
  for (int64_t t = 0; t < n; ++t)
    std::copy_n(local + t * rows.bounds[1], rows.bounds[1], y + t * out);
  for (size_t i = 0; i < parts_.size(); ++i) {
    const Part& part = parts_[i];
    const int64_t r0 = rows.bounds[i + 1], r1 = rows.bounds[i + 2];
    const size_t payload = size_t(n) * size_t(r1 - r0) * sizeof(float);
    wire::Header h{};
    std::string problem =
        check_linear_header(part.recv.data(), kHeaderBytes + payload, wire::Opcode::kLinearReply,
                            part.sequence, size_t(rows.target) + 1, options_.max_rows, h);
    if (problem.empty() && (h.layer != rows.target || h.n_rows != uint32_t(n)))
      problem = fmt::format("split linear {} with {} rows, expected {} with {}", h.layer, h.n_rows,
                            rows.target, n);
    if (!problem.empty())
      abort_job(fmt::format("corrupted rows of {} from {}: {}", rows.name,
                            rank_identity().name_of(part.rank), problem));
    const auto* theirs = reinterpret_cast<const float*>(part.recv.data() + kHeaderBytes);
    for (int64_t t = 0; t < n; ++t) std::copy_n(theirs + t * (r1 - r0), r1 - r0, y + t * out + r0);
  }
}

LinearServer::LinearServer(MPI_Comm comm, ModelWeights& weights, int part,
                           const SplitOptions& options, Profiler& profiler)
    : comm_(comm), coordinator_(options.ranks.at(0)), options_(options), profiler_(profiler) {
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
  std::vector<MPI_Request*> previous{&send_};
  wait_within(previous, {coordinator_}, options_.rank_timeout_s, "receipt of split linear rows", "",
              "--rank-timeout");
  const int64_t n = h.n_rows;
  const size_t payload = size_t(n) * size_t(slice->rows.rows) * sizeof(float);
  if (reply_.size() < kHeaderBytes + payload) reply_.resize(kHeaderBytes + payload);
  auto* out = reinterpret_cast<float*>(reply_.data() + kHeaderBytes);
  {
    auto scope = profiler_.scope(Phase::kCompute, slice->layer);
    linear(slice->rows, reinterpret_cast<const float*>(request_.data() + kHeaderBytes), n, out);
  }
  const wire::Header reply =
      linear_header(wire::Opcode::kLinearReply, h.sequence, h.layer, n, payload,
                    wire::checksum(reinterpret_cast<const std::byte*>(out), payload));
  std::memcpy(reply_.data(), &reply, kHeaderBytes);
  RankReport& counters = profiler_.counters();
  counters.bytes_in += size_t(count);
  counters.bytes_out += kHeaderBytes + payload;
  CHECK_MPI(MPI_Isend(reply_.data(), int(kHeaderBytes + payload), MPI_BYTE, coordinator_,
                      wire::kTagLinearReply, comm_, &send_));
}

}  // namespace colibri
