#include "transport/heartbeat.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "transport/deadline.h"
#include "transport/mpi_check.h"
#include "transport/protocol.h"

namespace colibri {
namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

// The heartbeat: a header alone. It never changes, so sends of it need no buffer of their own.
const wire::Header& heartbeat_header() {
  static const wire::Header header =
      wire::make_header(wire::Opcode::kHeartbeat, 0, -1, 0, 0, 0, wire::checksum(nullptr, 0));
  return header;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Ends the job naming `source` unless the `count` bytes it sent on the control tag are one
// heartbeat from a peer (`from_peer`).
void require_heartbeat(const std::byte* bytes, int count, int source, bool from_peer = true) {
  wire::Header h{};
  if (size_t(count) == kHeaderBytes) std::memcpy(&h, bytes, kHeaderBytes);
  if (!from_peer || size_t(count) != kHeaderBytes || h.magic != wire::kMagic ||
      h.version != wire::kProtocolVersion || h.opcode != uint16_t(wire::Opcode::kHeartbeat))
    abort_job(fmt::format("corrupted control message from {}: {} bytes, opcode {}",
                          rank_identity().name_of(source), count, h.opcode));
}

}  // namespace

HeartbeatSender::HeartbeatSender(MPI_Comm comm, std::vector<int> ranks, double period_s,
                                 double rank_timeout_s)
    : comm_(comm), ranks_(std::move(ranks)), period_s_(period_s), rank_timeout_s_(rank_timeout_s) {
  peer_of_.assign(size_t(comm_size(comm_)), -1);
  for (size_t i = 0; i < ranks_.size(); ++i) peer_of_[size_t(ranks_[i])] = int(i);
  heard_ns_ = std::make_unique<std::atomic<int64_t>[]>(ranks_.size());
  busy_ = std::make_unique<std::atomic<bool>[]>(ranks_.size());
  for (size_t i = 0; i < ranks_.size(); ++i) {
    heard_ns_[i] = 0;
    busy_[i] = false;
  }
  if (period_s_ > 0 && !ranks_.empty()) thread_ = std::thread([this] { run(); });
}

HeartbeatSender::~HeartbeatSender() {
  stop();
}

void HeartbeatSender::stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void HeartbeatSender::heard(size_t peer) {
  if (heard_ns_[peer] != 0) heard_ns_[peer] = now_ns();
}

void HeartbeatSender::run() {
  const auto period = std::chrono::duration<double>(period_s_);
  // One heartbeat in flight per peer: a peer that does not take them gets no more.
  std::vector<MPI_Request> sends(ranks_.size(), MPI_REQUEST_NULL);
  std::unique_lock lock(mutex_);
  int64_t last_round = 0;
  for (;;) {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      if (sends[i] != MPI_REQUEST_NULL) {
        int done = 0;
        CHECK_MPI(MPI_Test(&sends[i], &done, MPI_STATUS_IGNORE));
      }
      if (sends[i] == MPI_REQUEST_NULL)
        CHECK_MPI(MPI_Isend(&heartbeat_header(), int(kHeaderBytes), MPI_BYTE, ranks_[i],
                            wire::kTagControl, comm_, &sends[i]));
    }
    take_answers();
    // After a pause of this process (stopped, or not scheduled), the peers' answers to the
    // heartbeats it did not send are not missing: their silence counts from now.
    const int64_t now = now_ns();
    if (last_round != 0 && now - last_round > int64_t((period_s_ + WaitClock::kPauseSeconds) * 1e9))
      for (size_t i = 0; i < ranks_.size(); ++i)
        if (heard_ns_[i] != 0) heard_ns_[i] = now;
    last_round = now;
    check_idle_peers();
    if (wake_.wait_for(lock, period, [this] { return stop_; })) break;
  }
  // The header is static: a send still in flight may complete on its own.
  for (MPI_Request& send : sends)
    if (send != MPI_REQUEST_NULL) MPI_Request_free(&send);
}

void HeartbeatSender::take_answers() {
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
    const int peer =
        source >= 0 && size_t(source) < peer_of_.size() ? peer_of_[size_t(source)] : -1;
    require_heartbeat(bytes.data(), count, source, peer >= 0);
    heard_ns_[size_t(peer)] = now_ns();
  }
}

void HeartbeatSender::check_idle_peers() {
  const int64_t now = now_ns();
  const auto limit_ns = int64_t(rank_timeout_s_ * 1e9);
  for (size_t i = 0; i < ranks_.size(); ++i) {
    const int64_t heard = heard_ns_[i];
    // Not yet answered (still starting), or holding a request (combine has its deadline).
    if (heard == 0 || busy_[i]) continue;
    if (now - heard > limit_ns)
      abort_job(fmt::format(
          "{} is silent: no answer to the coordinator's heartbeats within {:.1f} s while it "
          "waited for a request (--rank-timeout)",
          rank_identity().name_of(ranks_[i]), rank_timeout_s_));
  }
}

HeartbeatAnswerer::HeartbeatAnswerer(MPI_Comm comm, int coordinator)
    : comm_(comm), coordinator_(coordinator), buffer_(kHeaderBytes) {
  post_receive();
}

HeartbeatAnswerer::~HeartbeatAnswerer() {
  if (receive_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&receive_);
    MPI_Request_free(&receive_);
  }
  // The answer header is static: a send still in flight may complete on its own.
  if (answer_ != MPI_REQUEST_NULL) MPI_Request_free(&answer_);
}

void HeartbeatAnswerer::post_receive() {
  CHECK_MPI(MPI_Irecv(buffer_.data(), int(buffer_.size()), MPI_BYTE, coordinator_,
                      wire::kTagControl, comm_, &receive_));
}

bool HeartbeatAnswerer::take() {
  bool any = false;
  for (;;) {
    int done = 0;
    MPI_Status status;
    CHECK_MPI(MPI_Test(&receive_, &done, &status));
    if (!done) return any;
    int count = 0;
    CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &count));
    require_heartbeat(buffer_.data(), count, coordinator_);
    any = true;
    post_receive();
    // Answer, one answer in flight at most: the coordinator learns this rank is waiting.
    int answered = 1;
    if (answer_ != MPI_REQUEST_NULL) CHECK_MPI(MPI_Test(&answer_, &answered, MPI_STATUS_IGNORE));
    if (answered)
      CHECK_MPI(MPI_Isend(&heartbeat_header(), int(kHeaderBytes), MPI_BYTE, coordinator_,
                          wire::kTagControl, comm_, &answer_));
  }
}

}  // namespace colibri
