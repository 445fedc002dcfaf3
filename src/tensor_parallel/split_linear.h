// Tensor parallelism over MPI (--split-linears): the linears of split_targets are split by output
// rows across the coordinator and the cpu-expert ranks, and each MLA layer's absorbed attention by
// heads. Each rank computes its rows over the whole input with the kernel the whole matrix would
// use, and its heads as one process would, so every output value has the bits one process gives
// it. The coordinator sends a linear's input rows to every other part as the linear starts,
// computes its own rows, then waits (--rank-timeout) for theirs; an expert rank serves these
// requests while it waits for its next routed-expert request (ExpertChannel::set_idle_work). Both
// directions carry a header (wire::Header) and fp32 rows under the payload checksum.
//
// For attention, a rank keeps kv_b_proj's rows of its heads and a copy of the compressed cache
// (latent and rope key rows, by the coordinator's KV slots): each call carries the rows' new cache
// rows, which it writes first, the KV block tables of their sequences, the positions the indexer
// chose and its heads' queries, and gets back its heads' outputs, o_proj's input.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/profile.h"
#include "coordinator/cpu_attention.h"
#include "model/weights.h"
#include "tensor_parallel/attend_request.h"
#include "transport/protocol.h"

namespace colibri {

struct SplitOptions {
  std::vector<int> ranks;  // the parts in order: the coordinator, then the ranks that serve rows
  int max_rows = 0;        // rows of the largest forward call
  double rank_timeout_s = 300;
  int kv_blocks = 0;  // the coordinator's KV pool, which ranks attending for heads copy
  int kv_block_tokens = 0;
};

// Coordinator: keeps part 0's rows of every matrix it splits and asks the other parts for theirs.
class LinearSplitter {
 public:
  // Splits every target that split_bounds can split: its storage becomes part 0's rows, and its
  // `remote` this splitter, which must outlive the weights' use. Every layer's heads likewise
  // (split_head_bounds): kv_b_proj keeps part 0's heads, `remote_heads` is this splitter.
  LinearSplitter(MPI_Comm comm, const ModelConfig& config, ModelWeights& weights,
                 const SplitOptions& options, Profiler& profiler);
  ~LinearSplitter();
  LinearSplitter(const LinearSplitter&) = delete;
  LinearSplitter& operator=(const LinearSplitter&) = delete;

  int split_count() const { return split_count_; }
  int split_heads_count() const { return split_heads_count_; }  // layers

 private:
  class Rows;
  class Heads;
  struct Part {
    int rank = 0;
    std::vector<std::byte> send, recv;  // header + rows, grown to the largest call
    MPI_Request send_request = MPI_REQUEST_NULL, recv_request = MPI_REQUEST_NULL;
    uint32_t sequence = 0;  // requests sent to this rank
  };

  void start(const Rows& rows, const float* x, int64_t n);
  float* local_buffer(const Rows& rows, int64_t n);
  void finish(const Rows& rows, const float* local, int64_t n, float* y);
  void start(const Heads& heads, const RemoteHeads::Call& call);
  // Writes the header `h` before part.send's payload, posts the receive of a reply of
  // `reply_payload` bytes and sends the request.
  void post(Part& part, const wire::Header& h, size_t reply_payload);
  void finish(const Heads& heads, int64_t n, float* out);
  // Waits for every part's reply (`what`) and the receipt of its request.
  void wait_all(const char* what, const std::string& where);
  // What is wrong with part i's reply to a call of n rows, or "".
  std::string check_reply(size_t i, wire::Opcode opcode, int target, int64_t n,
                          size_t payload) const;

  const ModelConfig& config_;
  MPI_Comm comm_;
  SplitOptions options_;
  Profiler& profiler_;
  std::vector<Part> parts_;  // parts 1.. (the coordinator's own is computed in place)
  std::vector<MPI_Request*> recv_requests_, send_requests_;  // parts_'s, for wait_within
  std::vector<int> part_ranks_;
  std::vector<float> local_;
  int split_count_ = 0;
  int split_heads_count_ = 0;
};

// A rank that serves rows: the rows of its part of every split target and kv_b_proj's rows of its
// part of every layer's heads, cut from `weights` (whose split targets and kv_b_proj it empties),
// computed for the coordinator on request.
class LinearServer {
 public:
  LinearServer(MPI_Comm comm, const ModelConfig& config, ModelWeights& weights, int part,
               const SplitOptions& options, Profiler& profiler);
  ~LinearServer();
  LinearServer(const LinearServer&) = delete;
  LinearServer& operator=(const LinearServer&) = delete;

  // Whether a request has arrived (polled while the rank waits for routed-expert requests): a
  // matched probe, so that the buffer grows to its size.
  bool ready();
  // Receives the request ready() found, checks it, computes its rows and sends them.
  void serve();
  uint64_t bytes() const;          // of the rows held
  uint64_t kv_copy_bytes() const;  // of the compressed cache's copy, reserved (touched as used)
  // Called with the layer of each valid request before it is computed (the test fault hook).
  void set_request_hook(std::function<void(int layer)> hook) { request_hook_ = std::move(hook); }
  // Flips a byte of each attention reply for `layer` after its checksum (the test fault).
  void set_corrupt_attention_at(int layer) { corrupt_attention_at_ = layer; }

 private:
  struct Slice {
    Matrix rows;  // empty: the matrix is not split
    int layer = -1;
  };
  // A layer's heads attended for here: kv_b_proj's rows of them and the copy of the cache.
  struct HeadsSlice {
    int heads = 0;  // 0: the layer's heads are not split
    Matrix kv_b;
    std::unique_ptr<float[]> latent, k_rope;  // [kv slots, kv_lora_rank], [kv slots, rope dim]
  };
  // Checks the attend request in request_ (`count` bytes), writes its cache rows, computes its
  // heads and sends them.
  void attend(int count);
  // Waits (--rank-timeout) until the previous reply has left reply_.
  void wait_reply_sent();
  // Sends the reply to `request` in reply_: a header, then its `payload` bytes.
  void send_reply(wire::Opcode opcode, const wire::Header& request, size_t payload,
                  size_t request_bytes);

  const ModelConfig& config_;
  MPI_Comm comm_;
  int coordinator_;
  SplitOptions options_;
  Profiler& profiler_;
  std::vector<Slice> slices_;      // by index in split_targets
  std::vector<HeadsSlice> heads_;  // by layer
  MlaHeads mla_;
  AttendRequest attend_;                    // the last attend request, parsed
  std::vector<std::byte> request_, reply_;  // grown to the largest request and reply
  size_t max_request_bytes_ = 0;            // of a request with max_rows rows
  MPI_Message message_ = MPI_MESSAGE_NULL;  // the request ready() found
  MPI_Status status_{};
  bool arrived_ = false;
  MPI_Request send_ = MPI_REQUEST_NULL;
  uint32_t sequence_ = 0;  // requests received
  std::function<void(int layer)> request_hook_;
  int corrupt_attention_at_ = -1;
};

}  // namespace colibri
