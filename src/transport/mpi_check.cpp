#include "transport/mpi_check.h"

#include <fmt/format.h>

#include "common/error.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

namespace colibri {

RankIdentity& rank_identity() {
  static RankIdentity identity;
  return identity;
}

std::string RankIdentity::name_of(int r) const {
  const std::string& h = size_t(r) < hosts.size() ? hosts[size_t(r)] : std::string("?");
  return fmt::format("rank {}@{}", r, h);
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
  static std::atomic<bool> hook_ran{false};
  if (abort_hook() && !hook_ran.exchange(true)) abort_hook()(what);
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
