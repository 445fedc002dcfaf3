// The per-MoE-layer exchange between the coordinator and the expert owners, as two narrow
// interfaces: the coordinator's Dispatcher (dispatch -> combine) and the expert rank's
// ExpertChannel (receive -> reply). Implementations: MPI (every peer), the local dispatcher (one
// process runs its own experts), NCCL for GPU peers, and a composite of NCCL and MPI.
//
// Count phase first: a DispatchPlan, built from the routing and the placement before any payload
// moves, gives every owner's rows and pairs. MPI carries the counts in each message's header; a
// transport that must size its receives in advance (NCCL) exchanges them first.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/buffer.h"
#include "common/profile.h"
#include "moe/dispatch_plan.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "moe/router.h"
#include "transport/protocol.h"

namespace colibri {

// What every transport is told, whatever carries the rows.
struct ExchangeOptions {
  double rank_timeout_s = 300;   // longest wait for a peer within an exchange (and, on an expert
                                 // rank with heartbeats, for the next request or heartbeat, plus
                                 // kAbortTeardownSeconds)
  double setup_timeout_s = 300;  // longest wait for a peer at construction: the ranks arrive as
                                 // their weights load (--startup-timeout)
  ElemType wire_type = ElemType::kF32;  // rows and partials on the wire
  // Test hook: this rank flips one payload byte of its reply at this layer (-1: never).
  int corrupt_reply_at_layer = -1;
};

// What expert rank `rank` checks its next request against: the sequence number it expects, the
// exchange's shape, and the experts it owns in `placement` (which must outlive the check).
inline wire::RequestCheck expert_request_check(const PlacementTable& placement,
                                               const ExchangeShape& shape, size_t elem_bytes,
                                               int rank, uint32_t expected_sequence) {
  wire::RequestCheck check;
  check.expected_sequence = expected_sequence;
  check.num_layers = placement.num_layers;
  check.max_rows = shape.max_rows;
  check.top_k = shape.top_k;
  check.hidden = shape.hidden;
  check.num_experts = placement.num_experts;
  check.elem_bytes = elem_bytes;
  check.owned = [&placement, rank](int layer, uint32_t expert) {
    return placement.holds(layer, int(expert), rank);
  };
  return check;
}

// Coordinator side.
class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  // Sends every owner its rows of x [plan.n_rows, hidden] and its pairs; does not wait for
  // compute. x and plan stay valid until combine() returns.
  virtual void dispatch(const DispatchPlan& plan, ConstView x) = 0;
  // Waits (with a deadline) for every owner's partial and writes their sum into out
  // [n_rows, hidden], owners added in ascending rank order.
  virtual void combine(View out) = 0;
  // Exchanges that may be in flight at once: slots 0 .. exchange_slots() - 1, each begun by
  // dispatch_slot and ended by combine_slot, so that the coordinator computes one micro-batch
  // while another's experts work. dispatch() and combine() are slot 0's. 1 unless the transport
  // says otherwise.
  virtual int exchange_slots() const { return 1; }
  // dispatch() into `slot`, whose last exchange was combined; the other slot's may be in flight.
  virtual void dispatch_slot(int slot, const DispatchPlan& plan, ConstView x);
  // combine() of the exchange in `slot`.
  virtual void combine_slot(int slot, View out);
  // Tells every owner to stop.
  virtual void shutdown() = 0;
  // Whether dispatch takes rows, and combine writes partials, in CUDA device memory (else both
  // are fp32 host memory).
  virtual bool takes_device_rows() const { return false; }
  // Per world rank, how often its partial arrived last in a layer; empty when not tracked.
  virtual std::vector<uint64_t> slowest_counts() const { return {}; }
  // Between steps: sends every expert rank a change of placement (prepare or commit), in order
  // with the requests that follow. A transport that cannot says so (an Error).
  virtual void change_placement(const PlacementChange& change);
  // Before a layer's dispatch: tells owners which experts of a later `layer` they will likely be
  // asked for. Transports that cannot carry it drop it.
  virtual void hint(int /*layer*/, std::span<const OwnerHint> /*hints*/) {}
  // Between steps: every expert rank's counters now (LiveCounters), asked for and waited on with
  // the exchange's deadline, in ascending rank order. Transports that cannot ask leave theirs
  // out (empty: none).
  virtual std::vector<LiveCounters> live_counters() { return {}; }
};

// A dispatcher whose combine can be taken apart partial by partial, so that a composite of
// dispatchers (transport/composite_dispatcher.h) adds the partials of all its parts in one
// ascending rank order. combine() of such a dispatcher is combine_partials(*this, out).
class PartialDispatcher : public Dispatcher {
 public:
  // The exchange slot the calls below are about, for a composite that takes a slot's combine
  // apart (dispatch_slot and combine_slot choose it too). Slot 0 unless exchange_slots() > 1.
  virtual void select_slot(int slot);
  // Waits (with the deadline) for every partial of the exchange begun by dispatch().
  virtual void wait_partials() = 0;
  // The ranks whose partials arrived, ascending: an owner, or a host leader for its host.
  virtual std::span<const int> partial_ranks() const = 0;
  // Adds the i-th partial to the rows it covers of out [n_rows, hidden] (fp32, host): out row =
  // 0 + partial row where started[row] == 0 (then set to 1), else out row += partial row.
  virtual void add_partial(size_t i, float* out, std::span<uint8_t> started) = 0;
  // Ends the exchange (sends delivered, buffers free for the next dispatch).
  virtual void finish_combine() = 0;
  // Rows and width of the exchange begun by dispatch().
  virtual int exchange_rows() const = 0;
  virtual int exchange_hidden() const = 0;
};

// The combine of a PartialDispatcher: waits, adds every partial in ascending rank order into
// fp32 host `out` (rows no partial covers are zero), ends the exchange.
void combine_partials(PartialDispatcher& dispatcher, View out);

// Expert rank side.
class ExpertChannel {
 public:
  virtual ~ExpertChannel() = default;
  // Waits for the next request; false when the coordinator shut down.
  virtual bool receive(ExpertRequest& request) = 0;
  // Answers the request last received with partial [n_rows, hidden] (fp32).
  virtual void reply(ConstView partial) = 0;
  // Other work for this rank while it waits for a request: `ready` is polled with the request,
  // and when it says so, `run` runs (outside the wait's profile) and the wait goes on, as if the
  // coordinator had just been heard from.
  struct IdleWork {
    std::function<bool()> ready;
    std::function<void()> run;
  };
  virtual void set_idle_work(IdleWork work);
  // Called from receive() with each change of placement the coordinator sends; receive() then
  // goes on waiting for a request.
  using PlacementHandler = std::function<void(const PlacementChange&)>;
  void set_placement_handler(PlacementHandler handler) { placement_handler_ = std::move(handler); }
  // Called from receive() with each hint of experts the coordinator sends (Dispatcher::hint).
  using HintHandler = std::function<void(int layer, std::span<const int> experts)>;
  void set_hint_handler(HintHandler handler) { hint_handler_ = std::move(handler); }
  // Called from receive() when the coordinator asks for this rank's counters
  // (Dispatcher::live_counters); without one, the channel answers with its profiler's.
  using CountersHandler = std::function<LiveCounters()>;
  void set_counters_handler(CountersHandler handler) { counters_handler_ = std::move(handler); }

 protected:
  PlacementHandler placement_handler_;
  HintHandler hint_handler_;
  CountersHandler counters_handler_;
};

}  // namespace colibri
