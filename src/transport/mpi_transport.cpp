#include "transport/mpi_transport.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "common/error.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

// Yields for the first polls, then sleeps in short steps: waiting ranks must not starve the
// ranks that compute when the machine is oversubscribed.
class Backoff {
 public:
  void pause() {
    if (++polls_ < 64) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min<int>(polls_ - 63, 50)));
    }
  }

 private:
  int polls_ = 0;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

uint32_t wire::checksum(const std::byte* data, size_t bytes) {
  // FNV-1a style over 64-bit words in four independent lanes (the multiply latency of one lane
  // would otherwise bound the speed), then the tail bytes.
  constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t lane[4] = {14695981039346656037ull, 1, 2, 3};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t word;
      std::memcpy(&word, data + i + 8 * l, 8);
      lane[l] = (lane[l] ^ word) * kPrime;
    }
  }
  uint64_t hash = ((lane[0] * kPrime ^ lane[1]) * kPrime ^ lane[2]) * kPrime ^ lane[3];
  for (; i < bytes; ++i) hash = (hash ^ uint64_t(data[i])) * kPrime;
  return uint32_t(hash ^ (hash >> 32));
}

MpiTransport::MpiTransport(MPI_Comm comm, const PlacementTable& placement,
                           const ExchangeShape& shape, int coordinator, Profiler& profiler,
                           const MpiTransportOptions& options)
    : comm_(comm),
      placement_(placement),
      shape_(shape),
      coordinator_(coordinator),
      profiler_(profiler),
      options_(options) {
  int size = 0;
  CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  CHECK_MPI(MPI_Comm_size(comm_, &size));
  const size_t max_pairs = size_t(shape_.max_rows) * size_t(shape_.top_k);
  const size_t request_bytes =
      kHeaderBytes +
      wire::request_payload_bytes(uint32_t(shape_.max_rows), uint32_t(max_pairs), shape_.hidden);
  const size_t reply_bytes =
      kHeaderBytes + wire::reply_payload_bytes(uint32_t(shape_.max_rows), shape_.hidden);
  if (rank_ == coordinator_) {
    owner_peer_.assign(size_t(size), -1);
    slowest_.assign(size_t(size), 0);
    for (int r = 0; r < size; ++r) {
      if (r == coordinator_) continue;
      owner_peer_[size_t(r)] = int(peers_.size());
      Peer& peer = peers_.emplace_back();
      peer.rank = r;
      peer.send.resize(request_bytes);
      peer.recv.resize(reply_bytes);
      peer.rows.reserve(size_t(shape_.max_rows));
    }
  } else {
    request_buffer_.resize(request_bytes);
    reply_buffer_.resize(reply_bytes);
    post_request_receive();
  }
}

MpiTransport::~MpiTransport() {
  // Receives still posted at exit (an expert rank after shutdown has none) are cancelled.
  if (request_receive_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&request_receive_);
    MPI_Request_free(&request_receive_);
  }
}

void MpiTransport::post_request_receive() {
  CHECK_MPI(MPI_Irecv(request_buffer_.data(), int(request_buffer_.size()), MPI_BYTE, coordinator_,
                      wire::kTagRequest, comm_, &request_receive_));
}

int MpiTransport::wait_all(std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
                           const char* what, int layer) {
  const auto start = std::chrono::steady_clock::now();
  Backoff backoff;
  int last = -1;
  for (;;) {
    bool all_done = true;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (*requests[i] == MPI_REQUEST_NULL) continue;
      int done = 0;
      CHECK_MPI(MPI_Test(requests[i], &done, MPI_STATUS_IGNORE));
      if (done) {
        last = int(i);
      } else {
        all_done = false;
      }
    }
    if (all_done) return last;
    if (seconds_since(start) > options_.rank_timeout_s) {
      for (size_t i = 0; i < requests.size(); ++i)
        if (*requests[i] != MPI_REQUEST_NULL)
          abort_job(fmt::format(
              "{} is silent: no {} within {:.1f} s in the layer {} exchange (--rank-timeout)",
              rank_identity().name_of(peer_ranks[i]), what, options_.rank_timeout_s, layer));
    }
    backoff.pause();
  }
}

