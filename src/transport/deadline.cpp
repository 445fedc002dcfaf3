#include "transport/deadline.h"

#include <fmt/format.h>
#include <sched.h>
#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "transport/mpi_check.h"
#include "transport/protocol.h"

namespace colibri {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string join_names(const std::vector<int>& ranks) {
  std::string names;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) names += i + 1 == ranks.size() ? " and " : ", ";
    names += rank_identity().name_of(ranks[i]);
  }
  return names;
}

// Waits until every request is complete; at the deadline, names the peers of the incomplete ones.
void wait_sends(std::vector<MPI_Request>& requests, const std::vector<int>& peers,
                const Deadline& deadline, std::chrono::steady_clock::time_point start) {
  Backoff backoff(2000);
  for (;;) {
    int done = 0;
    CHECK_MPI(MPI_Testall(int(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE));
    if (done) return;
    if (seconds_since(start) > deadline.seconds) {
      std::vector<int> silent;
      for (size_t i = 0; i < requests.size(); ++i)
        if (requests[i] != MPI_REQUEST_NULL) silent.push_back(peers[i]);
      abort_job(fmt::format("{} {} silent: no answer at {} within {:.1f} s ({})",
                            join_names(silent), silent.size() == 1 ? "is" : "are", deadline.stage,
                            deadline.seconds, deadline.flag));
    }
    backoff.pause();
  }
}

}  // namespace

namespace {
std::atomic<int> spin_us{0};
}  // namespace

int poll_spin_us() {
  return spin_us.load(std::memory_order_relaxed);
}
void set_poll_spin_us(int us) {
  spin_us.store(std::max(us, 0), std::memory_order_relaxed);
}

int choose_poll_spin_us(int64_t host_threads, int host_cpus) {
  return host_threads <= host_cpus ? 2000 : 0;
}

int host_poll_spin_us(MPI_Comm local, int threads) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) {
    const int cpus = int(std::thread::hardware_concurrency());
    for (int c = 0; c < std::min(cpus, CPU_SETSIZE); ++c) CPU_SET(c, &mine);
  }
  // Ranks bound to one core each share nothing; ranks that inherited one CPU set share it.
  cpu_set_t all;
  CHECK_MPI(MPI_Allreduce(&mine, &all, int(sizeof(cpu_set_t)), MPI_BYTE, MPI_BOR, local));
  const int64_t mine_threads = std::max(threads, 1);
  int64_t host_threads = 0;
  CHECK_MPI(MPI_Allreduce(&mine_threads, &host_threads, 1, MPI_INT64_T, MPI_SUM, local));
  return choose_poll_spin_us(host_threads, CPU_COUNT(&all));
}

void Backoff::pause() {
  // Naps as asked: the default timer slack (50 us) would round a 1 us nap up to about 55 us.
  static thread_local const bool precise_naps = prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0;
  (void)precise_naps;
  const auto now = std::chrono::steady_clock::now();
  if (polls_++ == 0) start_ = last_yield_ = now;
  const int spin = poll_spin_us();
  if (spin > 0 && now - start_ < std::chrono::microseconds(spin)) {
    // Busy, with a yield every 50 us: should another process run on this core after all, it
    // gets it within that.
    if (now - last_yield_ < std::chrono::microseconds(50)) {
      for (int i = 0; i < 8; ++i) cpu_relax();
    } else {
      sched_yield();
      last_yield_ = now;
    }
    return;
  }
  if (polls_ <= 64) {
    sched_yield();
    return;
  }
  // A wait past 100 ms is an idle rank (chat, serve): naps of up to 1 ms, not thousands a second.
  const int cap =
      now - start_ > std::chrono::milliseconds(100) ? std::max(max_sleep_us_, 1000) : max_sleep_us_;
  std::this_thread::sleep_for(std::chrono::microseconds(std::min(++naps_, cap)));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

WaitClock::WaitClock() : start_(std::chrono::steady_clock::now()), last_poll_(start_) {}

double WaitClock::elapsed() {
  const auto now = std::chrono::steady_clock::now();
  const auto gap = now - last_poll_;
  if (std::chrono::duration<double>(gap).count() > kPauseSeconds) start_ += gap;
  last_poll_ = now;
  return std::chrono::duration<double>(now - start_).count();
}

void WaitClock::restart() {
  start_ = last_poll_ = std::chrono::steady_clock::now();
}

std::vector<std::string> gather_within(MPI_Comm comm, int root, const std::string& bytes,
                                       const Deadline& deadline) {
  const auto start = std::chrono::steady_clock::now();
  int rank = 0, size = 0;
  CHECK_MPI(MPI_Comm_rank(comm, &rank));
  CHECK_MPI(MPI_Comm_size(comm, &size));
  if (rank != root) {
    std::vector<MPI_Request> send(1, MPI_REQUEST_NULL);
    CHECK_MPI(MPI_Isend(bytes.data(), int(bytes.size()), MPI_BYTE, root, wire::kTagCollective, comm,
                        send.data()));
    wait_sends(send, {root}, deadline, start);
    return {};
  }
  std::vector<std::string> all(static_cast<size_t>(size));
  all[size_t(root)] = bytes;
  std::vector<bool> arrived(size_t(size), false);
  arrived[size_t(root)] = true;
  int remaining = size - 1;
  Backoff backoff(2000);
  while (remaining > 0) {
    for (int r = 0; r < size; ++r) {
      if (arrived[size_t(r)]) continue;
      int found = 0;
      MPI_Message message;
      MPI_Status status;
      CHECK_MPI(MPI_Improbe(r, wire::kTagCollective, comm, &found, &message, &status));
      if (!found) continue;
      int count = 0;
      CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &count));
      all[size_t(r)].resize(size_t(count));
      CHECK_MPI(MPI_Mrecv(all[size_t(r)].data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE));
      arrived[size_t(r)] = true;
      --remaining;
    }
    if (remaining == 0) break;
    if (seconds_since(start) > deadline.seconds) {
      std::vector<int> missing;
      for (int r = 0; r < size; ++r)
        if (!arrived[size_t(r)]) missing.push_back(r);
      abort_job(fmt::format("{} {} silent: did not reach {} within {:.1f} s ({})",
                            join_names(missing), missing.size() == 1 ? "is" : "are", deadline.stage,
                            deadline.seconds, deadline.flag));
    }
    backoff.pause();
  }
  return all;
}

