#include "transport/nccl_transport.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "cuda/check.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

template <class T>
T* device_alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  return static_cast<T*>(p);
}

template <class T>
T* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMallocHost(&p, std::max<size_t>(bytes, 1)));
  return static_cast<T*>(p);
}

std::string names(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + rank_identity().name_of(r);
  return text;
}

}  // namespace

std::string nccl_unique_id(MPI_Comm comm, int coordinator, const Deadline& deadline) {
  return agree_within(
      comm, coordinator, std::string(),
      [](const std::vector<std::string>&) {
        ncclUniqueId id;
        CHECK_NCCL(ncclGetUniqueId(&id));
        return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
      },
      deadline);
}

NcclTransport::NcclTransport(const std::vector<int>& nccl_ranks, const std::string& unique_id,
                             const LivePlacement& placement, const ExchangeShape& shape,
                             int coordinator, Profiler& profiler,
                             const NcclTransportOptions& options)
    : placement_(placement),
      shape_(shape),
      coordinator_(coordinator),
      rank_(rank_identity().rank),
      profiler_(profiler),
      options_(options),
      elem_bytes_(elem_bytes(options.wire_type)) {
  const auto me = std::find(nccl_ranks.begin(), nccl_ranks.end(), rank_);
  const auto root = std::find(nccl_ranks.begin(), nccl_ranks.end(), coordinator_);
  if (me == nccl_ranks.end() || root == nccl_ranks.end() ||
      !std::is_sorted(nccl_ranks.begin(), nccl_ranks.end()))
    fail("NCCL ranks must be ascending and hold the coordinator and this rank");
  if (unique_id.size() != sizeof(ncclUniqueId))
    fail("NCCL id of {} bytes (expected {})", unique_id.size(), sizeof(ncclUniqueId));
  coordinator_nccl_rank_ = int(root - nccl_ranks.begin());
  max_payload_bytes_ = wire::nccl_request_payload_bytes(
      uint32_t(shape_.max_rows), uint32_t(shape_.max_rows) * uint32_t(shape_.top_k), shape_.hidden,
      elem_bytes_);
  max_reply_bytes_ =
      wire::reply_payload_bytes(uint32_t(shape_.max_rows), shape_.hidden, elem_bytes_);

  if (options_.device < 0) fail("the NCCL transport needs a CUDA device for this rank");
  CHECK_CUDA(cudaSetDevice(options_.device));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CHECK_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));

  join_communicator(nccl_ranks, unique_id);
  allocate_buffers(nccl_ranks);
}

void NcclTransport::join_communicator(const std::vector<int>& nccl_ranks,
                                      const std::string& unique_id) {
  const auto me = std::find(nccl_ranks.begin(), nccl_ranks.end(), rank_);
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t started = ncclCommInitRankConfig(&comm_, int(nccl_ranks.size()), id,
                                                      int(me - nccl_ranks.begin()), &config);
  if (started != ncclSuccess && started != ncclInProgress)
    fail("ncclCommInitRankConfig: {}", ncclGetErrorString(started));
  // The communicator is complete when every rank has joined; a peer that never joins leaves
  // every other one in progress until the deadline.
  WaitClock clock;
  Backoff backoff(1000);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      const std::string why = fmt::format("NCCL communicator of {}: {} ({})", names(nccl_ranks),
                                          ncclGetErrorString(state), ncclGetLastError(comm_));
      ncclCommAbort(comm_);
      comm_ = nullptr;
      fail("{}", why);
    }
    if (clock.elapsed() > options_.setup_timeout_s) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      fail(
          "NCCL communicator of {} not complete within {:.1f} s: a peer did not join "
          "(--startup-timeout)",
          names(nccl_ranks), options_.setup_timeout_s);
    }
    backoff.pause();
  }
}

