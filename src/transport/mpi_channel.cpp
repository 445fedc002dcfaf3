#include "transport/mpi_channel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "common/serialize.h"
#include "transport/deadline.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

}  // namespace

MpiChannel::MpiChannel(MPI_Comm comm, const LivePlacement& placement, const ExchangeShape& shape,
                       int coordinator, Profiler& profiler, const MpiTransportOptions& options)
    : comm_(comm),
      placement_(placement),
      shape_(shape),
      coordinator_(coordinator),
      rank_(comm_rank(comm)),
      profiler_(profiler),
      options_(options),
      elem_bytes_(elem_bytes(options.wire_type)),
      heartbeat_(comm, coordinator) {
  const MpiTopology topology(comm_size(comm_), coordinator_, options_);
  const size_t max_pairs = size_t(shape_.max_rows) * size_t(shape_.top_k);
  request_buffer_.resize(kHeaderBytes + wire::request_payload_bytes(uint32_t(shape_.max_rows),
                                                                    uint32_t(max_pairs),
                                                                    shape_.hidden, elem_bytes_));
  reply_buffer_.resize(
      std::max(kHeaderBytes +
                   wire::reply_payload_bytes(uint32_t(shape_.max_rows), shape_.hidden, elem_bytes_),
               kHeaderBytes + wire::host_partial_payload_bytes(uint32_t(shape_.max_rows),
                                                               shape_.hidden, sizeof(float))));
  request_pairs_.reserve(max_pairs);
  request_rows_.reserve(size_t(shape_.max_rows));
  reply_to_ = coordinator_;
  const std::vector<int> group = topology.host_group(rank_);
  if (!group.empty() && group.front() != rank_) reply_to_ = group.front();
  if (!group.empty() && group.front() == rank_)
    host_leader_ = HostLeader(comm_, std::vector<int>(group.begin() + 1, group.end()),
                              shape_.max_rows, shape_.hidden, options_.rank_timeout_s);
  if (topology.shares_segment(rank_))
    segment_ = offer_shared_segment(
        comm_, coordinator_,
        shared_area_bytes(size_t(shape_.max_rows), size_t(shape_.hidden) * elem_bytes_),
        options_.setup_timeout_s);
  post_request_receive();
}

MpiChannel::~MpiChannel() {
  // A receive still posted at exit (none after shutdown) is cancelled.
  if (request_receive_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&request_receive_);
    MPI_Request_free(&request_receive_);
  }
  // The last counters' send: the coordinator took it before it shut this rank down.
  if (counters_send_ != MPI_REQUEST_NULL) MPI_Request_free(&counters_send_);
}

void MpiChannel::post_request_receive() {
  CHECK_MPI(MPI_Irecv(request_buffer_.data(), int(request_buffer_.size()), MPI_BYTE, coordinator_,
                      wire::kTagRequest, comm_, &request_receive_));
}

bool MpiChannel::receive(ExpertRequest& request) {
  for (;;)
    if (receive_one(request)) return request.layer >= 0;
}

void MpiChannel::wait_for_message(MPI_Status& status) {
  // Heartbeats that arrived while this rank computed count from now on.
  WaitClock heard;
  for (bool received = false; !received;) {
    bool idle_work = false;
    {
      auto scope = profiler_.scope(Phase::kRecvWait, layer_);
      Backoff backoff;
      // The coordinator waits rank_timeout_s for an exchange's replies; an expert rank waits
      // kAbortTeardownSeconds more, so that when a third rank (another expert rank, or a host
      // whose link is cut) is silent, the coordinator names it and its abort ends this rank first.
      const double limit = options_.rank_timeout_s + kAbortTeardownSeconds +
                           (reports_first(rank_, coordinator_) ? 0 : kLaterReportSeconds);
      while (!received && !idle_work) {
        int done = 0;
        CHECK_MPI(MPI_Test(&request_receive_, &done, &status));
        received = done != 0;
        if (received) break;
        idle_work = idle_work_.ready && idle_work_.ready();
        if (idle_work) break;
        if (heartbeat_.take()) heard.restart();
        if (options_.heartbeat_s > 0 && heard.elapsed() > limit)
          abort_job(fmt::format(
              "coordinator {} is silent: no request or heartbeat within {:.1f} s (--rank-timeout)",
              rank_identity().name_of(coordinator_), options_.rank_timeout_s));
        backoff.pause();
      }
    }
    if (idle_work) {
      idle_work_.run();
      heard.restart();
    }
  }
}

