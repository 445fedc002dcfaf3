// MPI error handling: every failure names this rank and host and ends the whole job with
// MPI_Abort, so no peer is left waiting.
#pragma once

#include <mpi.h>

#include <functional>
#include <string>
#include <vector>

namespace colibri {

struct RankIdentity {
  int rank = 0;
  int size = 1;
  std::string host;
  std::vector<std::string> hosts;    // [size], filled after start-up
  std::string name_of(int r) const;  // "rank r@host"
};

// Set once by the node at start-up; used by the error handler.
RankIdentity& rank_identity();

// Right after MPI_Init, before the first start-up step: every rank sends its host to rank 0 and
// rank 0 its own to every rank (tag wire::kTagHostName), waiting at most 1 s for them to go
// through. Until the first step
// has exchanged the hosts, name_of() takes a host from these messages where one has arrived, so
// that a rank silent at that step is named with its host (else "rank r@?").
void post_early_hosts(MPI_Comm comm);
// Completes those messages; call once every rank has passed the first start-up step.
void finish_early_hosts();

// Prints "[rank r@host] error: <what>" to stderr and aborts every rank of the job.
[[noreturn]] void abort_job(const std::string& what);

// Runs once, first thing in abort_job, with its message: the server ends every client's stream
// with an error before the job goes down. Empty: nothing. Set before serving, from one thread.
void set_abort_hook(std::function<void(const std::string&)> hook);
// Runs that hook (once per process, as abort_job would) without ending the job: another rank
// reported an error and its abort is ending the job.
void run_abort_hook(const std::string& what);

void check_mpi(int code, const char* call, const char* file, int line);

}  // namespace colibri

#define CHECK_MPI(call) ::colibri::check_mpi((call), #call, __FILE__, __LINE__)

namespace colibri {

// This rank's number in `comm`, and the ranks in it.
inline int comm_rank(MPI_Comm comm) {
  int rank = 0;
  CHECK_MPI(MPI_Comm_rank(comm, &rank));
  return rank;
}
inline int comm_size(MPI_Comm comm) {
  int size = 0;
  CHECK_MPI(MPI_Comm_size(comm, &size));
  return size;
}

}  // namespace colibri