void NcclTransport::allocate_buffers(const std::vector<int>& nccl_ranks) {
  if (rank_ == coordinator_) {
    int size = 0;
    for (int r : nccl_ranks) size = std::max(size, r + 1);
    peer_of_.assign(size_t(size), -1);
    for (size_t i = 0; i < nccl_ranks.size(); ++i) {
      if (nccl_ranks[i] == coordinator_) continue;
      peer_of_[size_t(nccl_ranks[i])] = int(peers_.size());
      peers_.push_back({nccl_ranks[i], int(i), 0, nullptr, 0});
    }
    reply_events_.resize(peers_.size());
    for (cudaEvent_t& e : reply_events_)
      CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    active_.reserve(peers_.size());
    row_f32_.resize(size_t(shape_.hidden));
    const size_t n = peers_.size(), x_bytes = size_t(shape_.max_rows) * shape_.hidden * 4;
    headers_host_ = pinned_alloc<std::byte>(n * kHeaderBytes);
    headers_dev_ = device_alloc<std::byte>(n * kHeaderBytes);
    payload_host_ = pinned_alloc<std::byte>(n * max_payload_bytes_);
    payload_dev_ = device_alloc<std::byte>(n * max_payload_bytes_);
    reply_host_ = pinned_alloc<std::byte>(n * max_reply_bytes_);
    reply_dev_ = device_alloc<std::byte>(n * max_reply_bytes_);
    x_staging_ = pinned_alloc<float>(x_bytes);
    out_staging_ = pinned_alloc<float>(x_bytes);
  } else {
    headers_host_ = pinned_alloc<std::byte>(kHeaderBytes);
    headers_dev_ = device_alloc<std::byte>(kHeaderBytes);
    payload_host_ = pinned_alloc<std::byte>(max_payload_bytes_);
    payload_dev_ = device_alloc<std::byte>(max_payload_bytes_);
    reply_host_ = pinned_alloc<std::byte>(max_reply_bytes_);
    reply_dev_ = device_alloc<std::byte>(max_reply_bytes_);
    request_pairs_.reserve(size_t(shape_.max_rows) * size_t(shape_.top_k));
  }
}

NcclTransport::~NcclTransport() {
  // Best effort: no check may end the job here.
  if (stream_) cudaStreamSynchronize(stream_);
  if (comm_) ncclCommDestroy(comm_);
  for (cudaEvent_t e : reply_events_)
    if (e) cudaEventDestroy(e);
  if (done_) cudaEventDestroy(done_);
  for (std::byte* p : {headers_dev_, payload_dev_, reply_dev_})
    if (p) cudaFree(p);
  for (void* p : {static_cast<void*>(headers_host_), static_cast<void*>(payload_host_),
                  static_cast<void*>(reply_host_), static_cast<void*>(x_staging_),
                  static_cast<void*>(out_staging_)})
    if (p) cudaFreeHost(p);
  if (stream_) cudaStreamDestroy(stream_);
}

void NcclTransport::fail_exchange(const std::string& what) {
  if (comm_) ncclCommAbort(comm_);
  comm_ = nullptr;
  abort_job(what);
}

void NcclTransport::settle(const char* what, double limit_s, const std::vector<int>& blame) {
  WaitClock clock;
  Backoff backoff;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress)
      fail_exchange(fmt::format("NCCL {} in layer {} with {}: {} ({})", what, layer_, names(blame),
                                ncclGetErrorString(state), ncclGetLastError(comm_)));
    if (limit_s >= 0 && clock.elapsed() > limit_s)
      fail_exchange(
          fmt::format("{} is silent: NCCL {} not under way within {:.1f} s in the layer "
                      "{} exchange (--rank-timeout)",
                      names(blame), what, limit_s, layer_));
    backoff.pause();
  }
}

void NcclTransport::wait_event(cudaEvent_t event, const char* what, double limit_s, int blame) {
  WaitClock clock;
  Backoff backoff;
  for (;;) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) CHECK_CUDA(status);
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state != ncclSuccess && state != ncclInProgress)
      fail_exchange(fmt::format("NCCL error while waiting for {} from {} in layer {}: {} ({})",
                                what, rank_identity().name_of(blame), layer_,
                                ncclGetErrorString(state), ncclGetLastError(comm_)));
    if (limit_s >= 0 && clock.elapsed() > limit_s)
      fail_exchange(fmt::format(
          "{} is silent: no {} within {:.1f} s in the layer {} exchange (--rank-timeout)",
          rank_identity().name_of(blame), what, options_.rank_timeout_s, layer_));
    backoff.pause();
  }
}

