// The exchange over NCCL between the coordinator and the GPU expert ranks (built only with CUDA
// and NCCL; transport/exchange.cpp chooses it). The communicator holds the coordinator and the
// gpu-expert ranks, in ascending world rank; it is non-blocking, so that every wait polls
// ncclCommGetAsyncError and cudaEventQuery against a deadline, and on expiry aborts the
// communicator and names the silent rank@host (the job then ends as on MPI).
//
// Per layer, to each owner with work: a count header (wire::nccl_count_header: rows, pairs,
// payload bytes) so that the owner can size its receive, then in one group the payload (rows in
// the wire type, then the pairs) of every owner. Each owner's reply (its partial rows in the wire
// type) is received in its own group, in ascending rank, with an event after it: a reply that
// does not come is named by the first event not reached (the replies complete in rank order, so
// which one came last is not tracked). The replies land in one device buffer and come to the
// host in one download; the partials are added there in ascending rank, as MpiTransport adds
// them (same bits for the same wire type).
//
// Staging copies: x and out in host memory go through pinned buffers (one upload, one download);
// device x is gathered on the device when the wire is fp32 (else downloaded once); the expert
// backends take host rows, so an expert rank downloads each payload once and uploads its reply.
// An idle expert rank waits for the next request without a deadline (no heartbeat over NCCL):
// the liveness connection (transport/liveness.h) names a coordinator that dies or is stopped,
// and the coordinator an idle gpu-expert rank that does.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "common/profile.h"
#include "moe/placement.h"
#include "transport/deadline.h"
#include "transport/protocol.h"
#include "transport/transport.h"

namespace colibri {

// setup_timeout_s: the longest wait for the communicator to be complete.
struct NcclTransportOptions : ExchangeOptions {
  int device = 0;  // this rank's CUDA device
};

// The communicator's id: made by `coordinator`, received by every rank of `comm` (collective
// over comm with the deadline, which names a rank that does not arrive).
std::string nccl_unique_id(MPI_Comm comm, int coordinator, const Deadline& deadline);

class NcclTransport final : public PartialDispatcher, public ExpertChannel {
 public:
  // Collective over `nccl_ranks` (world ranks, ascending, the coordinator among them): joins the
  // communicator made from `unique_id`. An Error when it is not complete within
  // options.setup_timeout_s or NCCL fails.
  NcclTransport(const std::vector<int>& nccl_ranks, const std::string& unique_id,
                const LivePlacement& placement, const ExchangeShape& shape, int coordinator,
                Profiler& profiler, const NcclTransportOptions& options);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  // x: fp32, host or device.
  void dispatch(const DispatchPlan& plan, ConstView x) override;
  // out: fp32, host or device (summed on the host, then uploaded).
  void combine(View out) override;
  bool takes_device_rows() const override { return true; }
  void shutdown() override;
  void wait_partials() override;
  std::span<const int> partial_ranks() const override { return replied_; }
  void add_partial(size_t i, float* out, std::span<uint8_t> started) override;
  void finish_combine() override;
  int exchange_rows() const override { return n_rows_; }
  int exchange_hidden() const override { return shape_.hidden; }

  bool receive(ExpertRequest& request) override;
  // partial: fp32, host or device.
  void reply(ConstView partial) override;

 private:
  struct Peer {
    int rank = 0;       // world rank
    int nccl_rank = 0;  // in the communicator
    uint32_t sequence = 0;
    const OwnerShare* share = nullptr;  // this exchange; null when idle
    size_t reply_offset = 0;            // bytes into the reply buffers
  };

  // After a group (or init): polls until the communicator is no longer in progress. On error or
  // past `limit_s`, aborts the communicator and the job, naming `blame` (world ranks).
  void settle(const char* what, double limit_s, const std::vector<int>& blame);
  // Polls until `event` is reached, checking the communicator; past limit_s (<0: no deadline)
  // aborts naming `blame`.
  void wait_event(cudaEvent_t event, const char* what, double limit_s, int blame);
  [[noreturn]] void fail_exchange(const std::string& what);
  void send_headers(const std::vector<Peer*>& to);
  // Construction: joins the communicator (within setup_timeout_s); the pinned and device buffers.
  void join_communicator(const std::vector<int>& nccl_ranks, const std::string& unique_id);
  void allocate_buffers(const std::vector<int>& nccl_ranks);
  // Dispatch: the peers with work; a peer's rows, pairs and count header written (its reply's
  // place in the reply buffers after `reply_offset`, which it advances); the payloads sent and
  // the replies' receives posted.
  void choose_peers(const DispatchPlan& plan);
  void write_request(Peer& peer, ConstView x, const float* rows_host, bool gather_on_device,
                     size_t& reply_offset);
  void send_payloads();

  const LivePlacement& placement_;
  ExchangeShape shape_;
  int coordinator_;
  int rank_;
  Profiler& profiler_;
  NcclTransportOptions options_;
  size_t elem_bytes_;
  size_t max_payload_bytes_, max_reply_bytes_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;  // the last operation of a step
  int layer_ = -1;
  int n_rows_ = 0;
  double dispatched_us_ = 0;

  // coordinator
  std::vector<Peer> peers_;   // the GPU expert ranks, ascending
  std::vector<int> peer_of_;  // world rank -> index in peers_ (-1: none)
  std::vector<Peer*> active_;
  std::vector<cudaEvent_t> reply_events_;  // [peers] after each active peer's reply
  std::vector<int> replied_;               // ranks of this exchange's partials, ascending
  std::vector<float> row_f32_;             // [hidden]
  std::vector<uint8_t> row_started_;       // [rows]
  float* x_staging_ = nullptr;             // pinned [max_rows, hidden]: device x, bf16 wire
  float* out_staging_ = nullptr;           // pinned [max_rows, hidden]: device out

  // both: pinned host and device buffers (coordinator: one payload per peer; expert: one)
  std::byte* headers_host_ = nullptr;  // [peers or 1] wire::Header
  std::byte* headers_dev_ = nullptr;
  std::byte* payload_host_ = nullptr;  // [peers or 1][max_payload_bytes_]
  std::byte* payload_dev_ = nullptr;
  std::byte* reply_host_ = nullptr;  // coordinator [peers][max_reply_bytes_]; expert [1]
  std::byte* reply_dev_ = nullptr;

  // expert
  wire::Header request_header_{};
  uint32_t sequence_ = 0;
  std::vector<RoutedPair> request_pairs_;
  int coordinator_nccl_rank_ = 0;
};

}  // namespace colibri
