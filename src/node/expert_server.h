// An expert rank's loop: receive a request, compute it with the rank's expert backend, reply;
// until the coordinator shuts down. The test fault hook lives here too.
#pragma once

#include "common/profile.h"
#include "rank/expert_backend.h"
#include "transport/transport.h"

namespace colibri {

// Test hook COLIBRI_TEST_FAULT="kill|stop|abort|exit|corrupt:RANK:LAYER[:AFTER]": that expert rank
// kills itself (SIGKILL), stops itself (SIGSTOP), aborts (SIGABRT), exits with status 1 without
// MPI_Finalize, or corrupts its reply when serving LAYER (all but corrupt: at the AFTER-th request
// for LAYER, counting from 1; default the first). LAYER may instead name a start-up point (not
// with corrupt): "init" (before MPI_Init, the rank taken from the launcher's environment),
// "split" (before the node's first communicator split), "startup" (before the ranks compare
// their argument checks), "load" (after the handshake, before loading weights) or "move" (an
// expert rank, when a change of placement is announced to it: --repin-every); those apply to
// any rank, the coordinator too. With
// --split-linears, a request for a split linear of LAYER counts as a request for LAYER.
struct TestFault {
  enum Stage { kNone, kInit, kSplit, kStartup, kLoad, kMove };
  int signal_at_layer = -1;         // raise `signal` when a request for this layer arrives
  Stage signal_at_stage = kNone;    // or at this start-up point
  int signal = 0;                   // 0: exit with status 1 instead
  int signal_after = 1;             // which request for that layer
  int corrupt_reply_at_layer = -1;  // flip a byte of the reply (the transport does it)
};
// The fault of `rank` from the environment; none when unset or meant for another rank.
TestFault test_fault_from_env(int rank);
// Raises the fault's signal when `stage` is its start-up point.
void raise_test_fault(const TestFault& fault, TestFault::Stage stage, int rank);
// Counts a request for `layer` in `requests` when it is the fault's layer, and raises the fault's
// signal at its signal_after-th.
void raise_test_fault(const TestFault& fault, int layer, int& requests, int rank);

// `fault_requests` counts the requests for the fault's layer (shared with the split linears').
void serve_experts(ExpertChannel& channel, ExpertBackend& backend, Profiler& profiler, int hidden,
                   const TestFault& fault, int& fault_requests);

}  // namespace colibri
