#include "transport/mpi_transport.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>

#include "common/error.h"
#include "transport/deadline.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

// The heartbeat: a header alone. It never changes, so sends of it need no buffer of their own.
const wire::Header& heartbeat_header() {
  static const wire::Header header{wire::kMagic,
                                   wire::kProtocolVersion,
                                   uint16_t(wire::Opcode::kHeartbeat),
                                   0,
                                   -1,
                                   0,
                                   0,
                                   0,
                                   wire::checksum(nullptr, 0)};
  return header;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Writes `values` floats at src to dst in the wire type and adds the bytes written to `sum`: an
// fp32 wire copies and sums in one pass (Checksum::add_copy), without reading dst back.
void write_summed(const float* src, size_t values, ElemType wire_type, std::byte* dst,
                  wire::Checksum& sum) {
  if (wire_type == ElemType::kF32) {
    sum.add_copy(dst, reinterpret_cast<const std::byte*>(src), values * sizeof(float));
    return;
  }
  from_f32(src, values, wire_type, dst);
  sum.add(dst, values * elem_bytes(wire_type));
}

void require_host_f32(ConstView v, const char* what) {
  if (v.device != Device::kHost || v.type != ElemType::kF32)
    fail("the MPI transport takes {} as fp32 host memory", what);
}

// The same at start-up, over an array of requests.
void wait_at_setup(std::vector<MPI_Request>& requests, const std::vector<int>& peer_ranks,
                   double limit_s, const char* what) {
  std::vector<MPI_Request*> pointers;
  for (MPI_Request& request : requests) pointers.push_back(&request);
  wait_within(pointers, peer_ranks, limit_s, what, "", "--startup-timeout");
}

size_t round_up_64(size_t bytes) {
  return (bytes + 63) / 64 * 64;
}

}  // namespace

void wait_within(const std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
                 double limit_s, const char* what, const std::string& where, const char* flag) {
  WaitClock clock;
  Backoff backoff;
  for (;;) {
    bool all_done = true;
    for (MPI_Request* request : requests) {
      if (*request == MPI_REQUEST_NULL) continue;
      int done = 0;
      CHECK_MPI(MPI_Test(request, &done, MPI_STATUS_IGNORE));
      if (!done) all_done = false;
    }
    if (all_done) return;
    if (clock.elapsed() > limit_s)
      for (size_t i = 0; i < requests.size(); ++i)
        if (*requests[i] != MPI_REQUEST_NULL)
          abort_job(fmt::format("{} is silent: no {} within {:.1f} s{} ({})",
                                rank_identity().name_of(peer_ranks[i]), what, limit_s, where,
                                flag));
    backoff.pause();
  }
}

void SharedSegment::unmap() {
  if (base) ::munmap(base, bytes);
  base = nullptr;
}

void MpiTransport::share_segments(const std::vector<bool>& sharing) {
  const size_t area = round_up_64(size_t(shape_.max_rows) * size_t(shape_.hidden) * elem_bytes_);
  const size_t bytes = 2 * area;
  if (rank_ != coordinator_) {
    if (!sharing[size_t(rank_)]) return;
    wire::SharedSegmentOffer offer{-1, -1, bytes, 0};
    const int fd = ::memfd_create("colibri-exchange", MFD_CLOEXEC);
    void* base = MAP_FAILED;
    if (fd >= 0 && ::ftruncate(fd, off_t(bytes)) == 0)
      base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base != MAP_FAILED) {
      std::random_device random;
      offer = {int32_t(::getpid()), fd, bytes, uint64_t(random()) << 32 | random()};
      std::memcpy(base, &offer.nonce, sizeof offer.nonce);
    }
    uint8_t answer = 0;
    std::vector<MPI_Request> requests(2, MPI_REQUEST_NULL);
    CHECK_MPI(MPI_Isend(&offer, int(sizeof offer), MPI_BYTE, coordinator_, wire::kTagSharedSegment,
                        comm_, &requests[0]));
    CHECK_MPI(MPI_Irecv(&answer, 1, MPI_BYTE, coordinator_, wire::kTagSharedSegment, comm_,
                        &requests[1]));
    wait_at_setup(requests, {coordinator_, coordinator_}, options_.setup_timeout_s,
                  "answer to this rank's shared segment");
    if (fd >= 0) ::close(fd);  // the mappings keep the memory
    if (base == MAP_FAILED) return;
    if (answer == 1)
      segment_ = {static_cast<std::byte*>(base), bytes, area};
    else
      ::munmap(base, bytes);
    return;
  }
  std::vector<wire::SharedSegmentOffer> offers(peers_.size());
  std::vector<MPI_Request> receives(peers_.size(), MPI_REQUEST_NULL);
  std::vector<int> ranks;
  for (size_t i = 0; i < peers_.size(); ++i) {
    ranks.push_back(peers_[i].rank);
    if (sharing[size_t(peers_[i].rank)])
      CHECK_MPI(MPI_Irecv(&offers[i], int(sizeof(wire::SharedSegmentOffer)), MPI_BYTE,
                          peers_[i].rank, wire::kTagSharedSegment, comm_, &receives[i]));
  }
  wait_at_setup(receives, ranks, options_.setup_timeout_s, "shared segment offer");
  std::vector<uint8_t> answers(peers_.size(), 0);
  std::vector<MPI_Request> sends(peers_.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (!sharing[size_t(peers_[i].rank)]) continue;
    const wire::SharedSegmentOffer& offer = offers[i];
    if (offer.pid > 0 && offer.fd >= 0 && offer.bytes == bytes) {
      const std::string path = fmt::format("/proc/{}/fd/{}", offer.pid, offer.fd);
      const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      struct stat st {};
      if (fd >= 0 && ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && size_t(st.st_size) == bytes) {
        void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        uint64_t nonce = 0;
        if (base != MAP_FAILED) std::memcpy(&nonce, base, sizeof nonce);
        if (base != MAP_FAILED && nonce == offer.nonce) {
          peers_[i].segment = {static_cast<std::byte*>(base), bytes, area};
          answers[i] = 1;
        } else if (base != MAP_FAILED) {
          ::munmap(base, bytes);
        }
      }
      if (fd >= 0) ::close(fd);
    }
    CHECK_MPI(MPI_Isend(&answers[i], 1, MPI_BYTE, peers_[i].rank, wire::kTagSharedSegment, comm_,
                        &sends[i]));
  }
  wait_at_setup(sends, ranks, options_.setup_timeout_s, "receipt of its shared segment answer");
}

