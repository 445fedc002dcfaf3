#include "transport/host_combine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "transport/deadline.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

}  // namespace

size_t write_host_partial(const wire::Header& request, std::span<const uint32_t> rows,
                          const float* partial, int hidden, std::byte* message) {
  const size_t values = size_t(request.n_rows) * size_t(hidden);
  // fp32 within the host: the leader rounds the host's sum to the wire type once.
  const size_t payload_bytes =
      wire::host_partial_payload_bytes(request.n_rows, hidden, sizeof(float));
  std::byte* payload = message + kHeaderBytes;
  if (values > 0) std::memcpy(payload, partial, values * sizeof(float));
  if (request.n_rows > 0)
    std::memcpy(payload + values * sizeof(float), rows.data(),
                size_t(request.n_rows) * sizeof(uint32_t));
  const wire::Header header =
      wire::make_header(wire::Opcode::kHostPartial, request.sequence, request.layer, request.n_rows,
                        0, uint32_t(payload_bytes), wire::checksum(payload, payload_bytes));
  std::memcpy(message, &header, kHeaderBytes);
  return kHeaderBytes + payload_bytes;
}

HostLeader::HostLeader(MPI_Comm comm, std::vector<int> mates, int max_rows, int hidden,
                       double rank_timeout_s)
    : comm_(comm),
      mates_(std::move(mates)),
      max_rows_(max_rows),
      hidden_(hidden),
      rank_timeout_s_(rank_timeout_s),
      buffers_(mates_.size(), std::vector<std::byte>(
                                  kHeaderBytes + wire::host_partial_payload_bytes(
                                                     uint32_t(max_rows), hidden, sizeof(float)))),
      receives_(mates_.size(), MPI_REQUEST_NULL),
      sum_(size_t(max_rows) * size_t(hidden)),
      slot_(size_t(max_rows), -1),
      row_(size_t(hidden)) {}

HostLeader::~HostLeader() {
  // Receives still posted at exit are cancelled.
  for (MPI_Request& receive : receives_) {
    if (receive == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&receive);
    MPI_Request_free(&receive);
  }
}

void HostLeader::post_receives() {
  for (size_t i = 0; i < mates_.size(); ++i)
    CHECK_MPI(MPI_Irecv(buffers_[i].data(), int(buffers_[i].size()), MPI_BYTE, mates_[i],
                        wire::kTagHostPartial, comm_, &receives_[i]));
}

std::vector<int> HostLeader::wait_for_mates(int layer) {
  std::vector<int> counts(mates_.size(), 0);
  WaitClock clock;
  Backoff backoff;
  size_t remaining = mates_.size();
  while (remaining > 0) {
    for (size_t i = 0; i < mates_.size(); ++i) {
      if (receives_[i] == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Status status;
      CHECK_MPI(MPI_Test(&receives_[i], &done, &status));
      if (!done) continue;
      CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &counts[i]));
      --remaining;
    }
    if (remaining == 0) break;
    if (clock.elapsed() > rank_timeout_s_)
      for (size_t i = 0; i < mates_.size(); ++i)
        if (receives_[i] != MPI_REQUEST_NULL)
          abort_job(fmt::format(
              "{} is silent: no host partial for its host leader within {:.1f} s in the layer "
              "{} exchange (--rank-timeout)",
              rank_identity().name_of(mates_[i]), rank_timeout_s_, layer));
    backoff.pause();
  }
  return counts;
}

uint32_t HostLeader::sum(const wire::Header& request, std::span<const uint32_t> request_rows,
                         const float* own, ElemType wire_type, std::byte* out,
                         RankReport& counters) {
  const std::vector<int> counts = wait_for_mates(request.layer);
  wire::HostPartialCheck check;
  check.expected_sequence = request.sequence;
  check.layer = request.layer;
  check.max_rows = max_rows_;
  check.hidden = hidden_;
  check.elem_bytes = sizeof(float);
  std::vector<wire::Header> headers(mates_.size());
  for (size_t i = 0; i < mates_.size(); ++i) {
    const std::string problem = wire::check_host_partial(
        buffers_[i].data(), size_t(std::max(counts[i], 0)), check, headers[i]);
    if (!problem.empty())
      abort_job(fmt::format("corrupted host partial from {} in layer {}: {}",
                            rank_identity().name_of(mates_[i]), request.layer, problem));
  }
  const int hidden = hidden_;
  const size_t row_bytes = size_t(hidden) * sizeof(float);
  const auto mate_row = [&](size_t i, uint32_t r) {  // the coordinator row of mate i's row r
    uint32_t row;
    std::memcpy(&row,
                buffers_[i].data() + kHeaderBytes + size_t(headers[i].n_rows) * row_bytes +
                    size_t(r) * sizeof(row),
                sizeof(row));
    return row;
  };
  // The union of the rows, ascending: slot_[row] is its place in the sum.
  for (uint32_t row : request_rows) slot_[row] = 0;
  for (size_t i = 0; i < mates_.size(); ++i)
    for (uint32_t r = 0; r < headers[i].n_rows; ++r) slot_[mate_row(i, r)] = 0;
  uint32_t n_rows = 0;
  for (int& slot : slot_)
    if (slot >= 0) slot = int(n_rows++);
  float* sum = sum_.data();
  std::fill(sum, sum + size_t(n_rows) * hidden, 0.0f);
  // Ascending rank: this rank (the lowest of its host) first, then its host-mates.
  for (size_t r = 0; r < request_rows.size(); ++r) {
    float* dst = sum + size_t(slot_[request_rows[r]]) * hidden;
    const float* src = own + r * size_t(hidden);
    for (int j = 0; j < hidden; ++j) dst[j] += src[j];
  }
  for (size_t i = 0; i < mates_.size(); ++i) {
    const std::byte* partial = buffers_[i].data() + kHeaderBytes;
    for (uint32_t r = 0; r < headers[i].n_rows; ++r) {
      float* dst = sum + size_t(slot_[mate_row(i, r)]) * hidden;
      std::memcpy(row_.data(), partial + r * row_bytes, row_bytes);  // unaligned
      for (int j = 0; j < hidden; ++j) dst[j] += row_[size_t(j)];
    }
    counters.bytes_in += size_t(counts[i]);
  }
  for (int& slot : slot_) slot = -1;
  from_f32(sum, size_t(n_rows) * hidden, wire_type, out);
  return n_rows;
}

}  // namespace colibri