void NcclTransport::choose_peers(const DispatchPlan& plan) {
  for (Peer& peer : peers_) peer.share = nullptr;
  for (const OwnerShare& share : plan.owners) {
    const int index =
        share.rank >= 0 && size_t(share.rank) < peer_of_.size() ? peer_of_[size_t(share.rank)] : -1;
    if (index < 0)
      fail(
          "layer {}: experts placed on rank {}, which is not a GPU expert rank of the NCCL "
          "transport",
          plan.layer, share.rank);
    peers_[size_t(index)].share = &share;
  }
  active_.clear();
  for (Peer& peer : peers_)
    if (peer.share) active_.push_back(&peer);
}

void NcclTransport::write_request(Peer& peer, ConstView x, const float* rows_host,
                                  bool gather_on_device, size_t& reply_offset) {
  const size_t index = size_t(&peer - peers_.data());
  const int hidden = shape_.hidden;
  const size_t row_bytes = size_t(hidden) * elem_bytes_;
  const OwnerShare& share = *peer.share;
  const uint32_t n_rows = uint32_t(share.rows.size()), n_pairs = uint32_t(share.pairs.size());
  if (n_pairs > size_t(shape_.max_rows) * size_t(shape_.top_k))
    fail("{} routed pairs exceed the exchange buffers", n_pairs);
  std::byte* host = payload_host_ + index * max_payload_bytes_;
  std::byte* dev = payload_dev_ + index * max_payload_bytes_;
  std::byte* pairs = host + n_rows * row_bytes;
  for (uint32_t i = 0; i < n_pairs; ++i) {
    const wire::Pair pair{share.pairs[i].row, share.pairs[i].expert, share.pairs[i].weight};
    std::memcpy(pairs + size_t(i) * sizeof(wire::Pair), &pair, sizeof(wire::Pair));
  }
  const size_t pairs_bytes = size_t(n_pairs) * sizeof(wire::Pair);
  if (gather_on_device) {
    const auto* x_dev = static_cast<const float*>(x.data);
    for (uint32_t r = 0; r < n_rows; ++r)
      CHECK_CUDA(cudaMemcpyAsync(dev + r * row_bytes, x_dev + size_t(share.rows[r]) * hidden,
                                 row_bytes, cudaMemcpyDeviceToDevice, stream_));
    CHECK_CUDA(cudaMemcpyAsync(dev + n_rows * row_bytes, pairs, pairs_bytes, cudaMemcpyHostToDevice,
                               stream_));
  } else {
    for (uint32_t r = 0; r < n_rows; ++r)
      from_f32(rows_host + size_t(share.rows[r]) * hidden, size_t(hidden), options_.wire_type,
               host + r * row_bytes);
    CHECK_CUDA(cudaMemcpyAsync(dev, host, n_rows * row_bytes + pairs_bytes, cudaMemcpyHostToDevice,
                               stream_));
  }
  const wire::Header header =
      wire::nccl_count_header(wire::Opcode::kNcclRequest, ++peer.sequence, layer_, n_rows, n_pairs,
                              hidden, elem_bytes_, pairs);
  std::memcpy(headers_host_ + index * kHeaderBytes, &header, kHeaderBytes);
  peer.reply_offset = reply_offset;
  reply_offset += size_t(n_rows) * row_bytes;
  const size_t sent = kHeaderBytes + n_rows * row_bytes + pairs_bytes;
  RankReport& counters = profiler_.counters();
  counters.rows += n_rows;
  counters.experts += n_pairs;
  counters.bytes_out += sent;
  counters.bytes_to_rank[peer.rank] += sent;
}