MpiTransport::MpiTransport(MPI_Comm comm, const PlacementTable& placement,
                           const ExchangeShape& shape, int coordinator, Profiler& profiler,
                           const MpiTransportOptions& options)
    : comm_(comm),
      placement_(placement),
      shape_(shape),
      coordinator_(coordinator),
      profiler_(profiler),
      options_(options),
      elem_bytes_(elem_bytes(options.wire_type)) {
  int size = 0;
  CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  CHECK_MPI(MPI_Comm_size(comm_, &size));
  const size_t max_pairs = size_t(shape_.max_rows) * size_t(shape_.top_k);
  const size_t request_bytes =
      kHeaderBytes + wire::request_payload_bytes(uint32_t(shape_.max_rows), uint32_t(max_pairs),
                                                 shape_.hidden, elem_bytes_);
  const size_t reply_bytes = kHeaderBytes + wire::reply_payload_bytes(uint32_t(shape_.max_rows),
                                                                      shape_.hidden, elem_bytes_);
  const size_t host_partial_bytes =
      kHeaderBytes +
      wire::host_partial_payload_bytes(uint32_t(shape_.max_rows), shape_.hidden, sizeof(float));
  const auto host_of = [&](int r) {
    return options_.host_of.empty() ? r : options_.host_of.at(size_t(r));
  };
  const auto served = [&](int r) {
    if (r == coordinator_) return false;
    const std::vector<int>& only = options_.expert_ranks;
    return only.empty() || std::find(only.begin(), only.end(), r) != only.end();
  };
  // The expert ranks of a rank's host, ascending (empty without host combine or when alone).
  const auto host_group = [&](int r) {
    std::vector<int> group;
    if (!options_.host_combine) return group;
    for (int q = 0; q < size; ++q)
      if (served(q) && host_of(q) == host_of(r)) group.push_back(q);
    if (group.size() < 2) group.clear();
    return group;
  };
  if (rank_ == coordinator_) {
    owner_peer_.assign(size_t(size), -1);
    slowest_.assign(size_t(size), 0);
    for (int r = 0; r < size; ++r) {
      if (!served(r)) continue;
      owner_peer_[size_t(r)] = int(peers_.size());
      Peer& peer = peers_.emplace_back();
      peer.rank = r;
      peer.send.resize(request_bytes);
      peer.recv.resize(reply_bytes);
      peer.remote = host_of(r) != host_of(coordinator_);
    }
    for (Peer& peer : peers_) {
      const std::vector<int> group = host_group(peer.rank);
      if (group.empty()) continue;
      peer.leader = owner_peer_[size_t(group.front())];
      if (group.front() == peer.rank)
        for (int q : group) peer.members.push_back(owner_peer_[size_t(q)]);
    }
    row_marks_.assign(size_t(shape_.max_rows), 0);
    active_.reserve(peers_.size());
    repliers_.reserve(peers_.size());
    heard_ns_ = std::make_unique<std::atomic<int64_t>[]>(peers_.size());
    busy_ = std::make_unique<std::atomic<bool>[]>(peers_.size());
    for (size_t i = 0; i < peers_.size(); ++i) {
      heard_ns_[i] = 0;
      busy_[i] = false;
    }
    row_f32_.resize(size_t(shape_.hidden));
    if (options_.heartbeat_s > 0 && !peers_.empty())
      heartbeat_ = std::thread([this] { send_heartbeats(); });
  } else {
    request_buffer_.resize(request_bytes);
    reply_buffer_.resize(std::max(reply_bytes, host_partial_bytes));
    request_pairs_.reserve(max_pairs);
    request_rows_.reserve(size_t(shape_.max_rows));
    reply_to_ = coordinator_;
    const std::vector<int> group = host_group(rank_);
    if (!group.empty() && group.front() != rank_) reply_to_ = group.front();
    if (!group.empty() && group.front() == rank_) {
      mates_.assign(group.begin() + 1, group.end());
      mate_buffers_.assign(mates_.size(), std::vector<std::byte>(host_partial_bytes));
      mate_receives_.assign(mates_.size(), MPI_REQUEST_NULL);
      host_sum_.resize(size_t(shape_.max_rows) * size_t(shape_.hidden));
      slot_.assign(size_t(shape_.max_rows), -1);
      row_f32_.resize(size_t(shape_.hidden));
    }
    control_buffer_.resize(kHeaderBytes);
  }
  // Every expert rank on the coordinator's host that replies to it directly.
  std::vector<bool> sharing(size_t(size), false);
  for (int r = 0; r < size; ++r)
    sharing[size_t(r)] = options_.shared_memory && served(r) &&
                         host_of(r) == host_of(coordinator_) && host_group(r).empty();
  share_segments(sharing);
  if (rank_ != coordinator_) {
    post_request_receive();
    post_control_receive();
  }
}

