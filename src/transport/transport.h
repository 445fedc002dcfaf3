// The per-MoE-layer exchange between the coordinator and the expert owners, in the style of a
// dispatch -> handle -> combine buffer: buffers are allocated once, sized from the maximum rows,
// hidden size and top-k; dispatch never blocks on compute; combine waits with a deadline.
#pragma once

#include <cstdint>
#include <vector>

#include "coordinator/router.h"
#include "transport/protocol.h"

namespace colibri {

struct ExchangeShape {
  int max_rows = 0;  // rows per forward call (prompt chunk)
  int hidden = 0;
  int top_k = 0;
  int num_experts = 0;
};

// What an expert owner receives for one layer.
struct ExpertRequest {
  int layer = 0;
  int n_rows = 0;
  const float* rows = nullptr;        // [n_rows, hidden]
  const wire::Pair* pairs = nullptr;  // [n_pairs], grouped by nothing in particular
  int n_pairs = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Coordinator: sends every owner the rows routed to it (each row once) and its pairs.
  virtual void dispatch(int layer, const float* x, int n, const Routing& routing) = 0;
  // Coordinator: waits for every owner's partial and writes their sum into out[n, hidden].
  virtual void combine(float* out) = 0;
  // Coordinator: tells every owner to stop.
  virtual void shutdown() = 0;

  // Expert rank: waits for the next request; false when the coordinator shut down.
  virtual bool receive(ExpertRequest& request) = 0;
  // Expert rank: answers the request last received with partial[n_rows, hidden].
  virtual void reply(const float* partial) = 0;
};

}  // namespace colibri
