// Start-up agreement across ranks, every step a collective with a deadline
// (transport/deadline.h), so that no rank waits forever for one that failed, stopped or died:
//
// 1. agree_to_start: every rank's outcome of its own checks (arguments, files) and its host reach
//    rank 0, which names the lowest rank that cannot go on; that rank prints its own error.
// 2. handshake: every rank says who it is and what it runs (HELLO: protocol version, model
//    identity including a fingerprint of the weight data, the settings that must agree, host,
//    GPUs, node-local rank); rank 0 compares them, makes the layout and the placement table, and
//    broadcasts the plan, or one refusal naming the ranks and the field.
#pragma once

#include <mpi.h>

#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/buffer.h"
#include "common/layout.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "moe/placement.h"
#include "transport/deadline.h"
#include "transport/transport_choice.h"

namespace colibri {

// ---- 1. every rank's own checks ---------------------------------------------------------------

// One rank's outcome of a start-up step.
struct StartupStatus {
  bool stop = false;  // this rank cannot go on: an error, or --help
  int exit_code = 0;  // the job's exit code when this rank's stop is the one reported
  bool is_error = false;
  std::string message;  // the error, or the help text

  template <class Archive>
  void serialize(Archive& ar) {
    ar(stop, exit_code, is_error, message);
  }
};

struct StartupVerdict {
  int reporter = -1;     // the rank whose stop is reported (the lowest error, else the lowest help)
  StartupStatus status;  // the reporter's
  std::vector<std::string> hosts;  // [size]
};

// Collective with a deadline over `comm`: every rank learns whether all can go on, and every
// rank's host (rank_identity().hosts is set from it).
StartupVerdict agree_to_start(MPI_Comm comm, const StartupStatus& mine, const Deadline& deadline);

// ---- 2. the handshake --------------------------------------------------------------------------

// A command-line setting compared across ranks at the handshake.
struct AgreedSetting {
  enum Scope : int {
    kJob = 0,          // every rank's value must be the same (it sizes or shapes the exchange)
    kCoordinator = 1,  // used by the coordinator only: a rank that is given it must be given
                       // the coordinator's value
  };
  std::string flag;    // "--max-rows"
  std::string value;   // the effective value, as compared
  bool given = false;  // on this rank's command line
  int scope = kJob;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(flag, value, given, scope);
  }
};

// Protocol version and model identity, checked across all ranks at start-up.
struct Hello {
  int protocol_version = 0;  // serialized first, so that any version can read it
  int rank = 0;
  std::string host;
  std::string error;  // this rank could not open its model; nothing below is set then
  std::string model_dir;
  uint64_t model_hash = 0;           // config.json and the tensor index
  uint64_t weights_fingerprint = 0;  // sampled bytes of the weight data
  int gpus_on_host = 0;              // CUDA devices this rank sees
  std::string gpu_why_none;          // why it sees none, when gpus_on_host is 0
  int local_rank = 0;
  int thread_level = 0;       // MPI thread support this rank was given
  double rank_timeout_s = 0;  // its --rank-timeout (the heartbeat is sent often enough for all)
  std::vector<AgreedSetting> settings;
  bool nccl_built = false;  // this build has the NCCL transport

  template <class Archive>
  void serialize(Archive& ar) {
    ar(protocol_version, rank, host, error, model_dir, model_hash, weights_fingerprint,
       gpus_on_host, local_rank, thread_level, rank_timeout_s, settings, gpu_why_none, nccl_built);
  }
};

// What every rank starts with, decided by rank 0.
struct StartupPlan {
  std::string error;            // non-empty: every rank refuses to start
  int reporter = 0;             // the rank that prints the error
  bool names_reporter = false;  // the error is the reporter's own (see StartupRefused)
  std::vector<std::string> hosts;
  Layout layout;
  PlacementTable placement;
  ElemType wire_type = ElemType::kF32;
  double heartbeat_s = 0;       // coordinator -> expert ranks while idle; 0: none
  std::vector<int> nccl_ranks;  // NCCL between these ranks (transport_choice.h); empty: MPI
  // Rank 0's routing statistics (HandshakeInput::routing_stats): the file, what it held, a
  // warning about it ("" when none), and the model it belongs to.
  std::string routing_stats_file;
  RoutingStats learned_routes;
  std::string routing_stats_warning;
  ModelIdentity model_identity;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(error, reporter, names_reporter, hosts, layout, placement, wire_type, heartbeat_s,
       nccl_ranks, routing_stats_file, learned_routes, routing_stats_warning,
       model_identity.model_hash, model_identity.weights_fingerprint);
  }
};

struct HandshakeInput {
  std::filesystem::path model_dir;
  std::optional<std::filesystem::path> layout_file;
  PlacementPolicy placement = PlacementPolicy::kBalanced;
  int replicas = 0;
  std::string routing_stats;  // NodeOptions::routing_stats
  uint64_t expert_bytes = 0;
  ElemType wire_type = ElemType::kF32;  // rank 0's; --wire is compared as a setting
  std::string open_error;  // non-empty: this rank could not open its model (config, checkpoint)
  int local_rank = 0;      // on its host, from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)
  double rank_timeout_s = 300;
  std::vector<AgreedSetting> settings;
  TransportKind transport = TransportKind::kAuto;  // rank 0's; --transport is compared too
  Deadline deadline;
};

// FNV-1a (64-bit) of `bytes`, continuing from `hash` (kFnvOffset to start).
inline constexpr uint64_t kFnvOffset = 14695981039346656037ull;
uint64_t fnv1a(uint64_t hash, std::string_view bytes);

// FNV-1a of config.json and the tensor index (names, dtypes, shapes).
uint64_t model_hash(const std::filesystem::path& model_dir, const Checkpoint& checkpoint);

// A cheap fingerprint of the weight data: per safetensors file its name, size and 16 sampled
// ranges of 4 KiB, and 64 bytes from the middle of every tensor that is not a routed expert.
// Two checkpoints of the same shapes with different weights differ in it; a difference confined
// to a few routed experts may not.
uint64_t weights_fingerprint(const Checkpoint& checkpoint);

// The routing statistics file of `option` (NodeOptions::routing_stats): none for "", the given
// path, or for "auto" colibri-routing.stats in the model directory when it is writable, else
// routing-<model hash>.stats in $XDG_STATE_HOME/colibri-node (~/.local/state/colibri-node).
std::filesystem::path routing_stats_path(const std::string& option,
                                         const std::filesystem::path& model_dir,
                                         const ModelIdentity& id);

// Collective over `comm`, with input.deadline. `config` and `checkpoint` are null when
// input.open_error is set. Throws StartupRefused on every rank when a rank cannot start.
StartupPlan handshake(MPI_Comm comm, const ModelConfig* config, const Checkpoint* checkpoint,
                      const HandshakeInput& input);

}  // namespace colibri
