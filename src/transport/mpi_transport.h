// The exchange over MPI non-blocking point-to-point with preposted receives. Send and receive
// buffers are allocated at construction, one pair per peer, for the largest call (max_rows);
// every wait polls against a deadline and names the silent peer. The coordinator also sends each
// expert rank a heartbeat (wire::kTagControl) every heartbeat_s from its own thread (so MPI must
// provide MPI_THREAD_MULTIPLE), so that an expert rank tells an idle coordinator from a stopped
// one: nothing, request or heartbeat, for rank_timeout_s (plus kAbortTeardownSeconds, so that the
// coordinator names a silent third rank first) ends the job. An expert rank waiting for a request
// answers every heartbeat, and the same thread of the coordinator names an expert rank that has
// answered before, has no request outstanding, and has not answered for rank_timeout_s: a rank
// stopped or cut off while the coordinator idles is found without waiting for the next request.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/profile.h"
#include "moe/placement.h"
#include "transport/protocol.h"
#include "transport/transport.h"

namespace colibri {

struct MpiTransportOptions {
  double rank_timeout_s = 300;  // longest wait for a peer within an exchange, and (expert rank,
                                // with heartbeats) for the next request or heartbeat, plus
                                // kAbortTeardownSeconds
  double heartbeat_s = 0;       // period of the coordinator's heartbeat; 0: none (no deadline
                                // for an idle expert rank then)
  ElemType wire_type = ElemType::kF32;  // rows and partials on the wire
  // Test hook: this rank flips one payload byte of its reply at this layer (-1: never).
  int corrupt_reply_at_layer = -1;
  // Per-host combine (--combine host): the expert ranks of one host (host_of equal) send their
  // partials to the lowest of them, the host leader, which sums them in ascending rank order and
  // sends one reply for the host. On every host, the coordinator's included; a host with one
  // expert rank replies directly. Off: every owner replies to the coordinator (star).
  bool host_combine = false;
  std::vector<int> host_of;  // [world size] host index of each rank; empty: one host each
  // Shared segments: an expert rank on the coordinator's host that replies to it directly
  // (not a host-mate under --combine host) shares a memfd with it, mapped by both (the
  // coordinator opens it through /proc/<pid>/fd). Request rows and reply partials are written
  // there, and the messages carry headers, pairs and row indices only: no copy through MPI.
  // Where the coordinator cannot map a segment (another user, ptrace restricted), that rank
  // keeps the plain messages.
  bool shared_memory = true;
  double setup_timeout_s = 300;  // longest wait for a peer's segment at construction: the ranks
                                 // arrive as their weights load (--startup-timeout)
  // The expert ranks this transport talks to (beside NCCL for GPU ranks: the CPU expert ranks);
  // empty: every rank but the coordinator.
  std::vector<int> expert_ranks;
};

// Polls the requests until all are complete; past limit_s names the peer of the first one that
// is not (peer_ranks[i] is request i's): "<peer> is silent: no <what> within <limit_s> s<where>
// (<flag>)", and ends the job.
void wait_within(const std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
                 double limit_s, const char* what, const std::string& where, const char* flag);

// One mapping of an expert rank's shared segment: its request rows, then its reply rows, each
// max_rows rows in the wire type, 64-byte aligned.
struct SharedSegment {
  std::byte* base = nullptr;  // null: not shared
  size_t bytes = 0;
  size_t reply_at = 0;
  std::byte* request_rows() const { return base; }
  std::byte* reply_rows() const { return base + reply_at; }
  std::byte* reply_rows_or_null() const { return base ? reply_rows() : nullptr; }
  void unmap();
};

class MpiTransport final : public PartialDispatcher, public ExpertChannel {
 public:
  MpiTransport(MPI_Comm comm, const PlacementTable& placement, const ExchangeShape& shape,
               int coordinator, Profiler& profiler, const MpiTransportOptions& options);
  ~MpiTransport() override;

  void dispatch(const DispatchPlan& plan, ConstView x) override;
  void combine(View out) override;
  void shutdown() override;
  void change_placement(const PlacementChange& change) override;
  void hint(int layer, std::span<const OwnerHint> hints) override;
  void wait_partials() override;
  std::span<const int> partial_ranks() const override { return replier_ranks_; }
  void add_partial(size_t i, float* out, std::span<uint8_t> started) override;
  void finish_combine() override;
  int exchange_rows() const override { return n_rows_; }
  int exchange_hidden() const override { return shape_.hidden; }
  bool receive(ExpertRequest& request) override;
  // One message from the coordinator: true with a request (layer -1: shutdown), false after a
  // change of placement was handed to the handler.
  bool receive_one(ExpertRequest& request);
  void reply(ConstView partial) override;
  void set_idle_work(IdleWork work) override { idle_work_ = std::move(work); }

  std::vector<uint64_t> slowest_counts() const override { return slowest_; }