bool MpiChannel::receive_one(ExpertRequest& request) {
  MPI_Status status;
  wait_for_message(status);
  int count = 0;
  CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &count));
  const wire::RequestCheck check =
      expert_request_check(placement_.current(), shape_, elem_bytes_, rank_, sequence_ + 1);
  wire::Header& h = request_header_;
  const std::string problem =
      wire::check_request(request_buffer_.data(), size_t(count), check, h, segment_.request_rows());
  if (!problem.empty())
    abort_job(fmt::format("corrupted request from {}: {}", rank_identity().name_of(coordinator_),
                          problem));
  sequence_ = h.sequence;
  switch (wire::Opcode(h.opcode)) {
    case wire::Opcode::kShutdown:
      request.layer = -1;
      return true;
    case wire::Opcode::kPlacement:
      take_placement_change(h);
      return false;
    case wire::Opcode::kPrefetchHint:
      take_hint(h);
      return false;
    case wire::Opcode::kCountersRequest:
      send_counters(h);
      return false;
    default:
      take_request(h, count, request);
      return true;
  }
}

void MpiChannel::take_placement_change(const wire::Header& h) {
  std::vector<uint32_t> words(h.payload_bytes / 4);
  std::memcpy(words.data(), request_buffer_.data() + kHeaderBytes, h.payload_bytes);
  PlacementChange change;
  change.commit = h.n_rows == 1;
  const std::string bad = words.empty() ? "no epoch"
                                        : decode_holder_changes(std::span(words).subspan(1),
                                                                placement_.current().num_layers,
                                                                placement_.current().num_experts,
                                                                comm_size(comm_), change.changes);
  if (!words.empty()) change.epoch = words.front();
  if (!bad.empty() || change.changes.size() != h.n_pairs)
    abort_job(fmt::format("corrupted placement change from {}: {}",
                          rank_identity().name_of(coordinator_),
                          bad.empty() ? "a count that disagrees" : bad));
  post_request_receive();
  if (placement_handler_) placement_handler_(change);
}

void MpiChannel::take_hint(const wire::Header& h) {
  std::vector<int> experts(h.n_pairs);
  for (uint32_t i = 0; i < h.n_pairs; ++i) {
    uint32_t expert = 0;
    std::memcpy(&expert, request_buffer_.data() + kHeaderBytes + 4 * i, 4);
    experts[i] = int(expert);
  }
  post_request_receive();
  if (hint_handler_) hint_handler_(h.layer, experts);
}

void MpiChannel::send_counters(const wire::Header& h) {
  post_request_receive();
  // The coordinator waits for every answer before it asks again: the last send is done.
  if (counters_send_ != MPI_REQUEST_NULL) {
    std::vector<MPI_Request*> previous{&counters_send_};
    wait_within(previous, {coordinator_}, options_.rank_timeout_s, "counters delivery", "",
                "--rank-timeout");
  }
  LiveCounters counters;
  if (counters_handler_) {
    counters = counters_handler_();
  } else {
    counters = live_counters(profiler_.counters());
    counters.wall_us = profiler_.now_us();
  }
  const std::string payload = to_bytes(counters);
  counters_buffer_.resize(kHeaderBytes + payload.size());
  std::memcpy(counters_buffer_.data() + kHeaderBytes, payload.data(), payload.size());
  const wire::Header header = wire::make_header(
      wire::Opcode::kCountersReply, h.sequence, -1, uint32_t(rank_), 0, uint32_t(payload.size()),
      wire::checksum(counters_buffer_.data() + kHeaderBytes, payload.size()));
  std::memcpy(counters_buffer_.data(), &header, kHeaderBytes);
  CHECK_MPI(MPI_Isend(counters_buffer_.data(), int(counters_buffer_.size()), MPI_BYTE, coordinator_,
                      wire::kTagCounters, comm_, &counters_send_));
}

void MpiChannel::take_request(const wire::Header& h, int count, ExpertRequest& request) {
  const bool shared = h.opcode == uint16_t(wire::Opcode::kSharedRequest);
  const size_t row_bytes = size_t(h.n_rows) * size_t(shape_.hidden) * elem_bytes_;
  const std::byte* payload = request_buffer_.data() + kHeaderBytes;
  const std::byte* rows = shared ? segment_.request_rows() : payload;
  const std::byte* pairs = shared ? payload : payload + row_bytes;
  request_pairs_.resize(h.n_pairs);
  for (uint32_t i = 0; i < h.n_pairs; ++i) {
    wire::Pair pair;
    std::memcpy(&pair, pairs + size_t(i) * sizeof(wire::Pair), sizeof(pair));
    request_pairs_[i] = {pair.row, pair.expert, pair.weight};
  }
  const std::byte* row_indices = pairs + size_t(h.n_pairs) * sizeof(wire::Pair);
  request_rows_.resize(h.n_rows);
  if (h.n_rows > 0)
    std::memcpy(request_rows_.data(), row_indices, size_t(h.n_rows) * sizeof(uint32_t));
  host_leader_.post_receives();
  layer_ = h.layer;
  request.layer = h.layer;
  request.n_rows = int(h.n_rows);
  request.rows = {rows, options_.wire_type, Device::kHost, size_t(h.n_rows) * shape_.hidden};
  request.pairs = request_pairs_;
  RankReport& counters = profiler_.counters();
  counters.rows += h.n_rows;
  counters.experts += h.n_pairs;
  // Counted as the bytes of the request, wherever its rows came from.
  counters.bytes_in += size_t(count) + (shared ? row_bytes : 0);
}