void NcclTransport::send_payloads() {
  std::vector<int> blame;
  for (const Peer* peer : active_) blame.push_back(peer->rank);
  const size_t row_bytes = size_t(shape_.hidden) * elem_bytes_;
  CHECK_NCCL(ncclGroupStart());
  for (const Peer* peer : active_) {
    const size_t index = size_t(peer - peers_.data());
    const size_t bytes = wire::nccl_request_payload_bytes(uint32_t(peer->share->rows.size()),
                                                          uint32_t(peer->share->pairs.size()),
                                                          shape_.hidden, elem_bytes_);
    CHECK_NCCL(ncclSend(payload_dev_ + index * max_payload_bytes_, bytes, ncclUint8,
                        peer->nccl_rank, comm_, stream_));
  }
  CHECK_NCCL(ncclGroupEnd());
  settle("request payload", options_.rank_timeout_s, blame);
  // One group per reply, in ascending rank, each followed by its event: the first event not
  // reached names the rank that did not answer.
  for (const Peer* peer : active_) {
    const size_t index = size_t(peer - peers_.data());
    CHECK_NCCL(ncclGroupStart());
    CHECK_NCCL(ncclRecv(reply_dev_ + peer->reply_offset, peer->share->rows.size() * row_bytes,
                        ncclUint8, peer->nccl_rank, comm_, stream_));
    CHECK_NCCL(ncclGroupEnd());
    settle("reply receive", options_.rank_timeout_s, {peer->rank});
    CHECK_CUDA(cudaEventRecord(reply_events_[index], stream_));
  }
}

void NcclTransport::dispatch(const DispatchPlan& plan, ConstView x) {
  auto scope = profiler_.scope(Phase::kDispatch, plan.layer);
  const int n = plan.n_rows, hidden = shape_.hidden;
  if (x.type != ElemType::kF32) fail("the NCCL transport takes fp32 rows");
  if (n > shape_.max_rows)
    fail("{} rows exceed the exchange buffers sized for {} rows", n, shape_.max_rows);
  if (x.count < size_t(n) * hidden) fail("dispatch: {} values for {} rows", x.count, n);
  layer_ = plan.layer;
  n_rows_ = n;
  // Device rows on an fp32 wire are gathered on the device; other device rows come to the host
  // once (a staging copy) to be converted there.
  const bool gather_on_device = x.device == Device::kCuda && options_.wire_type == ElemType::kF32;
  const auto* rows_host = static_cast<const float*>(x.data);
  if (x.device == Device::kCuda && !gather_on_device) {
    CHECK_CUDA(cudaMemcpyAsync(x_staging_, x.data, size_t(n) * hidden * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_));
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    rows_host = x_staging_;
  }
  choose_peers(plan);
  size_t reply_offset = 0;
  for (Peer* peer : active_) write_request(*peer, x, rows_host, gather_on_device, reply_offset);
  if (active_.empty()) return;
  send_headers(active_);
  send_payloads();
  dispatched_us_ = profiler_.now_us();
}

void NcclTransport::send_headers(const std::vector<Peer*>& to) {
  std::vector<int> blame;
  for (const Peer* peer : to) blame.push_back(peer->rank);
  const size_t n = peers_.size();
  CHECK_CUDA(cudaMemcpyAsync(headers_dev_, headers_host_, n * kHeaderBytes, cudaMemcpyHostToDevice,
                             stream_));
  CHECK_NCCL(ncclGroupStart());
  for (const Peer* peer : to) {
    const size_t index = size_t(peer - peers_.data());
    CHECK_NCCL(ncclSend(headers_dev_ + index * kHeaderBytes, kHeaderBytes, ncclUint8,
                        peer->nccl_rank, comm_, stream_));
  }
  CHECK_NCCL(ncclGroupEnd());
  settle("count headers", options_.rank_timeout_s, blame);
}

void NcclTransport::wait_partials() {
  replied_.clear();
  if (active_.empty()) return;
  auto scope = profiler_.scope(Phase::kWaitSlowest, layer_);
  for (const Peer* peer : active_) {
    const size_t index = size_t(peer - peers_.data());
    wait_event(reply_events_[index], "reply", options_.rank_timeout_s, peer->rank);
    profiler_.add_reply(layer_, peer->rank, profiler_.now_us() - dispatched_us_);
    replied_.push_back(peer->rank);
  }
  const Peer* last = active_.back();
  const size_t bytes = last->reply_offset + last->share->rows.size() * shape_.hidden * elem_bytes_;
  CHECK_CUDA(cudaMemcpyAsync(reply_host_, reply_dev_, bytes, cudaMemcpyDeviceToHost, stream_));
  CHECK_CUDA(cudaEventRecord(done_, stream_));
  wait_event(done_, "reply download", options_.rank_timeout_s, rank_);
}

