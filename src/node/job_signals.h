// How the ranks of a job meet mpirun's teardown. Open MPI's mpirun ends a job (Ctrl-C or SIGTERM
// to mpirun, or a rank that died) by sending every rank SIGCONT, then SIGTERM after
// odls_base_sigkill_timeout seconds (default 1), then SIGKILL after as many again. The ranks are
// in process groups of their own, so a Ctrl-C in the terminal reaches mpirun only.
//
// - A serving coordinator takes a SIGCONT that did not follow a stop as the start of the teardown
//   and drains; the SIGTERM that follows ends the requests still running with an error, before
//   the SIGKILL (coordinator/http_server.cpp).
// - An expert rank of a serving job defers a SIGTERM that comes within the teardown window after
//   a SIGCONT: the coordinator ends it (or mpirun's SIGKILL does), so that running requests can
//   end with their last event first. A SIGTERM alone ends it as before.
// - A single process generating from the command line ends at SIGINT or SIGTERM with one line;
//   its output so far is already written (every token is flushed as it is generated). In an
//   offline job the ranks keep the default: mpirun's teardown is also how a job that failed
//   elsewhere ends, and the rank that found the fault has printed the one line.
#pragma once

namespace colibri {

// Seconds from mpirun's SIGCONT to its SIGKILL: 2 x odls_base_sigkill_timeout, read from the
// environment mpirun gives the ranks (OMPI_MCA_odls_base_sigkill_timeout; 1 when unset).
double teardown_window_seconds();

void install_expert_rank_signal_handlers();
void install_offline_coordinator_signal_handlers();

}  // namespace colibri