MpiTransport::~MpiTransport() {
  stop_heartbeat();
  // Receives still posted at exit (an expert rank after shutdown has none) are cancelled.
  std::vector<MPI_Request*> receives = {&request_receive_, &control_receive_};
  for (MPI_Request& receive : mate_receives_) receives.push_back(&receive);
  for (MPI_Request* receive : receives) {
    if (*receive == MPI_REQUEST_NULL) continue;
    MPI_Cancel(receive);
    MPI_Request_free(receive);
  }
  // The answer header is static: a send still in flight may complete on its own.
  if (answer_send_ != MPI_REQUEST_NULL) MPI_Request_free(&answer_send_);
  segment_.unmap();
  for (Peer& peer : peers_) peer.segment.unmap();
}

void MpiTransport::post_request_receive() {
  CHECK_MPI(MPI_Irecv(request_buffer_.data(), int(request_buffer_.size()), MPI_BYTE, coordinator_,
                      wire::kTagRequest, comm_, &request_receive_));
}

void MpiTransport::post_control_receive() {
  CHECK_MPI(MPI_Irecv(control_buffer_.data(), int(control_buffer_.size()), MPI_BYTE, coordinator_,
                      wire::kTagControl, comm_, &control_receive_));
}

void MpiTransport::send_heartbeats() {
  const auto period = std::chrono::duration<double>(options_.heartbeat_s);
  // One heartbeat in flight per peer: a peer that does not take them gets no more.
  std::vector<MPI_Request> sends(peers_.size(), MPI_REQUEST_NULL);
  std::unique_lock lock(heartbeat_mutex_);
  int64_t last_round = 0;
  for (;;) {
    for (size_t i = 0; i < peers_.size(); ++i) {
      if (sends[i] != MPI_REQUEST_NULL) {
        int done = 0;
        CHECK_MPI(MPI_Test(&sends[i], &done, MPI_STATUS_IGNORE));
      }
      if (sends[i] == MPI_REQUEST_NULL)
        CHECK_MPI(MPI_Isend(&heartbeat_header(), int(kHeaderBytes), MPI_BYTE, peers_[i].rank,
                            wire::kTagControl, comm_, &sends[i]));
    }
    take_answers();
    // After a pause of this process (stopped, or not scheduled), the peers' answers to the
    // heartbeats it did not send are not missing: their silence counts from now.
    const int64_t now = now_ns();
    if (last_round != 0 &&
        now - last_round > int64_t((options_.heartbeat_s + WaitClock::kPauseSeconds) * 1e9)) {
      for (size_t i = 0; i < peers_.size(); ++i)
        if (heard_ns_[i] != 0) heard_ns_[i] = now;
    }
    last_round = now;
    check_idle_peers();
    if (heartbeat_wake_.wait_for(lock, period, [this] { return heartbeat_stop_; })) break;
  }
  // The header is static: a send still in flight may complete on its own.
  for (MPI_Request& send : sends)
    if (send != MPI_REQUEST_NULL) MPI_Request_free(&send);
}

void MpiTransport::take_answers() {
  for (;;) {
    int found = 0;
    MPI_Message message;
    MPI_Status status;
    CHECK_MPI(MPI_Improbe(MPI_ANY_SOURCE, wire::kTagControl, comm_, &found, &message, &status));
    if (!found) return;
    int count = 0;
    CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &count));
    std::vector<std::byte> bytes(size_t(std::max(count, 0)));
    CHECK_MPI(MPI_Mrecv(bytes.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE));
    const int source = status.MPI_SOURCE;
    const int index =
        source >= 0 && size_t(source) < owner_peer_.size() ? owner_peer_[size_t(source)] : -1;
    wire::Header h{};
    if (bytes.size() == kHeaderBytes) std::memcpy(&h, bytes.data(), kHeaderBytes);
    if (index < 0 || bytes.size() != kHeaderBytes || h.magic != wire::kMagic ||
        h.version != wire::kProtocolVersion || h.opcode != uint16_t(wire::Opcode::kHeartbeat))
      abort_job(fmt::format("corrupted control message from {}: {} bytes, opcode {}",
                            rank_identity().name_of(source), count, h.opcode));
    heard_ns_[size_t(index)] = now_ns();
  }
}

void MpiTransport::check_idle_peers() {
  const int64_t now = now_ns();
  const auto limit_ns = int64_t(options_.rank_timeout_s * 1e9);
  for (size_t i = 0; i < peers_.size(); ++i) {
    const int64_t heard = heard_ns_[i];
    // Not yet answered (still starting), or holding a request (combine has its deadline).
    if (heard == 0 || busy_[i]) continue;
    if (now - heard > limit_ns)
      abort_job(fmt::format(
          "{} is silent: no answer to the coordinator's heartbeats within {:.1f} s while it "
          "waited for a request (--rank-timeout)",
          rank_identity().name_of(peers_[i].rank), options_.rank_timeout_s));
  }
}

void MpiTransport::stop_heartbeat() {
  if (!heartbeat_.joinable()) return;
  {
    std::lock_guard lock(heartbeat_mutex_);
    heartbeat_stop_ = true;
  }
  heartbeat_wake_.notify_all();
  heartbeat_.join();
}

bool MpiTransport::take_heartbeats() {
  bool any = false;
  for (;;) {
    int done = 0;
    MPI_Status status;
    CHECK_MPI(MPI_Test(&control_receive_, &done, &status));
    if (!done) return any;
    int count = 0;
    CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &count));
    wire::Header h;
    std::memcpy(&h, control_buffer_.data(), kHeaderBytes);
    if (size_t(count) != kHeaderBytes || h.magic != wire::kMagic ||
        h.version != wire::kProtocolVersion || h.opcode != uint16_t(wire::Opcode::kHeartbeat))
      abort_job(fmt::format("corrupted control message from {}: {} bytes, opcode {}",
                            rank_identity().name_of(coordinator_), count, h.opcode));
    any = true;
    post_control_receive();
    // Answer, one answer in flight at most: the coordinator learns this rank is waiting.
    int answered = 1;
    if (answer_send_ != MPI_REQUEST_NULL)
      CHECK_MPI(MPI_Test(&answer_send_, &answered, MPI_STATUS_IGNORE));
    if (answered)
      CHECK_MPI(MPI_Isend(&heartbeat_header(), int(kHeaderBytes), MPI_BYTE, coordinator_,
                          wire::kTagControl, comm_, &answer_send_));
  }
}

