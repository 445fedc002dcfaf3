// A deadline for the blocking MPI calls that have none of their own: MPI_Init, the communicator
// split before the handshake and MPI_Finalize wait on every peer, so that a rank stopped in its
// first instant would leave the others there forever. While a WatchdogScope is open, a thread
// watches the clock; past `seconds` it prints one line naming the step and ends this process
// (exit code 1, without unwinding: the stuck call is still on the stack), and mpirun then ends
// the job.
#pragma once

#include <string>

namespace colibri {

class WatchdogScope {
 public:
  // `what` names the step in the error: "MPI_Init", "the communicator split", ...; empty: no
  // line (MPI_Finalize, reached also while the job is torn down, when the reason is printed).
  WatchdogScope(double seconds, std::string what);
  ~WatchdogScope();
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;
};

// This rank's number before MPI_Init, from the launcher's environment (OMPI_COMM_WORLD_RANK,
// PMIX_RANK, PMI_RANK); -1 when none is set (a single process).
int launcher_rank();

// --startup-timeout read from argv before MPI_Init ("--startup-timeout S" or
// "--startup-timeout=S"); `fallback` when absent or not a positive finite number (the argument
// checks refuse it later).
double startup_timeout_from_argv(int argc, char** argv, double fallback);

}  // namespace colibri
