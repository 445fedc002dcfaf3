// colibri-node: run a Mixture-of-Experts model from a Hugging Face directory, alone or as one
// rank of `mpirun -np N colibri-node`. main parses, initialises MPI and hands over to the node's
// run (node/run_modes.h) or to a subcommand.
#include <fmt/format.h>
#include <mpi.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "common/error.h"
#include "node/command_line.h"
#include "node/handshake.h"
#include "node/node.h"
#include "node/run_modes.h"
#include "plan/calibrate.h"
#include "plan/plan_main.h"
#include "plan/tune.h"
#include "transport/liveness.h"
#include "transport/mpi_check.h"
#include "transport/watchdog.h"

namespace {

// Prints why this rank stops: the help text on stdout, or one error line, naming the rank when it
// found the error itself in a job ("[rank r@host] error: ..."), else "colibri-node: error: ...".
void report_stop(const colibri::StartupStatus& status, bool name_rank) {
  if (!status.is_error) {
    std::fputs(status.message.c_str(), stdout);
    std::fflush(stdout);
    return;
  }
  const colibri::RankIdentity& me = colibri::rank_identity();
  const std::string message = colibri::one_line(status.message);
  if (name_rank)
    std::fprintf(stderr, "[rank %d@%s] error: %s\n", me.rank, me.host.c_str(), message.c_str());
  else
    std::fprintf(stderr, "colibri-node: error: %s\n", message.c_str());
  std::fflush(stderr);
}

// MPI_Finalize waits for every rank too: within `seconds`, quietly (a rank that ends the job
// has said why; one stuck there is ended by mpirun with the rest).
void finalize(double seconds) {
  const colibri::WatchdogScope watchdog(seconds, "");
  MPI_Finalize();
}

// COLIBRI_TEST_FAULT at "init": the rank from the launcher's environment (a malformed value is
// refused after MPI_Init, with the other checks).
void raise_early_test_fault() {
  const int rank = colibri::launcher_rank();
  try {
    colibri::raise_test_fault(colibri::test_fault_from_env(rank), colibri::TestFault::kInit, rank);
  } catch (const colibri::Error&) {
  }
}

// The subcommands, each with its own command line; nullopt when argv[1] names none.
std::optional<int> run_subcommand(int argc, char** argv) {
  if (argc < 2) return std::nullopt;
  const std::string_view name = argv[1];
  // Needs no MPI.
  if (name == "plan") return colibri::plan_main(argc - 1, argv + 1);
  // calibrate starts MPI itself, only under mpirun -np 2 (the exchange).
  if (name == "calibrate") return colibri::calibrate_main(argc - 1, argv + 1);
  // tune starts its jobs through the launcher.
  if (name == "tune") return colibri::tune_main(argc - 1, argv + 1);
  return std::nullopt;
}

// An exit() before MPI_Finalize (not through abort_job, which ends with MPI_Abort and _Exit):
// say so with this rank's host, which Open MPI's report of it leaves out.
void report_exit_before_finalize() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  colibri::liveness_report_error();  // this line says why: the coordinator adds none
  const colibri::RankIdentity& self = colibri::rank_identity();
  std::fprintf(stderr, "[rank %d@%s] error: exit() before MPI_Finalize; the job ends\n", self.rank,
               self.host.c_str());
  std::fflush(stderr);
}

