// What the MPI exchange is told (its own settings beside every transport's ExchangeOptions), and
// who talks to whom in it: the expert ranks it serves, their hosts, the host groups of --combine
// host and the ranks that share a segment with the coordinator.
#pragma once

#include <vector>

#include "transport/transport.h"

namespace colibri {

// The MPI transport's own settings.
struct MpiSettings {
  double heartbeat_s = 0;  // period of the coordinator's heartbeat (transport/heartbeat.h); 0:
                           // none (no deadline for an idle expert rank then)
  // Per-host combine (--combine host): the expert ranks of one host (host_of equal) send their
  // partials to the lowest of them, the host leader, which sums them in ascending rank order and
  // sends one reply for the host (transport/host_combine.h). On every host, the coordinator's
  // included; a host with one expert rank replies directly. Off: every owner replies to the
  // coordinator (star).
  bool host_combine = false;
  std::vector<int> host_of;  // [world size] host index of each rank; empty: one host each
  // Shared segments (transport/shared_segment.h) for the expert ranks on the coordinator's host
  // that reply to it directly.
  bool shared_memory = true;
  // The expert ranks this transport talks to (beside NCCL for GPU ranks: the CPU expert ranks);
  // empty: every rank but the coordinator.
  std::vector<int> expert_ranks;
};

struct MpiTransportOptions : ExchangeOptions, MpiSettings {
  MpiTransportOptions() = default;
  MpiTransportOptions(const ExchangeOptions& exchange, const MpiSettings& mpi)
      : ExchangeOptions(exchange), MpiSettings(mpi) {}
};

class MpiTopology {
 public:
  MpiTopology(int size, int coordinator, const MpiTransportOptions& options);

  int size() const { return int(served_.size()); }
  int coordinator() const { return coordinator_; }
  // Whether the transport serves rank r (an expert rank of it).
  bool served(int r) const { return served_[size_t(r)]; }
  // The served ranks, ascending.
  std::vector<int> served_ranks() const;
  // Whether rank r is on another host than the coordinator.
  bool remote(int r) const { return host_of(r) != host_of(coordinator_); }
  // The served ranks of r's host, ascending; empty without host combine or when r's host has one.
  std::vector<int> host_group(int r) const;
  // Whether rank r shares a segment with the coordinator: served, on its host, replying to it
  // directly (not in a host group), and shared memory on.
  bool shares_segment(int r) const;

 private:
  int host_of(int r) const { return host_of_.empty() ? r : host_of_.at(size_t(r)); }

  int coordinator_;
  std::vector<bool> served_;
  std::vector<int> host_of_;
  bool host_combine_, shared_memory_;
};

}  // namespace colibri
