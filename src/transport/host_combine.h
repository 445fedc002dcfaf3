// The per-host combine of the MPI exchange (--combine host): the expert ranks of one host send
// their partials (fp32, with their coordinator row indices; wire::kTagHostPartial) to the lowest
// of them, the host leader, which adds them to its own in ascending rank order, rounds the sum to
// the wire type once and replies for the host.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/buffer.h"
#include "common/profile.h"
#include "transport/protocol.h"

namespace colibri {

// A host-mate's message to its leader for `request`: header, its partial rows [rows, hidden]
// (fp32) and their coordinator row indices, written at `message`. Returns the message's bytes.
size_t write_host_partial(const wire::Header& request, std::span<const uint32_t> rows,
                          const float* partial, int hidden, std::byte* message);

// A host leader's side: a receive from each host-mate per exchange, and their sum.
class HostLeader {
 public:
  HostLeader() = default;
  // `mates`: the leader's host-mates, ascending.
  HostLeader(MPI_Comm comm, std::vector<int> mates, int max_rows, int hidden,
             double rank_timeout_s);
  ~HostLeader();
  HostLeader(HostLeader&&) = default;
  HostLeader& operator=(HostLeader&&) = default;

  bool leads() const { return !mates_.empty(); }
  // Posts a receive for each host-mate's partial of the request just received.
  void post_receives();
  // Waits for every host-mate's partial of `request` (naming a silent one, or a corrupted one,
  // and ending the job), adds this rank's `own` [request_rows, hidden] and theirs in ascending
  // rank order into the union of their rows (ascending), writes the sum at `out` in `wire_type`
  // and returns its rows. Adds the bytes received to `counters`.
  uint32_t sum(const wire::Header& request, std::span<const uint32_t> request_rows,
               const float* own, ElemType wire_type, std::byte* out, RankReport& counters);

 private:
  std::vector<int> wait_for_mates(int layer);

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<int> mates_;
  int max_rows_ = 0, hidden_ = 0;
  double rank_timeout_s_ = 0;
  std::vector<std::vector<std::byte>> buffers_;  // one message per mate
  std::vector<MPI_Request> receives_;
  std::vector<float> sum_;  // [max_rows, hidden]
  std::vector<int> slot_;   // [max_rows] the place of a coordinator row in the sum; -1: none
  std::vector<float> row_;  // [hidden] one mate row, aligned
};

}  // namespace colibri