void NcclTransport::add_partial(size_t i, float* sum, std::span<uint8_t> started) {
  const Peer* peer = active_.at(i);
  const int hidden = shape_.hidden;
  const size_t row_bytes = size_t(hidden) * elem_bytes_;
  const std::byte* partial = reply_host_ + peer->reply_offset;
  const std::vector<int>& rows = peer->share->rows;
  for (size_t r = 0; r < rows.size(); ++r) {
    float* dst = sum + size_t(rows[r]) * hidden;
    const float* src = reinterpret_cast<const float*>(partial + r * row_bytes);
    if (options_.wire_type != ElemType::kF32) {
      to_f32({partial + r * row_bytes, options_.wire_type, Device::kHost, size_t(hidden)},
             row_f32_.data());
      src = row_f32_.data();
    }
    wire::add_row(dst, src, size_t(hidden), !started[size_t(rows[r])]);
    started[size_t(rows[r])] = 1;
  }
  profiler_.counters().bytes_in += rows.size() * row_bytes;
}

void NcclTransport::finish_combine() {
  for (Peer* peer : active_) peer->share = nullptr;
  active_.clear();
}

void NcclTransport::combine(View out) {
  if (out.type != ElemType::kF32) fail("the NCCL transport combines into fp32");
  if (out.device == Device::kHost) {
    combine_partials(*this, out);
    return;
  }
  // Device out: summed on the host, then one upload (a staging copy).
  const size_t values = size_t(n_rows_) * shape_.hidden;
  if (out.count < values) fail("combine: {} values for {} rows", out.count, n_rows_);
  combine_partials(*this, host_f32(out_staging_, values));
  CHECK_CUDA(cudaMemcpyAsync(out.data, out_staging_, values * sizeof(float), cudaMemcpyHostToDevice,
                             stream_));
  CHECK_CUDA(cudaStreamSynchronize(stream_));
}

void NcclTransport::shutdown() {
  if (!comm_ || peers_.empty()) return;
  layer_ = -1;
  for (size_t index = 0; index < peers_.size(); ++index) {
    Peer& peer = peers_[index];
    const wire::Header header = wire::nccl_count_header(
        wire::Opcode::kShutdown, ++peer.sequence, -1, 0, 0, shape_.hidden, elem_bytes_, nullptr);
    std::memcpy(headers_host_ + index * kHeaderBytes, &header, kHeaderBytes);
  }
  CHECK_CUDA(cudaMemcpyAsync(headers_dev_, headers_host_, peers_.size() * kHeaderBytes,
                             cudaMemcpyHostToDevice, stream_));
  // One group per peer with an event after it: the first event not reached names the peer that
  // did not take its shutdown.
  for (size_t index = 0; index < peers_.size(); ++index) {
    CHECK_NCCL(ncclGroupStart());
    CHECK_NCCL(ncclSend(headers_dev_ + index * kHeaderBytes, kHeaderBytes, ncclUint8,
                        peers_[index].nccl_rank, comm_, stream_));
    CHECK_NCCL(ncclGroupEnd());
    settle("shutdown", options_.rank_timeout_s, {peers_[index].rank});
    CHECK_CUDA(cudaEventRecord(reply_events_[index], stream_));
  }
  for (size_t index = 0; index < peers_.size(); ++index)
    wait_event(reply_events_[index], "shutdown delivery", options_.rank_timeout_s,
               peers_[index].rank);
}