void MpiTransport::wait_all(std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
                            const char* what, int layer) {
  wait_within(requests, peer_ranks, options_.rank_timeout_s, what,
              fmt::format(" in the layer {} exchange", layer), "--rank-timeout");
}

void MpiTransport::dispatch(const DispatchPlan& plan, ConstView x) {
  auto scope = profiler_.scope(Phase::kDispatch, plan.layer);
  require_host_f32(x, "dispatched rows");
  const int n = plan.n_rows, hidden = shape_.hidden;
  if (n > shape_.max_rows)
    fail("{} rows exceed the exchange buffers sized for {} rows", n, shape_.max_rows);
  if (x.count < size_t(n) * hidden) fail("dispatch: {} values for {} rows", x.count, n);
  layer_ = plan.layer;
  n_rows_ = n;
  const auto* rows_f32 = static_cast<const float*>(x.data);
  const size_t row_bytes = size_t(hidden) * elem_bytes_;
  const size_t max_pairs = size_t(shape_.max_rows) * size_t(shape_.top_k);

  for (Peer& peer : peers_) peer.share = nullptr;
  for (const OwnerShare& share : plan.owners) {
    const int index = share.rank >= 0 && size_t(share.rank) < owner_peer_.size()
                          ? owner_peer_[size_t(share.rank)]
                          : -1;
    if (index < 0)
      fail("layer {}: experts placed on rank {}, which is not an expert rank", plan.layer,
           share.rank);
    peers_[size_t(index)].share = &share;
  }
  // With host combine, every expert rank of a host with work gets a request (an empty one when
  // it has no rows), so that its leader knows whom to wait for.
  const auto host_has_work = [&](const Peer& peer) {
    if (peer.leader < 0) return false;
    for (int m : peers_[size_t(peer.leader)].members)
      if (peers_[size_t(m)].share && peers_[size_t(m)].share != &empty_share_) return true;
    return false;
  };
  active_.clear();
  repliers_.clear();
  RankReport& counters = profiler_.counters();
  for (size_t index = 0; index < peers_.size(); ++index) {
    Peer& peer = peers_[index];
    if (!peer.share && !host_has_work(peer)) continue;
    if (!peer.share) peer.share = &empty_share_;
    const OwnerShare& share = *peer.share;
    active_.push_back(&peer);
    busy_[index] = true;
    peer.replies = peer.leader < 0 || peer.leader == int(index);
    if (peer.leader == int(index)) {  // the union of its host's rows, ascending
      peer.reply_rows.clear();
      for (int m : peer.members) {
        const OwnerShare* member = peers_[size_t(m)].share;
        if (member)
          for (int row : member->rows) row_marks_[size_t(row)] = 1;
      }
      for (int row = 0; row < n; ++row)
        if (row_marks_[size_t(row)]) {
          peer.reply_rows.push_back(row);
          row_marks_[size_t(row)] = 0;
        }
    } else if (peer.replies) {
      peer.reply_rows.assign(share.rows.begin(), share.rows.end());
    }
    if (peer.replies) repliers_.push_back(&peer);
    const uint32_t n_rows = uint32_t(share.rows.size()), n_pairs = uint32_t(share.pairs.size());
    if (n_pairs > max_pairs) fail("{} routed pairs exceed the exchange buffers", n_pairs);
    const bool shared = peer.segment.base != nullptr;
    std::byte* payload = peer.send.data() + kHeaderBytes;
    std::byte* rows = shared ? peer.segment.request_rows() : payload;
    // Each row is checksummed as it is written (write_summed).
    wire::Checksum rows_sum;
    for (uint32_t r = 0; r < n_rows; ++r)
      write_summed(rows_f32 + size_t(share.rows[r]) * hidden, size_t(hidden), options_.wire_type,
                   rows + r * row_bytes, rows_sum);
    std::byte* pairs = shared ? payload : payload + n_rows * row_bytes;
    for (uint32_t i = 0; i < n_pairs; ++i) {
      const wire::Pair pair{share.pairs[i].row, share.pairs[i].expert, share.pairs[i].weight};
      std::memcpy(pairs + size_t(i) * sizeof(wire::Pair), &pair, sizeof(wire::Pair));
    }
    std::byte* row_indices = pairs + size_t(n_pairs) * sizeof(wire::Pair);
    for (uint32_t r = 0; r < n_rows; ++r) {
      const auto row = uint32_t(share.rows[r]);
      std::memcpy(row_indices + size_t(r) * sizeof(row), &row, sizeof(row));
    }
    const size_t payload_bytes =
        shared ? wire::shared_request_payload_bytes(n_rows, n_pairs)
               : wire::request_payload_bytes(n_rows, n_pairs, hidden, elem_bytes_);
    uint32_t sum = 0;
    if (shared) {
      sum = wire::shared_checksum(rows_sum.value(), wire::checksum(payload, payload_bytes));
    } else {  // the pairs and row indices follow the rows
      rows_sum.add(pairs, payload_bytes - n_rows * row_bytes);
      sum = rows_sum.value();
    }
    const wire::Header header{
        wire::kMagic,
        wire::kProtocolVersion,
        uint16_t(shared ? wire::Opcode::kSharedRequest : wire::Opcode::kExpertRequest),
        ++peer.sequence,
        plan.layer,
        n_rows,
        n_pairs,
        uint32_t(payload_bytes),
        sum};
    std::memcpy(peer.send.data(), &header, kHeaderBytes);
    // The reply receive is posted before the request leaves.
    if (peer.replies)
      CHECK_MPI(MPI_Irecv(peer.recv.data(), int(peer.recv.size()), MPI_BYTE, peer.rank,
                          wire::kTagReply, comm_, &peer.recv_request));
    CHECK_MPI(MPI_Isend(peer.send.data(), int(kHeaderBytes + payload_bytes), MPI_BYTE, peer.rank,
                        wire::kTagRequest, comm_, &peer.send_request));
    // Counted as the bytes of the request, wherever its rows went.
    const size_t sent = kHeaderBytes + payload_bytes + (shared ? n_rows * row_bytes : 0);
    counters.rows += n_rows;
    counters.experts += n_pairs;
    counters.bytes_out += sent;
    counters.bytes_to_rank[peer.rank] += sent;
    if (shared) counters.bytes_shared += n_rows * row_bytes;
    if (peer.remote) counters.bytes_cross_host += sent;
  }
  dispatched_us_ = profiler_.now_us();
}

