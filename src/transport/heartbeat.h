// Heartbeats, so that an expert rank tells an idle coordinator from a stopped one and the
// coordinator finds an expert rank stopped or cut off while it idles. The coordinator sends each
// expert rank a heartbeat (a header alone, wire::kTagControl) every period from a thread of its
// own (so MPI must provide MPI_THREAD_MULTIPLE); an expert rank waiting for a request answers
// each. An expert rank that has answered before, holds no request (the exchange has its own
// deadline) and has not been heard from for rank_timeout_s ends the job, named.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace colibri {

// Coordinator side. Peers are indices into `ranks`.
class HeartbeatSender {
 public:
  // Starts the thread when period_s > 0 and there are ranks; else only keeps the bookkeeping.
  HeartbeatSender(MPI_Comm comm, std::vector<int> ranks, double period_s, double rank_timeout_s);
  ~HeartbeatSender();
  HeartbeatSender(const HeartbeatSender&) = delete;
  HeartbeatSender& operator=(const HeartbeatSender&) = delete;

  // Ends the thread (before the last messages to the peers); idempotent.
  void stop();
  // The peer holds a request (its silence is the exchange's to judge) or not.
  void set_busy(size_t peer, bool busy) { busy_[peer] = busy; }
  // A reply from the peer: its silence counts from now, once it has answered a heartbeat.
  void heard(size_t peer);
  // Whether the peer has answered a heartbeat.
  bool answered(size_t peer) const { return heard_ns_[peer] != 0; }

 private:
  void run();
  void take_answers();
  void check_idle_peers();

  MPI_Comm comm_;
  std::vector<int> ranks_;
  std::vector<int> peer_of_;  // world rank -> index in ranks_ (-1 if none)
  double period_s_, rank_timeout_s_;
  // Shared by the main and the heartbeat thread: when each peer was last heard from (steady
  // clock, ns; 0: never answered), and whether it holds a request.
  std::unique_ptr<std::atomic<int64_t>[]> heard_ns_;
  std::unique_ptr<std::atomic<bool>[]> busy_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
};

// Expert rank side: a receive for the coordinator's heartbeats, posted at construction and
// cancelled at destruction.
class HeartbeatAnswerer {
 public:
  HeartbeatAnswerer(MPI_Comm comm, int coordinator);
  ~HeartbeatAnswerer();
  HeartbeatAnswerer(const HeartbeatAnswerer&) = delete;
  HeartbeatAnswerer& operator=(const HeartbeatAnswerer&) = delete;

  // Takes the heartbeats that arrived and answers them (one answer in flight at most); true if
  // any did. A control message that is not a heartbeat ends the job.
  bool take();

 private:
  void post_receive();

  MPI_Comm comm_;
  int coordinator_;
  std::vector<std::byte> buffer_;  // one heartbeat
  MPI_Request receive_ = MPI_REQUEST_NULL;
  MPI_Request answer_ = MPI_REQUEST_NULL;  // the last answer
};

}  // namespace colibri