void MpiTransport::dispatch(int layer, const float* x, int n, const Routing& routing) {
  auto scope = profiler_.scope(Phase::kDispatch, layer);
  if (n > shape_.max_rows)
    fail("{} rows exceed the exchange buffers sized for {} rows", n, shape_.max_rows);
  layer_ = layer;
  n_rows_ = n;
  const int hidden = shape_.hidden, k = routing.top_k;
  const size_t row_bytes = size_t(hidden) * sizeof(float);
  const size_t max_pairs = size_t(shape_.max_rows) * size_t(shape_.top_k);

  // Pairs go after the rows; the number of rows is known only at the end, so pairs are staged.
  std::vector<std::vector<wire::Pair>> pairs(peers_.size());
  for (Peer& peer : peers_) peer.rows.clear();
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < k; ++i) {
      const int expert = routing.expert[size_t(t) * k + i];
      const int owner = placement_.owner_of(layer, expert);
      const int index = owner_peer_[size_t(owner)];
      if (index < 0) fail("expert {} of layer {} is placed on the coordinator", expert, layer);
      Peer& peer = peers_[size_t(index)];
      if (peer.rows.empty() || peer.rows.back() != t) peer.rows.push_back(t);
      pairs[size_t(index)].push_back(
          {uint32_t(peer.rows.size() - 1), uint32_t(expert), routing.weight[size_t(t) * k + i]});
    }
  }

  RankReport& counters = profiler_.counters();
  for (size_t p = 0; p < peers_.size(); ++p) {
    Peer& peer = peers_[p];
    peer.active = !peer.rows.empty();
    if (!peer.active) continue;
    const uint32_t n_rows = uint32_t(peer.rows.size()), n_pairs = uint32_t(pairs[p].size());
    if (n_pairs > max_pairs) fail("{} routed pairs exceed the exchange buffers", n_pairs);
    std::byte* payload = peer.send.data() + kHeaderBytes;
    for (uint32_t r = 0; r < n_rows; ++r)
      std::memcpy(payload + r * row_bytes, x + size_t(peer.rows[r]) * hidden, row_bytes);
    std::memcpy(payload + n_rows * row_bytes, pairs[p].data(), n_pairs * sizeof(wire::Pair));
    const size_t payload_bytes = wire::request_payload_bytes(n_rows, n_pairs, hidden);
    const wire::Header header{wire::kMagic,
                              wire::kProtocolVersion,
                              uint16_t(wire::Opcode::kExpertRequest),
                              ++peer.sequence,
                              layer,
                              n_rows,
                              n_pairs,
                              uint32_t(payload_bytes),
                              wire::checksum(payload, payload_bytes)};
    std::memcpy(peer.send.data(), &header, kHeaderBytes);
    // The reply receive is posted before the request leaves.
    CHECK_MPI(MPI_Irecv(peer.recv.data(), int(peer.recv.size()), MPI_BYTE, peer.rank,
                        wire::kTagReply, comm_, &peer.recv_request));
    CHECK_MPI(MPI_Isend(peer.send.data(), int(kHeaderBytes + payload_bytes), MPI_BYTE, peer.rank,
                        wire::kTagRequest, comm_, &peer.send_request));
    counters.rows += n_rows;
    counters.experts += n_pairs;
    counters.bytes_out += kHeaderBytes + payload_bytes;
    counters.bytes_to_rank[peer.rank] += kHeaderBytes + payload_bytes;
  }
}

void MpiTransport::validate_reply(const Peer& peer, int count_bytes) {
  const std::string from = rank_identity().name_of(peer.rank);
  if (count_bytes < int(kHeaderBytes))
    abort_job(
        fmt::format("corrupted reply from {}: {} bytes, shorter than a header", from, count_bytes));
  wire::Header h;
  std::memcpy(&h, peer.recv.data(), kHeaderBytes);
  const size_t expected = wire::reply_payload_bytes(uint32_t(peer.rows.size()), shape_.hidden);
  std::string problem;
  if (h.magic != wire::kMagic) {
    problem = fmt::format("bad magic {:#x}", h.magic);
  } else if (h.version != wire::kProtocolVersion) {
    problem = fmt::format("protocol version {} (expected {})", h.version, wire::kProtocolVersion);
  } else if (h.opcode != uint16_t(wire::Opcode::kExpertReply)) {
    problem = fmt::format("opcode {} where a reply was expected", h.opcode);
  } else if (h.sequence != peer.sequence || h.layer != layer_) {
    problem = fmt::format("sequence {} layer {} (expected {} and {})", h.sequence, h.layer,
                          peer.sequence, layer_);
  } else if (h.n_rows != peer.rows.size() || h.payload_bytes != expected ||
             size_t(count_bytes) != kHeaderBytes + expected) {
    problem = fmt::format("{} rows in {} bytes (expected {} rows in {})", h.n_rows, count_bytes,
                          peer.rows.size(), kHeaderBytes + expected);
  } else if (wire::checksum(peer.recv.data() + kHeaderBytes, expected) != h.checksum) {
    problem = "payload checksum mismatch";
  }
  if (!problem.empty())
    abort_job(fmt::format("corrupted reply from {} in layer {}: {}", from, layer_, problem));
}