void MpiTransport::validate_reply(Peer& peer, int count_bytes) {
  wire::ReplyCheck check;
  check.expected_sequence = peer.sequence;
  check.layer = layer_;
  check.n_rows = uint32_t(peer.reply_rows.size());
  check.hidden = shape_.hidden;
  check.elem_bytes = elem_bytes_;
  wire::Header h;
  const std::string problem = wire::check_reply_header(
      peer.recv.data(), size_t(std::max(count_bytes, 0)), check, peer.segment.base != nullptr, h);
  peer.reply_checksum = h.checksum;
  if (!problem.empty())
    abort_job(fmt::format("corrupted reply from {} in layer {}: {}",
                          rank_identity().name_of(peer.rank), layer_, problem));
}

void MpiTransport::combine(View out) {
  require_host_f32(out, "the combined partials");
  wait_partials();
  {
    auto scope = profiler_.scope(Phase::kCombine, layer_);
    auto* sum = static_cast<float*>(out.data);
    const int hidden = shape_.hidden;
    row_started_.assign(size_t(n_rows_), 0);
    for (size_t i = 0; i < repliers_.size(); ++i)  // ascending rank: a fixed summation order
      add_partial(i, sum, row_started_);
    for (int t = 0; t < n_rows_; ++t)  // rows no owner was sent
      if (!row_started_[size_t(t)]) std::fill_n(sum + size_t(t) * hidden, hidden, 0.0f);
  }
  finish_combine();
}

void MpiTransport::wait_partials() {
  std::vector<MPI_Request*> requests;
  std::vector<int> ranks;
  std::vector<double> limits;  // a host leader waits for its host-mates first: it names them
  for (Peer* peer : repliers_) {
    requests.push_back(&peer->recv_request);
    ranks.push_back(peer->rank);
    limits.push_back(options_.rank_timeout_s + (peer->leader >= 0 ? kAbortTeardownSeconds : 0));
  }
  {
    auto scope = profiler_.scope(Phase::kWaitSlowest, layer_);
    std::vector<MPI_Status> statuses(requests.size());
    WaitClock clock;
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
        {
          const auto index = size_t(owner_peer_[size_t(ranks[i])]);
          std::vector<int> heard{int(index)};
          if (peers_[index].leader == int(index)) heard = peers_[index].members;
          for (int h : heard) {
            if (heard_ns_[size_t(h)] != 0) heard_ns_[size_t(h)] = now_ns();
            busy_[size_t(h)] = false;
          }
        }
        profiler_.counters().reply_us[ranks[i]] += profiler_.now_us() - dispatched_us_;
        last = int(i);
        --remaining;
      }
      if (remaining == 0) break;
      const double elapsed = clock.elapsed();
      for (size_t i = 0; i < requests.size(); ++i)
        if (*requests[i] != MPI_REQUEST_NULL && elapsed > limits[i])
          abort_job(fmt::format(
              "{} is silent: no reply within {:.1f} s in the layer {} exchange (--rank-timeout)",
              rank_identity().name_of(ranks[i]), options_.rank_timeout_s, layer_));
      backoff.pause();
    }
    if (last >= 0) ++slowest_[size_t(ranks[size_t(last)])];
    for (size_t i = 0; i < repliers_.size(); ++i) validate_reply(*repliers_[i], counts[i]);
  }
  replier_ranks_ = ranks;
}

void MpiTransport::add_partial(size_t i, float* sum, std::span<uint8_t> started) {
  const Peer* peer = repliers_.at(i);
  const int hidden = shape_.hidden;
  const size_t row_bytes = size_t(hidden) * elem_bytes_;
  const std::byte* partial =
      peer->segment.base ? peer->segment.reply_rows() : peer->recv.data() + kHeaderBytes;
  const std::vector<int>& rows = peer->reply_rows;
  // The rows are checksummed as they are added (the reply's header was checked on arrival); a
  // mismatch found after adding ends the job all the same.
  wire::Checksum rows_sum;
  for (size_t r = 0; r < rows.size(); ++r) {
    float* dst = sum + size_t(rows[r]) * hidden;
    const bool first = !started[size_t(rows[r])];
    if (options_.wire_type == ElemType::kF32) {  // one pass
      rows_sum.add_accumulate(dst, partial + r * row_bytes, size_t(hidden), first);
    } else {
      rows_sum.add(partial + r * row_bytes, row_bytes);
      to_f32({partial + r * row_bytes, options_.wire_type, Device::kHost, size_t(hidden)},
             row_f32_.data());
      wire::add_row(dst, row_f32_.data(), size_t(hidden), first);
    }
    started[size_t(rows[r])] = 1;
  }
  if (rows_sum.value() != peer->reply_checksum)
    abort_job(fmt::format("corrupted reply from {} in layer {}: payload checksum mismatch",
                          rank_identity().name_of(peer->rank), layer_));
  const size_t reply_bytes =
      kHeaderBytes + wire::reply_payload_bytes(uint32_t(rows.size()), hidden, elem_bytes_);
  RankReport& counters = profiler_.counters();
  counters.bytes_in += reply_bytes;
  if (peer->segment.base) counters.bytes_shared += reply_bytes - kHeaderBytes;
  if (peer->remote) counters.bytes_cross_host += reply_bytes;
}

