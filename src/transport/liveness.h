// Liveness of a job's ranks, whatever their exchange (MPI or NCCL) and wherever they run: every
// rank holds a TCP connection to the coordinator, made at the end of start-up. The kernel closes
// the sockets of a process that dies, so its peer hears of the death at once, before Open MPI's
// teardown reaches it, on any host. One byte at a time travels on it:
//   'H' every period, both ways (a heartbeat);
//   'E' the sender is ending the job with an error it reports itself (abort_job);
//   'B' the coordinator is ending the job normally: no more checks.
// What each side does (in a thread of its own):
// - the coordinator: a connection that closes without 'E' or 'B' ends the job at once naming the
//   rank ("gone", through abort_job, so that a server first ends every stream with an error
//   event); after 'E' it only runs the abort hook (the rank's own abort ends the job and its line
//   says why). A rank that sends nothing for `silence_s` is named silent, for the ranks whose
//   exchange has no heartbeat of its own (NCCL ones).
// - an expert rank: the coordinator's connection closing without 'E' or 'B' ends this rank after
//   kAbortTeardownSeconds (mpirun's teardown normally comes first); silence for `silence_s`
//   (plus the same margin) names the coordinator silent, where the exchange has no heartbeat.
// Nothing waits on the connection being made: a rank that cannot reach the coordinator's address
// (a firewall between hosts) says so in a warning and is left to mpirun's teardown.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace colibri {

struct LivenessOptions {
  double period_s = 1.0;     // heartbeat period
  double silence_s = 300;    // --rank-timeout: a peer that sends nothing this long is silent
  std::vector<int> silence;  // the ranks (coordinator: theirs; expert: its own) checked for it
};

// The coordinator's end: listens on every address of this host, on a free port.
class LivenessHub {
 public:
  LivenessHub(int rank, std::vector<int> ranks, const LivenessOptions& options);
  ~LivenessHub();
  LivenessHub(const LivenessHub&) = delete;
  LivenessHub& operator=(const LivenessHub&) = delete;

  // What the other ranks connect to (LivenessLink's `address`).
  const std::string& address() const { return address_; }
  // The job ends normally: every rank is told ('B') and nothing is checked any more. The
  // destructor does the same when end() was not called.
  void end();

 private:
  void run();

  int rank_;
  LivenessOptions options_;
  std::string address_;
  uint64_t nonce_ = 0;  // a rank introduces itself with it
  int listener_ = -1;
  std::vector<int> ranks_;
  std::atomic<bool> stop_{false};
  int wake_[2] = {-1, -1};
  std::thread thread_;
};

// An expert rank's end: connects to the hub (each address tried, bounded), then watches it.
class LivenessLink {
 public:
  LivenessLink(int rank, int coordinator, const std::string& address,
               const LivenessOptions& options);
  ~LivenessLink();
  LivenessLink(const LivenessLink&) = delete;
  LivenessLink& operator=(const LivenessLink&) = delete;

  bool connected() const { return sock_ >= 0; }

 private:
  void run();

  int rank_, coordinator_;
  LivenessOptions options_;
  int sock_ = -1;
  std::atomic<bool> stop_{false};
  int wake_[2] = {-1, -1};
  std::thread thread_;
};

// Called by abort_job before it ends the job: tells every peer of this process's liveness
// connections that its error is reported ('E'). Async-signal-safe.
void liveness_report_error();

}  // namespace colibri
