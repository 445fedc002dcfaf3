// Tensor parallelism over MPI (--split-linears): the linears of split_targets are split by output
// rows across the coordinator and the cpu-expert ranks. Each rank computes its rows over the whole
// input with the kernel the whole matrix would use, so every output value has the bits one process
// gives it. The coordinator sends a linear's input rows to every other part as the linear starts,
// computes its own rows, then waits (--rank-timeout) for theirs; an expert rank serves these
// requests while it waits for its next routed-expert request (ExpertChannel::set_idle_work). Both
// directions carry a header (wire::Header) and fp32 rows under the payload checksum.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/profile.h"
#include "model/weights.h"
#include "transport/protocol.h"

namespace colibri {

struct SplitOptions {
  std::vector<int> ranks;  // the parts in order: the coordinator, then the ranks that serve rows
  int max_rows = 0;        // rows of the largest forward call
  double rank_timeout_s = 300;
};

// Coordinator: keeps part 0's rows of every matrix it splits and asks the other parts for theirs.
class LinearSplitter {
 public:
  // Splits every target that split_bounds can split: its storage becomes part 0's rows, and its
  // `remote` this splitter, which must outlive the weights' use.
  LinearSplitter(MPI_Comm comm, ModelWeights& weights, const SplitOptions& options,
                 Profiler& profiler);
  ~LinearSplitter();
  LinearSplitter(const LinearSplitter&) = delete;
  LinearSplitter& operator=(const LinearSplitter&) = delete;

  int split_count() const { return split_count_; }

 private:
  class Rows;
  struct Part {
    int rank = 0;
    std::vector<std::byte> send, recv;  // header + rows, grown to the largest call
    MPI_Request send_request = MPI_REQUEST_NULL, recv_request = MPI_REQUEST_NULL;
    uint32_t sequence = 0;  // requests sent to this rank
  };

  void start(const Rows& rows, const float* x, int64_t n);
  float* local_buffer(const Rows& rows, int64_t n);
  void finish(const Rows& rows, const float* local, int64_t n, float* y);

  MPI_Comm comm_;
  SplitOptions options_;
  Profiler& profiler_;
  std::vector<Part> parts_;  // parts 1.. (the coordinator's own is computed in place)
  std::vector<MPI_Request*> recv_requests_, send_requests_;  // parts_'s, for wait_within
  std::vector<int> part_ranks_;
  std::vector<float> local_;
  int split_count_ = 0;
};

// A rank that serves rows: the rows of its part of every split target, cut from `weights` (whose
// split targets it empties), computed for the coordinator on request.
class LinearServer {
 public:
  LinearServer(MPI_Comm comm, ModelWeights& weights, int part, const SplitOptions& options,
               Profiler& profiler);
  ~LinearServer();
  LinearServer(const LinearServer&) = delete;
  LinearServer& operator=(const LinearServer&) = delete;

  // Whether a request has arrived (polled while the rank waits for routed-expert requests): a
  // matched probe, so that the buffer grows to its size.
  bool ready();
  // Receives the request ready() found, checks it, computes its rows and sends them.
  void serve();
  uint64_t bytes() const;  // of the rows held
  // Called with the layer of each valid request before it is computed (the test fault hook).
  void set_request_hook(std::function<void(int layer)> hook) { request_hook_ = std::move(hook); }

 private:
  struct Slice {
    Matrix rows;  // empty: the matrix is not split
    int layer = -1;
  };
  MPI_Comm comm_;
  int coordinator_;
  SplitOptions options_;
  Profiler& profiler_;
  std::vector<Slice> slices_;               // by index in split_targets
  std::vector<std::byte> request_, reply_;  // grown to the largest request and reply
  size_t max_request_bytes_ = 0;            // of a request with max_rows rows
  MPI_Message message_ = MPI_MESSAGE_NULL;  // the request ready() found
  MPI_Status status_{};
  bool arrived_ = false;
  MPI_Request send_ = MPI_REQUEST_NULL;
  uint32_t sequence_ = 0;  // requests received
  std::function<void(int layer)> request_hook_;
};

}  // namespace colibri