void MpiTransport::finish_combine() {
  std::vector<MPI_Request*> sends;
  std::vector<int> send_ranks;
  for (Peer* peer : active_) {
    sends.push_back(&peer->send_request);
    send_ranks.push_back(peer->rank);
  }
  wait_all(sends, send_ranks, "request delivery", layer_);
  for (Peer* peer : active_) peer->share = nullptr;
}

void MpiTransport::hint(int layer, std::span<const OwnerHint> hints) {
  std::vector<MPI_Request*> previous;
  std::vector<int> ranks;
  for (const OwnerHint& h : hints) {
    const int index = size_t(h.rank) < owner_peer_.size() ? owner_peer_[size_t(h.rank)] : -1;
    if (index < 0 || h.experts.empty()) continue;
    Peer& peer = peers_[size_t(index)];
    if (peer.hint_request != MPI_REQUEST_NULL) {
      previous = {&peer.hint_request};
      ranks = {peer.rank};
      wait_all(previous, ranks, "hint delivery", layer);
    }
    const size_t bytes = h.experts.size() * 4;
    if (kHeaderBytes + bytes > peer.send.size()) continue;  // larger than its receive buffer
    peer.hint.resize(kHeaderBytes + bytes);
    for (size_t i = 0; i < h.experts.size(); ++i) {
      const auto expert = uint32_t(h.experts[i]);
      std::memcpy(peer.hint.data() + kHeaderBytes + 4 * i, &expert, 4);
    }
    const wire::Header header{wire::kMagic,
                              wire::kProtocolVersion,
                              uint16_t(wire::Opcode::kPrefetchHint),
                              ++peer.sequence,
                              layer,
                              0,
                              uint32_t(h.experts.size()),
                              uint32_t(bytes),
                              wire::checksum(peer.hint.data() + kHeaderBytes, bytes)};
    std::memcpy(peer.hint.data(), &header, kHeaderBytes);
    CHECK_MPI(MPI_Isend(peer.hint.data(), int(kHeaderBytes + bytes), MPI_BYTE, peer.rank,
                        wire::kTagRequest, comm_, &peer.hint_request));
    profiler_.counters().bytes_out += kHeaderBytes + bytes;
  }
}