void MpiTransport::combine(float* out) {
  std::vector<MPI_Request*> requests;
  std::vector<int> ranks;
  std::vector<size_t> active;
  for (size_t p = 0; p < peers_.size(); ++p) {
    if (!peers_[p].active) continue;
    requests.push_back(&peers_[p].recv_request);
    ranks.push_back(peers_[p].rank);
    active.push_back(p);
  }
  {
    auto scope = profiler_.scope(Phase::kWaitSlowest, layer_);
    std::vector<MPI_Status> statuses(requests.size());
    const auto start = std::chrono::steady_clock::now();
    Backoff backoff;
    size_t remaining = requests.size();
    int last = -1;
    std::vector<int> counts(requests.size(), 0);
    while (remaining > 0) {
      for (size_t i = 0; i < requests.size(); ++i) {
        if (*requests[i] == MPI_REQUEST_NULL) continue;
        int done = 0;
        CHECK_MPI(MPI_Test(requests[i], &done, &statuses[i]));
        if (!done) continue;
        CHECK_MPI(MPI_Get_count(&statuses[i], MPI_BYTE, &counts[i]));
        last = int(i);
        --remaining;
      }
      if (remaining == 0) break;
      if (seconds_since(start) > options_.rank_timeout_s) {
        for (size_t i = 0; i < requests.size(); ++i)
          if (*requests[i] != MPI_REQUEST_NULL)
            abort_job(fmt::format(
                "{} is silent: no reply within {:.1f} s in the layer {} exchange (--rank-timeout)",
                rank_identity().name_of(ranks[i]), options_.rank_timeout_s, layer_));
      }
      backoff.pause();
    }
    if (last >= 0) ++slowest_[size_t(ranks[size_t(last)])];
    for (size_t i = 0; i < active.size(); ++i) validate_reply(peers_[active[i]], counts[i]);
  }

  auto scope = profiler_.scope(Phase::kCombine, layer_);
  const int hidden = shape_.hidden;
  std::fill(out, out + size_t(n_rows_) * hidden, 0.0f);
  RankReport& counters = profiler_.counters();
  for (size_t p : active) {  // ascending rank: a fixed summation order
    const Peer& peer = peers_[p];
    const float* partial = reinterpret_cast<const float*>(peer.recv.data() + kHeaderBytes);
    for (size_t r = 0; r < peer.rows.size(); ++r) {
      float* dst = out + size_t(peer.rows[r]) * hidden;
      const float* src = partial + r * size_t(hidden);
      for (int j = 0; j < hidden; ++j) dst[j] += src[j];
    }
    counters.bytes_in +=
        kHeaderBytes + wire::reply_payload_bytes(uint32_t(peer.rows.size()), hidden);
  }
  std::vector<MPI_Request*> sends;
  for (size_t p : active) sends.push_back(&peers_[p].send_request);
  wait_all(sends, ranks, "request delivery", layer_);
}

void MpiTransport::shutdown() {
  std::vector<MPI_Request*> sends;
  std::vector<int> ranks;
  for (Peer& peer : peers_) {
    const wire::Header header{wire::kMagic,
                              wire::kProtocolVersion,
                              uint16_t(wire::Opcode::kShutdown),
                              ++peer.sequence,
                              -1,
                              0,
                              0,
                              0,
                              wire::checksum(nullptr, 0)};
    std::memcpy(peer.send.data(), &header, kHeaderBytes);
    CHECK_MPI(MPI_Isend(peer.send.data(), int(kHeaderBytes), MPI_BYTE, peer.rank, wire::kTagRequest,
                        comm_, &peer.send_request));
    sends.push_back(&peer.send_request);
    ranks.push_back(peer.rank);
  }
  wait_all(sends, ranks, "shutdown delivery", -1);
}