std::string agree_within(MPI_Comm comm, int root, const std::string& bytes,
                         const std::function<std::string(const std::vector<std::string>&)>& decide,
                         const Deadline& deadline) {
  const auto start = std::chrono::steady_clock::now();
  int rank = 0, size = 0;
  CHECK_MPI(MPI_Comm_rank(comm, &rank));
  CHECK_MPI(MPI_Comm_size(comm, &size));
  if (rank == root) {
    // "Arrived" (an empty message) first, then the gather, then the answer: on one tag, in order.
    std::vector<MPI_Request> sends;
    std::vector<int> peers;
    for (int r = 0; r < size; ++r) {
      if (r == root) continue;
      peers.push_back(r);
      CHECK_MPI(
          MPI_Isend(nullptr, 0, MPI_BYTE, r, wire::kTagCollective, comm, &sends.emplace_back()));
    }
    const std::string answer = decide(gather_within(comm, root, bytes, deadline));
    for (int r : peers)
      CHECK_MPI(MPI_Isend(answer.data(), int(answer.size()), MPI_BYTE, r, wire::kTagCollective,
                          comm, &sends.emplace_back()));
    peers.insert(peers.end(), peers.begin(), peers.end());
    wait_sends(sends, peers, deadline, std::chrono::steady_clock::now());
    return answer;
  }
  std::vector<MPI_Request> send(1, MPI_REQUEST_NULL);
  CHECK_MPI(MPI_Isend(bytes.data(), int(bytes.size()), MPI_BYTE, root, wire::kTagCollective, comm,
                      send.data()));
  const double later = reports_first(rank, root) ? 0 : kLaterReportSeconds;
  // Receives the root's next message; names it silent after `limit` seconds from `since`.
  const auto receive = [&](std::chrono::steady_clock::time_point since, double limit,
                           const char* silence) {
    Backoff backoff(2000);
    for (;;) {
      int found = 0;
      MPI_Message message;
      MPI_Status status;
      CHECK_MPI(MPI_Improbe(root, wire::kTagCollective, comm, &found, &message, &status));
      if (found) {
        int count = 0;
        CHECK_MPI(MPI_Get_count(&status, MPI_BYTE, &count));
        std::string out(size_t(count), '\0');
        CHECK_MPI(MPI_Mrecv(out.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE));
        return out;
      }
      if (seconds_since(since) > limit + later)
        abort_job(fmt::format("{} is silent: {} {} within {:.1f} s ({})",
                              rank_identity().name_of(root), silence, deadline.stage, limit,
                              deadline.flag));
      backoff.pause();
    }
  };
  receive(start, deadline.seconds, "did not reach");
  // The root waits deadline.seconds at most for the others, then answers or ends the job.
  std::string answer = receive(std::chrono::steady_clock::now(),
                               deadline.seconds + kAbortTeardownSeconds, "no answer at");
  wait_sends(send, {root}, deadline, start);
  return answer;
}

void wait_within(const std::vector<MPI_Request*>& requests, const std::vector<int>& peer_ranks,
                 double limit_s, const char* what, const std::string& where, const char* flag,
                 std::vector<MPI_Status>* statuses) {
  if (statuses) statuses->resize(requests.size());
  WaitClock clock;
  Backoff backoff;
  for (;;) {
    bool all_done = true;
    for (size_t i = 0; i < requests.size(); ++i) {
      MPI_Request* request = requests[i];
      if (*request == MPI_REQUEST_NULL) continue;
      int done = 0;
      CHECK_MPI(MPI_Test(request, &done, statuses ? &(*statuses)[i] : MPI_STATUS_IGNORE));
      if (!done) all_done = false;
    }
    if (all_done) return;
    if (clock.elapsed() > limit_s)
      for (size_t i = 0; i < requests.size(); ++i)
        if (*requests[i] != MPI_REQUEST_NULL)
          abort_job(fmt::format("{} is silent: no {} within {:.1f} s{} ({})",
                                rank_identity().name_of(peer_ranks[i]), what, limit_s, where,
                                flag));
    backoff.pause();
  }
}

void wait_at_setup(std::vector<MPI_Request>& requests, const std::vector<int>& peer_ranks,
                   double limit_s, const char* what) {
  std::vector<MPI_Request*> pointers;
  for (MPI_Request& request : requests) pointers.push_back(&request);
  wait_within(pointers, peer_ranks, limit_s, what, "", "--startup-timeout");
}

}  // namespace colibri
