#include "transport/mpi_check.h"

#include <fmt/format.h>

#include "common/error.h"
#include "transport/liveness.h"
#include "transport/protocol.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

namespace colibri {

RankIdentity& rank_identity() {
  static RankIdentity identity;
  return identity;
}

namespace {

constexpr int kEarlyHostsWaitMs = 1000;

// The early host messages (post_early_hosts): rank 0 receives one from every rank and sends its
// own to each; the others send theirs and receive rank 0's.
struct EarlyHosts {
  std::vector<std::array<char, MPI_MAX_PROCESSOR_NAME>> buffers;  // [size] received names
  std::vector<MPI_Request> receives;                              // [size]
  std::vector<MPI_Request> sends;
  std::array<char, MPI_MAX_PROCESSOR_NAME> mine{};
  std::vector<std::string> hosts;  // [size] arrived so far; "" where not (yet)
};

EarlyHosts& early_hosts() {
  static EarlyHosts early;
  return early;
}

// The host of rank r from an early message that has arrived, else "".
std::string early_host_of(int r) {
  EarlyHosts& early = early_hosts();
  if (r < 0 || size_t(r) >= early.receives.size()) return {};
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (early.hosts[size_t(r)].empty() && early.receives[size_t(r)] != MPI_REQUEST_NULL &&
      initialized && !finalized) {
    int done = 0;
    if (MPI_Test(&early.receives[size_t(r)], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
      auto& name = early.buffers[size_t(r)];
      name.back() = '\0';
      early.hosts[size_t(r)] = name.data();
    }
  }
  return early.hosts[size_t(r)];
}

}  // namespace

std::string RankIdentity::name_of(int r) const {
  if (size_t(r) < hosts.size()) return fmt::format("rank {}@{}", r, hosts[size_t(r)]);
  if (r == rank && !host.empty()) return fmt::format("rank {}@{}", r, host);
  const std::string early = early_host_of(r);
  return fmt::format("rank {}@{}", r, early.empty() ? "?" : early);
}

void post_early_hosts(MPI_Comm comm) {
  EarlyHosts& early = early_hosts();
  int rank = 0, size = 0;
  CHECK_MPI(MPI_Comm_rank(comm, &rank));
  CHECK_MPI(MPI_Comm_size(comm, &size));
  const std::string& host = rank_identity().host;
  std::copy_n(host.data(), std::min(host.size(), early.mine.size() - 1), early.mine.data());
  early.buffers.assign(size_t(size), {});
  early.receives.assign(size_t(size), MPI_REQUEST_NULL);
  early.hosts.assign(size_t(size), {});
  const auto send = [&](int to) {
    CHECK_MPI(MPI_Isend(early.mine.data(), int(early.mine.size()), MPI_CHAR, to, wire::kTagHostName,
                        comm, &early.sends.emplace_back()));
  };
  const auto receive = [&](int from) {
    CHECK_MPI(MPI_Irecv(early.buffers[size_t(from)].data(), int(early.buffers[size_t(from)].size()),
                        MPI_CHAR, from, wire::kTagHostName, comm, &early.receives[size_t(from)]));
  };
  if (rank == 0) {
    for (int r = 1; r < size; ++r) {
      receive(r);
      send(r);
    }
  } else {
    receive(0);
    send(0);
  }
  // A short, bounded wait for them to go through (a connection between two ranks is made with
  // both progressing): a rank that stops just after this has its host known to the others.
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int sent = 0;
    CHECK_MPI(MPI_Testall(int(early.sends.size()), early.sends.data(), &sent, MPI_STATUSES_IGNORE));
    bool received = true;
    for (int r = 0; r < size; ++r)
      if (r != rank && (rank == 0 || r == 0) && early_host_of(r).empty()) received = false;
    if ((sent && received) ||
        std::chrono::steady_clock::now() - start > std::chrono::milliseconds(kEarlyHostsWaitMs))
      return;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void finish_early_hosts() {
  EarlyHosts& early = early_hosts();
  CHECK_MPI(MPI_Waitall(int(early.receives.size()), early.receives.data(), MPI_STATUSES_IGNORE));
  CHECK_MPI(MPI_Waitall(int(early.sends.size()), early.sends.data(), MPI_STATUSES_IGNORE));
  early = EarlyHosts{};
}

namespace {
std::function<void(const std::string&)>& abort_hook() {
  static std::function<void(const std::string&)> hook;
  return hook;
}
}  // namespace

void set_abort_hook(std::function<void(const std::string&)> hook) {
  abort_hook() = std::move(hook);
}

void run_abort_hook(const std::string& what) {
  static std::atomic<bool> ran{false};
  if (abort_hook() && !ran.exchange(true)) abort_hook()(what);
}

void abort_job(const std::string& what) {
  // Once per process: when two threads find a fault at once (the coordinator's main thread a
  // silent rank in an exchange, its heartbeat thread an idle one of the same cut host), the
  // first reports and ends the job; the second waits for that end without a second line.
  // A re-entry from the reporting thread itself (a failing MPI call in its abort) goes on.
  static std::atomic<bool> aborting{false};
  thread_local bool reporting = false;
  if (!reporting && aborting.exchange(true))
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  reporting = true;
  liveness_report_error();  // the peers' liveness threads leave the report to this line
  run_abort_hook(what);
  const RankIdentity& me = rank_identity();
  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  const bool running = initialized && !finalized;
  if (running) MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) {  // alone: a plain error line, no job to tear down
    std::fprintf(stderr, "colibri-node: error: %s\n", one_line(what).c_str());
    if (running) MPI_Finalize();
    std::exit(1);
  }
  std::fprintf(stderr, "[rank %d@%s] error: %s\n", me.rank, me.host.c_str(),
               one_line(what).c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

void check_mpi(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char message[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, message, &length);
  abort_job(fmt::format("{} failed at {}:{}: {}", call, file, line,
                        std::string(message, size_t(length))));
}

}  // namespace colibri