bool MpiTransport::receive(ExpertRequest& request) {
  MPI_Status status;
  {
    auto scope = profiler_.scope(Phase::kRecvWait, layer_);
    Backoff backoff;
    for (;;) {
      int done = 0;
      CHECK_MPI(MPI_Test(&request_receive_, &done, &status));
      if (done) break;
      backoff.pause();
    }
  }
  int count = 0;
  CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &count));
  const std::string from = rank_identity().name_of(coordinator_);
  if (count < int(kHeaderBytes))
    abort_job(
        fmt::format("corrupted request from {}: {} bytes, shorter than a header", from, count));
  wire::Header& h = request_header_;
  std::memcpy(&h, request_buffer_.data(), kHeaderBytes);
  const auto bad = [&](const std::string& problem) {
    abort_job(fmt::format("corrupted request from {}: {}", from, problem));
  };
  if (h.magic != wire::kMagic) bad(fmt::format("bad magic {:#x}", h.magic));
  if (h.version != wire::kProtocolVersion) bad(fmt::format("protocol version {}", h.version));
  if (h.sequence != sequence_ + 1)
    bad(fmt::format("sequence {} (expected {})", h.sequence, sequence_ + 1));
  sequence_ = h.sequence;
  if (h.opcode == uint16_t(wire::Opcode::kShutdown)) return false;
  if (h.opcode != uint16_t(wire::Opcode::kExpertRequest))
    bad(fmt::format("unknown opcode {}", h.opcode));
  if (h.layer < 0 || h.layer >= placement_.num_layers)
    bad(fmt::format("layer {} out of range", h.layer));
  if (h.n_rows == 0 || h.n_rows > uint32_t(shape_.max_rows))
    bad(fmt::format("{} rows (at most {})", h.n_rows, shape_.max_rows));
  if (h.n_pairs < h.n_rows || h.n_pairs > h.n_rows * uint32_t(shape_.top_k))
    bad(fmt::format("{} pairs for {} rows", h.n_pairs, h.n_rows));
  const size_t expected = wire::request_payload_bytes(h.n_rows, h.n_pairs, shape_.hidden);
  if (h.payload_bytes != expected || size_t(count) != kHeaderBytes + expected)
    bad(fmt::format("{} bytes (expected {})", count, kHeaderBytes + expected));
  const std::byte* payload = request_buffer_.data() + kHeaderBytes;
  if (wire::checksum(payload, expected) != h.checksum) bad("payload checksum mismatch");
  layer_ = h.layer;
  request.layer = h.layer;
  request.n_rows = int(h.n_rows);
  request.rows = reinterpret_cast<const float*>(payload);
  request.n_pairs = int(h.n_pairs);
  request.pairs = reinterpret_cast<const wire::Pair*>(payload + size_t(h.n_rows) * shape_.hidden *
                                                                    sizeof(float));
  for (int i = 0; i < request.n_pairs; ++i) {
    const wire::Pair& pair = request.pairs[i];
    if (pair.row >= h.n_rows || pair.expert >= uint32_t(placement_.num_experts) ||
        !std::isfinite(pair.weight))
      bad(fmt::format("pair {} = (row {}, expert {}, weight {}) is invalid", i, pair.row,
                      pair.expert, pair.weight));
    if (placement_.owner_of(h.layer, int(pair.expert)) != rank_)
      bad(fmt::format("expert {} of layer {} is not owned by this rank", pair.expert, h.layer));
  }
  RankReport& counters = profiler_.counters();
  counters.rows += h.n_rows;
  counters.experts += h.n_pairs;
  counters.bytes_in += size_t(count);
  return true;
}

void MpiTransport::reply(const float* partial) {
  auto scope = profiler_.scope(Phase::kSend, layer_);
  std::vector<MPI_Request*> previous{&reply_send_};
  wait_all(previous, {coordinator_}, "reply delivery", layer_);
  const wire::Header& request = request_header_;
  const size_t payload_bytes = wire::reply_payload_bytes(request.n_rows, shape_.hidden);
  std::byte* payload = reply_buffer_.data() + kHeaderBytes;
  std::memcpy(payload, partial, payload_bytes);
  const wire::Header header{wire::kMagic,
                            wire::kProtocolVersion,
                            uint16_t(wire::Opcode::kExpertReply),
                            request.sequence,
                            request.layer,
                            request.n_rows,
                            0,
                            uint32_t(payload_bytes),
                            wire::checksum(payload, payload_bytes)};
  std::memcpy(reply_buffer_.data(), &header, kHeaderBytes);
  if (request.layer == options_.corrupt_reply_at_layer)
    payload[payload_bytes / 2] ^= std::byte{0x5a};
  CHECK_MPI(MPI_Isend(reply_buffer_.data(), int(kHeaderBytes + payload_bytes), MPI_BYTE,
                      coordinator_, wire::kTagReply, comm_, &reply_send_));
  RankReport& counters = profiler_.counters();
  counters.bytes_out += kHeaderBytes + payload_bytes;
  counters.bytes_to_rank[coordinator_] += kHeaderBytes + payload_bytes;
  post_request_receive();
}

}  // namespace colibri