// MPI_Init under the start-up deadline, then this rank's identity; returns its rank.
int init_mpi(int& argc, char**& argv) {
  // The coordinator's heartbeat to the expert ranks is sent from its own thread.
  // MPI_Init waits for every rank without a deadline of its own: the watchdog gives it one.
  const double init_timeout_s =
      colibri::startup_timeout_from_argv(argc, argv, colibri::NodeOptions{}.startup_timeout_s);
  raise_early_test_fault();
  int provided = 0;
  {
    const colibri::WatchdogScope watchdog(init_timeout_s, "MPI_Init");
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Named in every error from here on; the other ranks' hosts come with the first start-up step.
  colibri::RankIdentity& me = colibri::rank_identity();
  me.rank = rank;
  MPI_Comm_size(MPI_COMM_WORLD, &me.size);
  char host[MPI_MAX_PROCESSOR_NAME];
  int host_length = 0;
  MPI_Get_processor_name(host, &host_length);
  me.host = std::string(host, size_t(host_length));
  std::atexit(report_exit_before_finalize);
  colibri::post_early_hosts(MPI_COMM_WORLD);
  return rank;
}

// This rank's own checks of its arguments and files: what stops it (an error, or --help), if
// anything.
colibri::StartupStatus check_arguments(CLI::App& app, colibri::CommandLine& args, int argc,
                                       char** argv, int rank, int size) {
  colibri::StartupStatus status;
  try {
    app.parse(argc, argv);
    args.node.fault = colibri::test_fault_from_env(rank);
    colibri::check_command_line(app, args, rank, size);
  } catch (const CLI::ParseError& e) {
    status = {true, e.get_exit_code(), e.get_exit_code() != 0, {}};
    if (status.is_error) {
      status.message = fmt::format("{} (run with --help for more information)", e.what());
    } else {  // --help
      std::ostringstream out, err;
      app.exit(e, out, err);
      status.message = out.str();
    }
  } catch (const colibri::Error& e) {
    status = {true, 1, true, e.what()};
  } catch (const std::exception& e) {
    status = {true, 1, true, fmt::format("internal error: {}", e.what())};
  }
  return status;
}

// The run, once every rank agreed to start; returns the exit code. A refused start-up is
// reported by the rank that found it; any other error ends the job.
int hand_over(const colibri::CommandLine& args, int rank, int size) {
  try {
    return colibri::run_node(args);
  } catch (const colibri::StartupRefused& e) {
    if (rank == e.reporter())
      report_stop({true, 1, true, e.what()}, e.names_reporter() && size > 1);
    return 1;
  } catch (const colibri::Error& e) {
    colibri::abort_job(e.what());
  } catch (const std::exception& e) {
    colibri::abort_job(fmt::format("internal error: {}", e.what()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (const std::optional<int> code = run_subcommand(argc, argv)) return *code;
  const int rank = init_mpi(argc, argv);
  const int size = colibri::rank_identity().size;

  colibri::CommandLine args;
  CLI::App app{
      "colibri-node: Mixture-of-Experts inference across GPUs and CPU memory.\n"
      "Run alone or as `mpirun -np N colibri-node ...` (rank 0 coordinates unless --layout says "
      "otherwise)."};
  args.node.model_dir = COLIBRI_DEFAULT_MODEL;
  colibri::add_flags(app, args);

  // Every rank checks its own arguments and files, then all compare the outcome under a
  // deadline: the lowest rank that cannot go on prints why, and every rank ends with its code.
  const colibri::StartupStatus status = check_arguments(app, args, argc, argv, rank, size);
  colibri::raise_test_fault(args.node.fault, colibri::TestFault::kStartup, rank);
  // A timeout that did not parse or validate waits the default.
  const double startup_timeout_s =
      status.stop ? colibri::NodeOptions{}.startup_timeout_s : args.node.startup_timeout_s;
  const colibri::StartupVerdict verdict = colibri::agree_to_start(
      MPI_COMM_WORLD, status,
      {startup_timeout_s, "--startup-timeout", "start-up (argument checks)"});
  colibri::finish_early_hosts();  // every rank passed the first step: their messages arrived
  if (verdict.reporter >= 0) {
    if (verdict.reporter == rank) report_stop(status, size > 1);
    finalize(startup_timeout_s);
    return verdict.status.exit_code;
  }

  const int code = hand_over(args, rank, size);
  finalize(args.node.startup_timeout_s);
  return code;
}
