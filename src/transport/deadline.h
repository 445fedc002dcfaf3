// Collectives that cannot hang: a gather to one rank, and a gather-decide-answer step, built on
// point-to-point messages (tag wire::kTagCollective) whose every wait polls against a deadline.
// When the deadline passes, the waiting rank names the rank that did not arrive and ends the job
// (a non-blocking MPI collective would only say "not yet", never who is missing). Start-up, the
// handshake and the end-of-run reports go through these.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace colibri {

// How long a collective waits for the other ranks, and what to call it when they do not come.
struct Deadline {
  double seconds = 300;
  const char* flag = "--startup-timeout";  // the option that sets `seconds`, named in the error
  std::string stage;                       // e.g. "start-up (handshake)"
};

// Polling pause. While the wait is young it polls at once: busy (a few pause instructions, and a
// yield every 50 us all the same) for poll_spin_us() when every thread on the host has a CPU of
// its own, else with a sched_yield for each of the first 64 polls, so that ranks sharing a core
// let each other run. Then naps growing up to `max_sleep_us`. A rank with a core of its own
// answers a request at once (an expert rank waits through the coordinator's attention at every
// layer), and on a virtual machine a yield costs microseconds: two processes handing 24 KB back
// and forth took 17.5 us a round trip with a yield per poll, 4.9 polling busy.
// Past 100 ms the naps may grow to 1 ms: an idle rank wakes a thousand times a second at most.
class Backoff {
 public:
  explicit Backoff(int max_sleep_us = 50) : max_sleep_us_(max_sleep_us) {}
  void pause();

 private:
  int polls_ = 0;
  int naps_ = 0;
  std::chrono::steady_clock::time_point start_, last_yield_;
  int max_sleep_us_;
};

// The busy part of every Backoff in this process, in microseconds (0: 64 yielding polls).
int poll_spin_us();
void set_poll_spin_us(int us);
// The spin window on a host whose ranks run `host_threads` threads in all on `host_cpus` CPUs
// (the union of their CPU sets): 2 ms when every thread has a CPU of its own, else 0.
int choose_poll_spin_us(int64_t host_threads, int host_cpus);
// The same decided over `local`, the ranks of this host (MPI_COMM_TYPE_SHARED), each running
// `threads` threads: a blocking collective, for start-up before any rank can fail.
int host_poll_spin_us(MPI_Comm local, int threads);

double seconds_since(std::chrono::steady_clock::time_point start);

// Seconds waited for a peer, polled in a loop, leaving out the time this process itself did not
// run: a gap of more than kPauseSeconds between two polls (the process was stopped, or not
// scheduled) is not counted, so that a rank continued after a SIGSTOP does not blame its peers
// for its own absence.
class WaitClock {
 public:
  static constexpr double kPauseSeconds = 1.0;
  WaitClock();
  double elapsed();  // call once per poll
  void restart();

 private:
  std::chrono::steady_clock::time_point start_, last_poll_;
};

// Open MPI ends the ranks on other hosts about 2 s after one of them calls MPI_Abort (its
// launcher's SIGCONT, SIGTERM and SIGKILL steps, odls_base_sigkill_timeout = 1 s apart; measured
// across network namespaces). A rank that waits on a rank which is itself waiting on a third (an
// expert rank on the coordinator in an exchange, a rank on the root of a start-up step) waits
// this much longer, so that the rank that knows who is silent reports, and its abort ends the
// others before they blame it.
constexpr double kAbortTeardownSeconds = 4.0;
// When every rank but one waits on that one (the root of a collective, or the coordinator), the
// first of them reports it at the deadline and the others this much later: by then the first
// one's MPI_Abort has ended the job, and the user reads one report, not one per rank.
constexpr double kLaterReportSeconds = kAbortTeardownSeconds;
// Whether `rank` is the one that reports a silent `awaited` rank first.
inline bool reports_first(int rank, int awaited) {
  return rank == (awaited == 0 ? 1 : 0);
}

// Polls the requests until all are complete; past limit_s names the peer of the first one that
// is not (peer_ranks[i] is request i's): "<peer> is silent: no <what> within <limit_s> s<where>
// (<flag>)", and ends the job. With `statuses`, (*statuses)[i] is request i's completion status
// (requests already complete on entry leave theirs unset).
void wait_within(const std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
                 double limit_s, const char* what, const std::string& where, const char* flag,
                 std::vector<MPI_Status>* statuses = nullptr);
// The same at start-up over an array of requests ("", --startup-timeout).
void wait_at_setup(std::vector<MPI_Request>& requests, const std::vector<int>& peer_ranks,
                   double limit_s, const char* what);

// Every rank's bytes, on `root` ([size], empty elsewhere). The root waits at most
// deadline.seconds for the others, then names the ranks that did not arrive and aborts the job;
// the other ranks wait (as long) for their bytes to be taken.
std::vector<std::string> gather_within(MPI_Comm comm, int root, const std::string& bytes,
                                       const Deadline& deadline);

// One start-up step as a collective: every rank's `bytes` reach `root`, which calls `decide` on
// them ([size]) and sends its answer to every rank; returns the answer on every rank. The root
// tells every rank when it has arrived, so that a rank waiting for it blames the right one: the
// root names the ranks that did not arrive within deadline.seconds of its own arrival; a rank
// names the root when it did not arrive within deadline.seconds, or did not answer within
// deadline.seconds + kAbortTeardownSeconds more. Past the first rank to report a silent root, the
// others wait kLaterReportSeconds longer.
std::string agree_within(MPI_Comm comm, int root, const std::string& bytes,
                         const std::function<std::string(const std::vector<std::string>&)>& decide,
                         const Deadline& deadline);

}  // namespace colibri