 private:
  struct Peer {
    int rank = 0;
    std::vector<std::byte> send;        // header + request payload
    std::vector<std::byte> recv;        // header + reply payload
    const OwnerShare* share = nullptr;  // this exchange's rows and pairs; null when idle
    MPI_Request send_request = MPI_REQUEST_NULL;
    MPI_Request recv_request = MPI_REQUEST_NULL;
    std::vector<std::byte> hint;  // header + a hint's experts (Dispatcher::hint)
    MPI_Request hint_request = MPI_REQUEST_NULL;
    uint32_t sequence = 0;  // messages sent to this peer
    bool remote = false;    // on another host than the coordinator
    // Host combine: index in peers_ of this peer's host leader (itself for a leader); -1 when it
    // replies directly. A leader's members: its host's peers, ascending, itself first.
    int leader = -1;
    std::vector<int> members;
    bool replies = true;          // this exchange: its reply comes to the coordinator
    std::vector<int> reply_rows;  // this exchange: the coordinator rows its reply covers
    SharedSegment segment;        // mapped when the rows go through shared memory
    uint32_t reply_checksum = 0;  // this exchange: its reply header's, checked in add_partial
  };

  // Polls until every request is complete or the deadline passes. On timeout names the peer of
  // the first incomplete request.
  void wait_all(std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
                const char* what, int layer);
  // Checks a reply's header; its rows' checksum is checked as add_partial reads them.
  void validate_reply(Peer& peer, int count_bytes);
  // Expert rank: the host-mate's send of its partial to its leader; the leader's sum of its own
  // and its host-mates' partials into reply_buffer_ (returns the rows of the sum).
  void send_host_partial(ConstView partial);
  uint32_t sum_host_partials(const float* own);
  void post_request_receive();
  void post_control_receive();
  // Construction: the segments of the expert ranks on the coordinator's host that reply to it,
  // offered by each (a memfd) and mapped by the coordinator, within rank_timeout_s.
  void share_segments(const std::vector<bool>& sharing);
  // Coordinator: the heartbeat thread's loop, and its end.
  void send_heartbeats();
  void stop_heartbeat();
  // Coordinator, heartbeat thread: takes the expert ranks' answers; names a silent idle one.
  void take_answers();
  void check_idle_peers();
  // Expert rank: takes the heartbeats that arrived and answers them; true if any did.
  bool take_heartbeats();

  MPI_Comm comm_;
  const PlacementTable& placement_;
  ExchangeShape shape_;
  int coordinator_;
  int rank_;
  Profiler& profiler_;
  MpiTransportOptions options_;
  size_t elem_bytes_;
  uint32_t sequence_ = 0;  // expert side: messages received from the coordinator
  int layer_ = -1;
  int n_rows_ = 0;
  double dispatched_us_ = 0;  // end of the last dispatch (profiler clock)

  // coordinator side
  std::vector<Peer> peers_;           // one per expert rank
  std::vector<int> owner_peer_;       // rank -> index in peers_ (-1 if none)
  std::vector<uint64_t> slowest_;     // [world size]
  std::vector<Peer*> active_;         // peers of this exchange, ascending rank
  std::vector<Peer*> repliers_;       // those of them that reply to the coordinator
  std::vector<int> replier_ranks_;    // their ranks, once their partials arrived
  OwnerShare empty_share_;            // a host-mate's share when it has no rows
  std::vector<char> row_marks_;       // [max_rows] scratch: rows of a host's union
  std::vector<float> row_f32_;        // [hidden] one partial row converted from the wire type
  std::vector<uint8_t> row_started_;  // [rows] whether combine has added a partial to the row
  // Per peer, shared by the main and the heartbeat thread: when it was last heard from (an answer
  // or a reply; steady clock, ns; 0: never answered a heartbeat), and whether it holds a request.
  std::unique_ptr<std::atomic<int64_t>[]> heard_ns_;
  std::unique_ptr<std::atomic<bool>[]> busy_;
  std::thread heartbeat_;
  std::mutex heartbeat_mutex_;
  std::condition_variable heartbeat_wake_;
  bool heartbeat_stop_ = false;

  // expert side
  IdleWork idle_work_;
  std::vector<std::byte> request_buffer_;
  std::vector<std::byte> reply_buffer_;
  std::vector<RoutedPair> request_pairs_;
  MPI_Request request_receive_ = MPI_REQUEST_NULL;
  MPI_Request reply_send_ = MPI_REQUEST_NULL;
  wire::Header request_header_{};
  std::vector<uint32_t> request_rows_;  // the coordinator's row indices of the last request
  int reply_to_ = 0;                    // the coordinator, or this rank's host leader
  // Host leader: its host-mates (ascending), a receive of each one's partial per exchange, the
  // sum (fp32) and which of its rows holds each coordinator row.
  std::vector<int> mates_;
  std::vector<std::vector<std::byte>> mate_buffers_;
  std::vector<MPI_Request> mate_receives_;
  std::vector<float> host_sum_;
  std::vector<int> slot_;
  SharedSegment segment_;                  // this rank's shared segment, when the coordinator
                                           // mapped it
  std::vector<std::byte> control_buffer_;  // one heartbeat
  MPI_Request control_receive_ = MPI_REQUEST_NULL;
  MPI_Request answer_send_ = MPI_REQUEST_NULL;  // the last answer to a heartbeat
};

}  // namespace colibri
