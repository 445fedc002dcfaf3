// An expert rank's side of the MPI exchange: a preposted receive for the coordinator's next
// message (a request, a hint, a change of placement, a request for its counters or the shutdown),
// checked before use; the reply to the coordinator, or under --combine host to this rank's host
// leader (or, for a leader, the host's sum: transport/host_combine.h); the rows through a shared
// segment when the coordinator mapped one (transport/shared_segment.h); heartbeats answered while
// it waits (transport/heartbeat.h). The coordinator's side is MpiDispatcher
// (transport/mpi_dispatcher.h).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/profile.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "moe/router.h"
#include "transport/heartbeat.h"
#include "transport/host_combine.h"
#include "transport/mpi_options.h"
#include "transport/shared_segment.h"
#include "transport/transport.h"

namespace colibri {

class MpiChannel final : public ExpertChannel {
 public:
  // Collective with the coordinator's MpiDispatcher (the shared segments are agreed here).
  // `placement` (which the next request is checked against) must outlive the channel.
  MpiChannel(MPI_Comm comm, const LivePlacement& placement, const ExchangeShape& shape,
             int coordinator, Profiler& profiler, const MpiTransportOptions& options);
  MpiChannel(MPI_Comm, LivePlacement&&, const ExchangeShape&, int, Profiler&,
             const MpiTransportOptions&) = delete;  // the placement must outlive the channel
  ~MpiChannel() override;

  bool receive(ExpertRequest& request) override;
  void reply(ConstView partial) override;
  void set_idle_work(IdleWork work) override { idle_work_ = std::move(work); }

 private:
  // One message from the coordinator: true with a request (layer -1: shutdown), false after a
  // hint or a change of placement was handed to its handler.
  bool receive_one(ExpertRequest& request);
  // Waits for the coordinator's next message, answering heartbeats and running idle work; ends
  // the job when the coordinator is silent past the deadline.
  void wait_for_message(MPI_Status& status);
  void take_placement_change(const wire::Header& h);
  void take_hint(const wire::Header& h);
  // Answers a kCountersRequest with this rank's counters (the handler's, else the profiler's).
  void send_counters(const wire::Header& h);
  void take_request(const wire::Header& h, int count, ExpertRequest& request);
  void post_request_receive();
  // A host-mate's send of its partial to its leader.
  void send_host_partial(ConstView partial);

  MPI_Comm comm_;
  const LivePlacement& placement_;
  ExchangeShape shape_;
  int coordinator_;
  int rank_;
  Profiler& profiler_;
  MpiTransportOptions options_;
  size_t elem_bytes_;
  uint32_t sequence_ = 0;  // messages received from the coordinator
  int layer_ = -1;

  IdleWork idle_work_;
  std::vector<std::byte> request_buffer_;
  std::vector<std::byte> reply_buffer_;
  std::vector<RoutedPair> request_pairs_;
  MPI_Request request_receive_ = MPI_REQUEST_NULL;
  MPI_Request reply_send_ = MPI_REQUEST_NULL;
  std::vector<std::byte> counters_buffer_;  // header + the last counters sent
  MPI_Request counters_send_ = MPI_REQUEST_NULL;
  wire::Header request_header_{};
  std::vector<uint32_t> request_rows_;  // the coordinator's row indices of the last request
  int reply_to_ = 0;                    // the coordinator, or this rank's host leader
  HostLeader host_leader_;              // when this rank leads its host's combine
  SharedSegment segment_;               // when the coordinator mapped this rank's segment
  HeartbeatAnswerer heartbeat_;
};

}  // namespace colibri