bool NcclTransport::receive(ExpertRequest& request) {
  {
    auto scope = profiler_.scope(Phase::kRecvWait, layer_);
    CHECK_NCCL(ncclGroupStart());
    CHECK_NCCL(
        ncclRecv(headers_dev_, kHeaderBytes, ncclUint8, coordinator_nccl_rank_, comm_, stream_));
    CHECK_NCCL(ncclGroupEnd());
    settle("count header receive", -1, {coordinator_});
    CHECK_CUDA(cudaMemcpyAsync(headers_host_, headers_dev_, kHeaderBytes, cudaMemcpyDeviceToHost,
                               stream_));
    CHECK_CUDA(cudaEventRecord(done_, stream_));
    // Idle until the next request: no deadline (see the header).
    wait_event(done_, "request", -1, coordinator_);
  }
  const wire::RequestCheck check =
      expert_request_check(placement_.current(), shape_, elem_bytes_, rank_, sequence_ + 1);
  wire::Header& h = request_header_;
  std::string problem = wire::check_nccl_count_header(headers_host_, kHeaderBytes, check, h);
  if (!problem.empty())
    fail_exchange(fmt::format("corrupted count header from {}: {}",
                              rank_identity().name_of(coordinator_), problem));
  sequence_ = h.sequence;
  if (h.opcode == uint16_t(wire::Opcode::kShutdown)) return false;
  layer_ = h.layer;
  // The payload, then one download: the expert backends take host rows.
  const double limit = options_.rank_timeout_s + kAbortTeardownSeconds;
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(
      ncclRecv(payload_dev_, h.payload_bytes, ncclUint8, coordinator_nccl_rank_, comm_, stream_));
  CHECK_NCCL(ncclGroupEnd());
  settle("payload receive", limit, {coordinator_});
  CHECK_CUDA(cudaMemcpyAsync(payload_host_, payload_dev_, h.payload_bytes, cudaMemcpyDeviceToHost,
                             stream_));
  CHECK_CUDA(cudaEventRecord(done_, stream_));
  wait_event(done_, "request payload", limit, coordinator_);
  const size_t rows_bytes = size_t(h.n_rows) * size_t(shape_.hidden) * elem_bytes_;
  problem = wire::check_nccl_pairs(payload_host_ + rows_bytes, h, check);
  if (!problem.empty())
    fail_exchange(fmt::format("corrupted request from {}: {}",
                              rank_identity().name_of(coordinator_), problem));
  request_pairs_.resize(h.n_pairs);
  for (uint32_t i = 0; i < h.n_pairs; ++i) {
    wire::Pair pair;
    std::memcpy(&pair, payload_host_ + rows_bytes + size_t(i) * sizeof(wire::Pair), sizeof(pair));
    request_pairs_[i] = {pair.row, pair.expert, pair.weight};
  }
  request.layer = h.layer;
  request.n_rows = int(h.n_rows);
  request.rows = {payload_host_, options_.wire_type, Device::kHost,
                  size_t(h.n_rows) * shape_.hidden};
  request.pairs = request_pairs_;
  RankReport& counters = profiler_.counters();
  counters.rows += h.n_rows;
  counters.experts += h.n_pairs;
  counters.bytes_in += kHeaderBytes + h.payload_bytes;
  return true;
}

void NcclTransport::reply(ConstView partial) {
  auto scope = profiler_.scope(Phase::kSend, layer_);
  const wire::Header& request = request_header_;
  const size_t values = size_t(request.n_rows) * shape_.hidden;
  if (partial.type != ElemType::kF32) fail("the NCCL transport sends fp32 partials");
  if (partial.count < values) fail("reply: {} values for {} rows", partial.count, request.n_rows);
  const size_t bytes = values * elem_bytes_;
  if (partial.device == Device::kCuda && options_.wire_type == ElemType::kF32) {
    CHECK_CUDA(cudaMemcpyAsync(reply_dev_, partial.data, bytes, cudaMemcpyDeviceToDevice, stream_));
  } else {
    const float* host = static_cast<const float*>(partial.data);
    if (partial.device == Device::kCuda) {  // converted on the host: one download
      CHECK_CUDA(cudaMemcpyAsync(reply_host_, partial.data, values * sizeof(float),
                                 cudaMemcpyDeviceToHost, stream_));
      CHECK_CUDA(cudaStreamSynchronize(stream_));
      std::vector<float> copy(values);
      std::memcpy(copy.data(), reply_host_, values * sizeof(float));
      from_f32(copy.data(), values, options_.wire_type, reply_host_);
    } else {
      from_f32(host, values, options_.wire_type, reply_host_);
    }
    CHECK_CUDA(cudaMemcpyAsync(reply_dev_, reply_host_, bytes, cudaMemcpyHostToDevice, stream_));
  }
  // Not waited for: the next receive is ordered after it on the stream.
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(ncclSend(reply_dev_, bytes, ncclUint8, coordinator_nccl_rank_, comm_, stream_));
  CHECK_NCCL(ncclGroupEnd());
  settle("reply send", options_.rank_timeout_s + kAbortTeardownSeconds, {coordinator_});
  RankReport& counters = profiler_.counters();
  counters.bytes_out += bytes;
  counters.bytes_to_rank[coordinator_] += bytes;
}

}  // namespace colibri