void MpiTransport::shutdown() {
  stop_heartbeat();
  {
    std::vector<MPI_Request*> hints;
    std::vector<int> ranks;
    for (Peer& peer : peers_)
      if (peer.hint_request != MPI_REQUEST_NULL) {
        hints.push_back(&peer.hint_request);
        ranks.push_back(peer.rank);
      }
    wait_all(hints, ranks, "hint delivery", -1);
  }
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

void MpiTransport::change_placement(const PlacementChange& change) {
  if (peers_.empty()) return;
  const std::vector<uint32_t> words = encode_holder_changes(change.changes);
  // In messages that fit an expert rank's request buffer, whole changes each, the epoch first.
  const size_t capacity = (peers_.empty() ? 0 : peers_.front().send.size() - kHeaderBytes) / 4 - 1;
  size_t at = 0;
  while (at < words.size()) {
    size_t end = at, changes = 0;
    while (end < words.size() && end + 3 + words[end + 2] - at <= capacity) {
      end += 3 + words[end + 2];
      ++changes;
    }
    if (changes == 0)
      fail("a change of placement of {} holders does not fit a request of {} bytes", words[at + 2],
           capacity * 4);
    std::vector<uint32_t> message{change.epoch};
    message.insert(message.end(), words.begin() + int64_t(at), words.begin() + int64_t(end));
    const size_t bytes = message.size() * 4;
    const uint32_t sum = wire::checksum(reinterpret_cast<const std::byte*>(message.data()), bytes);
    std::vector<MPI_Request*> sends;
    std::vector<int> ranks;
    for (Peer& peer : peers_) {
      const wire::Header header{wire::kMagic,
                                wire::kProtocolVersion,
                                uint16_t(wire::Opcode::kPlacement),
                                ++peer.sequence,
                                -1,
                                change.commit ? 1u : 0u,
                                uint32_t(changes),
                                uint32_t(bytes),
                                sum};
      std::memcpy(peer.send.data(), &header, kHeaderBytes);
      std::memcpy(peer.send.data() + kHeaderBytes, message.data(), bytes);
      CHECK_MPI(MPI_Isend(peer.send.data(), int(kHeaderBytes + bytes), MPI_BYTE, peer.rank,
                          wire::kTagRequest, comm_, &peer.send_request));
      sends.push_back(&peer.send_request);
      ranks.push_back(peer.rank);
    }
    wait_all(sends, ranks, "placement delivery", -1);
    at = end;
  }
}

bool MpiTransport::receive(ExpertRequest& request) {
  for (;;)
    if (receive_one(request)) return request.layer >= 0;
}

bool MpiTransport::receive_one(ExpertRequest& request) {
  MPI_Status status;
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
        if (take_heartbeats()) heard.restart();
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
  int count = 0;
  CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &count));
  const wire::RequestCheck check =
      expert_request_check(placement_, shape_, elem_bytes_, rank_, sequence_ + 1);
  wire::Header& h = request_header_;
  const std::string problem =
      wire::check_request(request_buffer_.data(), size_t(count), check, h, segment_.base);
  if (!problem.empty())
    abort_job(fmt::format("corrupted request from {}: {}", rank_identity().name_of(coordinator_),
                          problem));
  sequence_ = h.sequence;
  if (h.opcode == uint16_t(wire::Opcode::kShutdown)) {
    request.layer = -1;
    return true;
  }
  if (h.opcode == uint16_t(wire::Opcode::kPlacement)) {
    std::vector<uint32_t> words(h.payload_bytes / 4);
    std::memcpy(words.data(), request_buffer_.data() + kHeaderBytes, h.payload_bytes);
    PlacementChange change;
    change.commit = h.n_rows == 1;
    int world = 0;
    CHECK_MPI(MPI_Comm_size(comm_, &world));
    const std::string bad =
        words.empty() ? "no epoch"
                      : decode_holder_changes(std::span(words).subspan(1), placement_.num_layers,
                                              placement_.num_experts, world, change.changes);
    if (!words.empty()) change.epoch = words.front();
    if (!bad.empty() || change.changes.size() != h.n_pairs)
      abort_job(fmt::format("corrupted placement change from {}: {}",
                            rank_identity().name_of(coordinator_),
                            bad.empty() ? "a count that disagrees" : bad));
    post_request_receive();
    if (placement_handler_) placement_handler_(change);
    return false;
  }
  if (h.opcode == uint16_t(wire::Opcode::kPrefetchHint)) {
    std::vector<int> experts(h.n_pairs);
    for (uint32_t i = 0; i < h.n_pairs; ++i) {
      uint32_t expert = 0;
      std::memcpy(&expert, request_buffer_.data() + kHeaderBytes + 4 * i, 4);
      experts[i] = int(expert);
    }
    post_request_receive();
    if (hint_handler_) hint_handler_(h.layer, experts);
    return false;
  }
  const bool shared = h.opcode == uint16_t(wire::Opcode::kSharedRequest);
  const std::byte* payload = request_buffer_.data() + kHeaderBytes;
  const std::byte* rows = shared ? segment_.request_rows() : payload;
  const std::byte* pairs =
      shared ? payload : payload + size_t(h.n_rows) * size_t(shape_.hidden) * elem_bytes_;
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
  for (size_t i = 0; i < mates_.size(); ++i)
    CHECK_MPI(MPI_Irecv(mate_buffers_[i].data(), int(mate_buffers_[i].size()), MPI_BYTE, mates_[i],
                        wire::kTagHostPartial, comm_, &mate_receives_[i]));
  layer_ = h.layer;
  request.layer = h.layer;
  request.n_rows = int(h.n_rows);
  request.rows = {rows, options_.wire_type, Device::kHost, size_t(h.n_rows) * shape_.hidden};
  request.pairs = request_pairs_;
  RankReport& counters = profiler_.counters();
  counters.rows += h.n_rows;
  counters.experts += h.n_pairs;
  // Counted as the bytes of the request, wherever its rows came from.
  counters.bytes_in +=
      size_t(count) + (shared ? size_t(h.n_rows) * size_t(shape_.hidden) * elem_bytes_ : 0);
  return true;
}

