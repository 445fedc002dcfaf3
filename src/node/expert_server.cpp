#include "node/expert_server.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/finite.h"

namespace colibri {

namespace {

// Announces the fault with its wall-clock time, then raises the signal (a stopped rank goes on
// when continued), or calls exit(1) (signal 0) without MPI_Finalize.
void raise_fault(int rank, int signal) {
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  if (signal == 0)
    std::fprintf(stderr, "colibri-node test fault: rank %d exits with status 1 at %.3f\n", rank,
                 now);
  else
    std::fprintf(stderr, "colibri-node test fault: rank %d raises signal %d at %.3f\n", rank,
                 signal, now);
  std::fflush(stderr);
  if (signal != 0) {
    std::raise(signal);
    return;
  }
  std::exit(1);
}

}  // namespace

TestFault test_fault_from_env(int rank) {
  TestFault fault;
  const char* spec = std::getenv("COLIBRI_TEST_FAULT");
  if (!spec) return fault;
  char kind[16] = {}, where[16] = {};
  int fault_rank = -1, after = 1;
  const int fields =
      std::sscanf(spec, "%15[a-z]:%d:%15[a-z0-9-]:%d", kind, &fault_rank, where, &after);
  if (fields < 3 || after < 1)
    fail(
        "COLIBRI_TEST_FAULT='{}' is not KIND:RANK:LAYER[:AFTER] or "
        "KIND:RANK:init|split|startup|load|move",
        spec);
  const std::string k = kind, w = where;
  if (k != "corrupt" && k != "kill" && k != "stop" && k != "abort" && k != "exit")
    fail("COLIBRI_TEST_FAULT kind '{}' is unknown (kill, stop, abort, exit, corrupt)", k);
  int layer = -1;
  TestFault::Stage stage = TestFault::kNone;
  if (w == "init" || w == "split" || w == "startup" || w == "load" || w == "move") {
    if (k == "corrupt") fail("COLIBRI_TEST_FAULT: corrupt needs a layer, not '{}'", w);
    stage = w == "init"      ? TestFault::kInit
            : w == "split"   ? TestFault::kSplit
            : w == "startup" ? TestFault::kStartup
            : w == "load"    ? TestFault::kLoad
                             : TestFault::kMove;
  } else {
    char* end = nullptr;
    layer = int(std::strtol(where, &end, 10));
    if (*end != '\0' || layer < 0) fail("COLIBRI_TEST_FAULT layer '{}' is not a layer", w);
  }
  if (fault_rank != rank) return fault;
  if (k == "corrupt") {
    fault.corrupt_reply_at_layer = layer;
  } else {
    fault.signal_at_layer = layer;
    fault.signal_at_stage = stage;
    fault.signal = k == "kill" ? SIGKILL : k == "stop" ? SIGSTOP : k == "abort" ? SIGABRT : 0;
    fault.signal_after = after;
  }
  return fault;
}

void raise_test_fault(const TestFault& fault, TestFault::Stage stage, int rank) {
  if (fault.signal_at_stage == TestFault::kNone || fault.signal_at_stage != stage) return;
  raise_fault(rank, fault.signal);
}

void raise_test_fault(const TestFault& fault, int layer, int& requests, int rank) {
  if (fault.signal_at_layer >= 0 && layer == fault.signal_at_layer &&
      ++requests == fault.signal_after)
    raise_fault(rank, fault.signal);
}

void serve_experts(ExpertChannel& channel, ExpertBackend& backend, Profiler& profiler, int hidden,
                   const TestFault& fault, int& fault_requests) {
  ExpertRequest request;
  std::vector<float> partial;
  while (channel.receive(request)) {
    raise_test_fault(fault, request.layer, fault_requests, profiler.counters().rank);
    const size_t values = size_t(request.n_rows) * hidden;
    if (partial.size() < values) partial.resize(values);
    if (request.n_rows > 0) {  // none: a host-mate's empty share (--combine host)
      auto scope = profiler.scope(Phase::kCompute, request.layer);
      backend.compute(request, partial.data());
    }
    if (const auto bad = find_non_finite(std::span<const float>(partial.data(), values)))
      fail("layer {}: the routed experts of this rank produced a non-finite partial ({} in row {})",
           request.layer, partial[*bad], *bad / size_t(hidden));
    channel.reply(host_f32(partial.data(), values));
  }
}

}  // namespace colibri
