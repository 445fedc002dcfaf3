// `colibri-node calibrate`: measures this machine's constants for `colibri-node plan` and writes
// them as a hardware description (plan.h's format) with a "calibration" block: the version, the
// machine's fingerprint and every raw measurement. Measured, each the median of repetitions:
//   - read bandwidth per thread count (socket "mem_gbps": the best; "core_gbps": one thread);
//   - the routed-expert FFN of the engine (run_expert_pairs) per weight format: the fixed cost of
//     one expert call at one row on small experts in cache ("expert_us"), the rate of streaming
//     large experts from memory at one row ("expert_gbps") and of computing 64 rows
//     ("expert_gflops"; the socket's "gflops" is the best of them);
//   - the fixed cost of one of the coordinator's BF16 matrix products ("linear_us");
//   - disk read GB/s of a file written in the scratch directory (O_DIRECT where it is allowed);
//   - under `mpirun -np 2`: the exchange's fixed cost and rate (links "shm_us", "shm_gbps"),
//     fitted to dispatch + combine of 1 to 64 rows through the MPI transport.
// Without mpirun the links are left out, so the plan names its defaults for them.
#pragma once

#include <string>

namespace colibri {

// Where calibrate writes and plan reads by default: $XDG_CONFIG_HOME/colibri-node/hardware.json,
// else $HOME/.config/colibri-node/hardware.json.
std::string default_hardware_path();

int calibrate_main(int argc, char** argv);

}  // namespace colibri
