// The coordinator's side of the MPI exchange: non-blocking point-to-point with preposted
// receives. Send and receive buffers are allocated at construction, one pair per expert rank,
// for the largest call (max_rows); every wait polls against a deadline and names the silent
// peer. Rows and partials of the expert ranks on the coordinator's host go through shared
// segments (transport/shared_segment.h); under --combine host a host's expert ranks reply once
// through their leader (transport/host_combine.h); a heartbeat thread watches idle expert ranks
// (transport/heartbeat.h). The expert rank's side is MpiChannel (transport/mpi_channel.h).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/profile.h"
#include "moe/placement.h"
#include "transport/heartbeat.h"
#include "transport/mpi_options.h"
#include "transport/shared_segment.h"
#include "transport/transport.h"

namespace colibri {

class MpiDispatcher final : public PartialDispatcher {
 public:
  // Collective with every served rank's MpiChannel (the shared segments are agreed here).
  MpiDispatcher(MPI_Comm comm, const ExchangeShape& shape, int coordinator, Profiler& profiler,
                const MpiTransportOptions& options);
  ~MpiDispatcher() override;

  void dispatch(const DispatchPlan& plan, ConstView x) override { dispatch_slot(0, plan, x); }
  void combine(View out) override { combine_slot(0, out); }
  // Two slots, but one under host combine (a host leader sums one exchange at a time). Slot 0's
  // rows and partials go through the shared segments; slot 1's in the messages.
  int exchange_slots() const override { return options_.host_combine ? 1 : kSlots; }
  void dispatch_slot(int slot, const DispatchPlan& plan, ConstView x) override;
  void combine_slot(int slot, View out) override;
  void shutdown() override;
  void change_placement(const PlacementChange& change) override;
  void hint(int layer, std::span<const OwnerHint> hints) override;
  std::vector<LiveCounters> live_counters() override;
  void select_slot(int slot) override;
  void wait_partials() override;
  std::span<const int> partial_ranks() const override { return exchange().replier_ranks; }
  void add_partial(size_t i, float* out, std::span<uint8_t> started) override;
  void finish_combine() override;
  int exchange_rows() const override { return exchange().n_rows; }
  int exchange_hidden() const override { return shape_.hidden; }
  std::vector<uint64_t> slowest_counts() const override { return slowest_; }

 private:
  static constexpr int kSlots = 2;

  // A peer's part of the exchange in one slot.
  struct PeerSlot {
    std::vector<std::byte> send;        // header + request payload (slot 1's sized at first use)
    std::vector<std::byte> recv;        // header + reply payload
    const OwnerShare* share = nullptr;  // this exchange's rows and pairs; null when idle
    MPI_Request send_request = MPI_REQUEST_NULL;
    MPI_Request recv_request = MPI_REQUEST_NULL;
    uint32_t sequence = 0;        // the request's, which its reply carries
    bool shared = false;          // its rows and partial go through the peer's segment
    bool replies = true;          // its reply comes to the coordinator
    std::vector<int> reply_rows;  // the coordinator rows its reply covers
    uint32_t reply_checksum = 0;  // its reply header's, checked in add_partial
  };
  struct Peer {
    int rank = 0;
    PeerSlot slots[kSlots];       // slot 0's send buffer also carries the messages between steps
    std::vector<std::byte> hint;  // header + a hint's experts (Dispatcher::hint)
    MPI_Request hint_request = MPI_REQUEST_NULL;
    uint32_t sequence = 0;  // messages sent to this peer
    int in_flight = 0;      // exchanges sent to it and not yet answered
    bool remote = false;    // on another host than the coordinator
    // Host combine: index in peers_ of this peer's host leader (itself for a leader); -1 when it
    // replies directly. A leader's members: its host's peers, ascending, itself first.
    int leader = -1;
    std::vector<int> members;
    SharedSegment segment;  // mapped when the rows go through shared memory
  };
  // The exchange in one slot.
  struct Exchange {
    int layer = -1;
    int n_rows = 0;
    bool open = false;               // dispatched and not yet combined
    double dispatched_us = 0;        // end of its dispatch (profiler clock)
    std::vector<Peer*> active;       // its peers, ascending rank
    std::vector<Peer*> repliers;     // those of them that reply to the coordinator
    std::vector<int> replier_ranks;  // their ranks, once their partials arrived
  };
  const Exchange& exchange() const { return exchanges_[current_]; }
  Exchange& exchange() { return exchanges_[current_]; }

  // Which peers take part in the current exchange, and which of them reply (with which rows).
  void choose_peers(const DispatchPlan& plan);
  // Writes a peer's request (rows into its segment or the message) and sends it.
  void send_request(Peer& peer, const float* x, int layer);
  // Waits (polling against the deadline) until the requests are complete; names a silent peer.
  void wait_all(std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
                const char* what, int layer);
  // Sends every peer the message `write` puts in its send buffer (returning its bytes), on the
  // request tag, and waits for the sends.
  void send_to_all(const std::function<size_t(Peer&)>& write, const char* what);
  // Checks a reply's header; its rows' checksum is checked as add_partial reads them.
  void validate_reply(Peer& peer, int count_bytes);

  MPI_Comm comm_;
  ExchangeShape shape_;
  int coordinator_;
  Profiler& profiler_;
  MpiTransportOptions options_;
  size_t elem_bytes_;
  size_t request_bytes_ = 0, reply_bytes_ = 0;  // a slot's buffers per peer
  Exchange exchanges_[kSlots];
  int current_ = 0;  // the slot the PartialDispatcher calls are about

  std::vector<Peer> peers_;           // one per expert rank, ascending
  std::vector<int> owner_peer_;       // rank -> index in peers_ (-1 if none)
  std::vector<uint64_t> slowest_;     // [world size]
  OwnerShare empty_share_;            // a host-mate's share when it has no rows
  std::vector<char> row_marks_;       // [max_rows] scratch: rows of a host's union
  std::vector<float> row_f32_;        // [hidden] one partial row converted from the wire type
  std::vector<uint8_t> row_started_;  // [rows] whether combine has added a partial to the row
  HeartbeatSender heartbeat_;         // peers in the order of peers_
};

}  // namespace colibri