void MpiTransport::reply(ConstView partial) {
  auto scope = profiler_.scope(Phase::kSend, layer_);
  require_host_f32(partial, "the partial");
  std::vector<MPI_Request*> previous{&reply_send_};
  wait_all(previous, {reply_to_}, "reply delivery", layer_);
  const wire::Header& request = request_header_;
  const size_t values = size_t(request.n_rows) * shape_.hidden;
  if (partial.count < values) fail("reply: {} values for {} rows", partial.count, request.n_rows);
  if (reply_to_ != coordinator_) {
    send_host_partial(partial);
    post_request_receive();
    return;
  }
  // With a shared segment the partial goes there, and the message is the header alone.
  const bool shared = segment_.base != nullptr;
  std::byte* payload = shared ? segment_.reply_rows() : reply_buffer_.data() + kHeaderBytes;
  uint32_t n_rows = request.n_rows;
  uint32_t sum = 0;
  if (!mates_.empty()) {
    n_rows = sum_host_partials(static_cast<const float*>(partial.data));
    sum = wire::checksum(payload, wire::reply_payload_bytes(n_rows, shape_.hidden, elem_bytes_));
  } else {  // each row checksummed as it is written (write_summed)
    const size_t row_values = size_t(shape_.hidden), one_row = row_values * elem_bytes_;
    wire::Checksum rows_sum;
    for (uint32_t r = 0; r < n_rows; ++r)
      write_summed(static_cast<const float*>(partial.data) + r * row_values, row_values,
                   options_.wire_type, payload + r * one_row, rows_sum);
    sum = rows_sum.value();
  }
  const size_t row_bytes = wire::reply_payload_bytes(n_rows, shape_.hidden, elem_bytes_);
  const size_t payload_bytes = shared ? 0 : row_bytes;
  const wire::Header header{
      wire::kMagic,
      wire::kProtocolVersion,
      uint16_t(shared ? wire::Opcode::kSharedReply : wire::Opcode::kExpertReply),
      request.sequence,
      request.layer,
      n_rows,
      0,
      uint32_t(payload_bytes),
      sum};
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

void MpiTransport::send_host_partial(ConstView partial) {
  const wire::Header& request = request_header_;
  const size_t values = size_t(request.n_rows) * shape_.hidden;
  // fp32 within the host: the leader rounds the host's sum to the wire type once.
  const size_t payload_bytes =
      wire::host_partial_payload_bytes(request.n_rows, shape_.hidden, sizeof(float));
  std::byte* payload = reply_buffer_.data() + kHeaderBytes;
  if (values > 0) std::memcpy(payload, partial.data, values * sizeof(float));
  if (request.n_rows > 0)
    std::memcpy(payload + values * sizeof(float), request_rows_.data(),
                size_t(request.n_rows) * sizeof(uint32_t));
  const wire::Header header{wire::kMagic,
                            wire::kProtocolVersion,
                            uint16_t(wire::Opcode::kHostPartial),
                            request.sequence,
                            request.layer,
                            request.n_rows,
                            0,
                            uint32_t(payload_bytes),
                            wire::checksum(payload, payload_bytes)};
  std::memcpy(reply_buffer_.data(), &header, kHeaderBytes);
  if (request.layer == options_.corrupt_reply_at_layer && payload_bytes > 0)
    payload[payload_bytes / 2] ^= std::byte{0x5a};
  CHECK_MPI(MPI_Isend(reply_buffer_.data(), int(kHeaderBytes + payload_bytes), MPI_BYTE, reply_to_,
                      wire::kTagHostPartial, comm_, &reply_send_));
  RankReport& counters = profiler_.counters();
  counters.bytes_out += kHeaderBytes + payload_bytes;
  counters.bytes_to_rank[reply_to_] += kHeaderBytes + payload_bytes;
}

uint32_t MpiTransport::sum_host_partials(const float* own) {
  const wire::Header& request = request_header_;
  std::vector<int> counts(mates_.size(), 0);
  {
    // The host-mates' partials, each within the deadline; a silent one is named.
    WaitClock clock;
    Backoff backoff;
    size_t remaining = mates_.size();
    while (remaining > 0) {
      for (size_t i = 0; i < mates_.size(); ++i) {
        if (mate_receives_[i] == MPI_REQUEST_NULL) continue;
        int done = 0;
        MPI_Status status;
        CHECK_MPI(MPI_Test(&mate_receives_[i], &done, &status));
        if (!done) continue;
        CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &counts[i]));
        --remaining;
      }
      if (remaining == 0) break;
      if (clock.elapsed() > options_.rank_timeout_s) {
        for (size_t i = 0; i < mates_.size(); ++i)
          if (mate_receives_[i] != MPI_REQUEST_NULL)
            abort_job(fmt::format(
                "{} is silent: no host partial for its host leader within {:.1f} s in the layer "
                "{} exchange (--rank-timeout)",
                rank_identity().name_of(mates_[i]), options_.rank_timeout_s, request.layer));
      }
      backoff.pause();
    }
  }
  wire::HostPartialCheck check;
  check.expected_sequence = request.sequence;
  check.layer = request.layer;
  check.max_rows = shape_.max_rows;
  check.hidden = shape_.hidden;
  check.elem_bytes = sizeof(float);
  std::vector<wire::Header> headers(mates_.size());
  for (size_t i = 0; i < mates_.size(); ++i) {
    const std::string problem = wire::check_host_partial(
        mate_buffers_[i].data(), size_t(std::max(counts[i], 0)), check, headers[i]);
    if (!problem.empty())
      abort_job(fmt::format("corrupted host partial from {} in layer {}: {}",
                            rank_identity().name_of(mates_[i]), request.layer, problem));
  }
  const int hidden = shape_.hidden;
  const size_t row_bytes = size_t(hidden) * sizeof(float);
  const auto mate_rows = [&](size_t i) {
    return mate_buffers_[i].data() + kHeaderBytes + size_t(headers[i].n_rows) * row_bytes;
  };
  // The union of the rows, ascending: slot_[row] is its place in the sum.
  for (uint32_t row : request_rows_) slot_[row] = 0;
  for (size_t i = 0; i < mates_.size(); ++i)
    for (uint32_t r = 0; r < headers[i].n_rows; ++r) {
      uint32_t row;
      std::memcpy(&row, mate_rows(i) + size_t(r) * sizeof(row), sizeof(row));
      slot_[row] = 0;
    }
  uint32_t n_rows = 0;
  for (int& slot : slot_)
    if (slot >= 0) slot = int(n_rows++);
  float* sum = host_sum_.data();
  std::fill(sum, sum + size_t(n_rows) * hidden, 0.0f);
  // Ascending rank: this rank (the lowest of its host) first, then its host-mates.
  for (size_t r = 0; r < request_rows_.size(); ++r) {
    float* dst = sum + size_t(slot_[request_rows_[r]]) * hidden;
    const float* src = own + r * size_t(hidden);
    for (int j = 0; j < hidden; ++j) dst[j] += src[j];
  }
  RankReport& counters = profiler_.counters();
  for (size_t i = 0; i < mates_.size(); ++i) {
    const std::byte* partial = mate_buffers_[i].data() + kHeaderBytes;
    for (uint32_t r = 0; r < headers[i].n_rows; ++r) {
      uint32_t row;
      std::memcpy(&row, mate_rows(i) + size_t(r) * sizeof(row), sizeof(row));
      float* dst = sum + size_t(slot_[row]) * hidden;
      std::memcpy(row_f32_.data(), partial + r * row_bytes, row_bytes);  // unaligned
      for (int j = 0; j < hidden; ++j) dst[j] += row_f32_[size_t(j)];
    }
    counters.bytes_in += size_t(counts[i]);
  }
  for (int& slot : slot_) slot = -1;
  from_f32(sum, size_t(n_rows) * hidden, options_.wire_type, reply_buffer_.data() + kHeaderBytes);
  return n_rows;
}

}  // namespace colibri