void MpiChannel::reply(ConstView partial) {
  auto scope = profiler_.scope(Phase::kSend, layer_);
  if (partial.device != Device::kHost || partial.type != ElemType::kF32)
    fail("the MPI transport takes the partial as fp32 host memory");
  std::vector<MPI_Request*> previous{&reply_send_};
  wait_within(previous, {reply_to_}, options_.rank_timeout_s, "reply delivery",
              fmt::format(" in the layer {} exchange", layer_), "--rank-timeout");
  const wire::Header& request = request_header_;
  const size_t values = size_t(request.n_rows) * shape_.hidden;
  if (partial.count < values) fail("reply: {} values for {} rows", partial.count, request.n_rows);
  if (reply_to_ != coordinator_) {
    send_host_partial(partial);
    post_request_receive();
    return;
  }
  // A request whose rows came through the segment has its partial go there, and the message is
  // the header alone; a request whose rows came in the message is answered in the message (the
  // coordinator's second exchange slot, which another request may hold the segment beside).
  const bool shared = segment_.mapped() && request.opcode == uint16_t(wire::Opcode::kSharedRequest);
  std::byte* payload = shared ? segment_.reply_rows() : reply_buffer_.data() + kHeaderBytes;
  const auto* own = static_cast<const float*>(partial.data);
  uint32_t n_rows = request.n_rows;
  uint32_t sum = 0;
  if (host_leader_.leads()) {
    n_rows = host_leader_.sum(request, request_rows_, own, options_.wire_type, payload,
                              profiler_.counters());
    sum = wire::checksum(payload, wire::reply_payload_bytes(n_rows, shape_.hidden, elem_bytes_));
  } else {  // each row checksummed as it is written
    const size_t row_values = size_t(shape_.hidden), one_row = row_values * elem_bytes_;
    wire::Checksum rows_sum;
    for (uint32_t r = 0; r < n_rows; ++r)
      wire::write_summed(own + r * row_values, row_values, options_.wire_type,
                         payload + r * one_row, rows_sum);
    sum = rows_sum.value();
  }
  const size_t row_bytes = wire::reply_payload_bytes(n_rows, shape_.hidden, elem_bytes_);
  const size_t payload_bytes = shared ? 0 : row_bytes;
  const wire::Header header =
      wire::make_header(shared ? wire::Opcode::kSharedReply : wire::Opcode::kExpertReply,
                        request.sequence, request.layer, n_rows, 0, uint32_t(payload_bytes), sum);
  std::memcpy(reply_buffer_.data(), &header, kHeaderBytes);
  if (request.layer == options_.corrupt_reply_at_layer && row_bytes > 0)
    payload[row_bytes / 2] ^= std::byte{0x5a};
  CHECK_MPI(MPI_Isend(reply_buffer_.data(), int(kHeaderBytes + payload_bytes), MPI_BYTE,
                      coordinator_, wire::kTagReply, comm_, &reply_send_));
  RankReport& counters = profiler_.counters();
  counters.bytes_out += kHeaderBytes + row_bytes;
  counters.bytes_to_rank[coordinator_] += kHeaderBytes + row_bytes;
  post_request_receive();
}

void MpiChannel::send_host_partial(ConstView partial) {
  const wire::Header& request = request_header_;
  const size_t bytes =
      write_host_partial(request, request_rows_, static_cast<const float*>(partial.data),
                         shape_.hidden, reply_buffer_.data());
  if (request.layer == options_.corrupt_reply_at_layer && bytes > kHeaderBytes)
    reply_buffer_[kHeaderBytes + (bytes - kHeaderBytes) / 2] ^= std::byte{0x5a};
  CHECK_MPI(MPI_Isend(reply_buffer_.data(), int(bytes), MPI_BYTE, reply_to_, wire::kTagHostPartial,
                      comm_, &reply_send_));
  RankReport& counters = profiler_.counters();
  counters.bytes_out += bytes;
  counters.bytes_to_rank[reply_to_] += bytes;
}

}  // namespace colibri
