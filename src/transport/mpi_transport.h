// Transport over MPI non-blocking point-to-point with preposted receives. Buffers are allocated
// once per peer; every wait polls against a deadline and names the silent peer.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <vector>

#include "node/profile.h"
#include "rank/placement.h"
#include "transport/transport.h"

namespace colibri {

struct MpiTransportOptions {
  double rank_timeout_s = 300;  // longest wait for a peer within an exchange
  // Test hook: this rank flips one payload byte of its reply at this layer (-1: never).
  int corrupt_reply_at_layer = -1;
};

class MpiTransport final : public Transport {
 public:
  MpiTransport(MPI_Comm comm, const PlacementTable& placement, const ExchangeShape& shape,
               int coordinator, Profiler& profiler, const MpiTransportOptions& options);
  ~MpiTransport() override;

  void dispatch(int layer, const float* x, int n, const Routing& routing) override;
  void combine(float* out) override;
  void shutdown() override;
  bool receive(ExpertRequest& request) override;
  void reply(const float* partial) override;

  // Coordinator: how often each rank's partial arrived last.
  const std::vector<uint64_t>& slowest_counts() const { return slowest_; }

 private:
  struct Peer {
    int rank = 0;
    std::vector<std::byte> send;  // header + request payload
    std::vector<std::byte> recv;  // header + reply payload
    std::vector<int> rows;        // coordinator rows sent in this exchange
    MPI_Request send_request = MPI_REQUEST_NULL;
    MPI_Request recv_request = MPI_REQUEST_NULL;
    bool active = false;
    uint32_t sequence = 0;  // messages sent to this peer
  };

  // Polls until every request is complete or the deadline passes; returns the index of the
  // request that completed last. On timeout names peers[i] for the first incomplete request.
  int wait_all(std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
               const char* what, int layer);
  void validate_reply(const Peer& peer, int count_bytes);
  void post_request_receive();

  MPI_Comm comm_;
  const PlacementTable& placement_;
  ExchangeShape shape_;
  int coordinator_;
  int rank_;
  Profiler& profiler_;
  MpiTransportOptions options_;
  uint32_t sequence_ = 0;  // expert side: messages received from the coordinator
  int layer_ = -1;
  int n_rows_ = 0;

  // coordinator side
  std::vector<Peer> peers_;        // one per expert rank
  std::vector<int> owner_peer_;    // rank -> index in peers_ (-1 if none)
  std::vector<uint64_t> slowest_;  // [world size]

  // expert side
  std::vector<std::byte> request_buffer_;
  std::vector<std::byte> reply_buffer_;
  MPI_Request request_receive_ = MPI_REQUEST_NULL;
  MPI_Request reply_send_ = MPI_REQUEST_NULL;
  wire::Header request_header_{};
};

}  // namespace colibri
