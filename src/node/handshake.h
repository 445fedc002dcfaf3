// Start-up agreement across ranks: every rank says who it is (HELLO: protocol version, model
// identity, host, GPUs, node-local rank); rank 0 checks them, makes the layout and the placement
// table, and broadcasts the plan, or one refusal every rank throws.
#pragma once

#include <mpi.h>

#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/layout.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "rank/placement.h"

namespace colibri {

// Protocol version and model identity, checked across all ranks at start-up.
struct Hello {
  int protocol_version = 0;
  int rank = 0;
  std::string host;
  uint64_t model_hash = 0;
  int gpus_on_host = 0;
  int local_rank = 0;
  int host_index = 0;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(protocol_version, rank, host, model_hash, gpus_on_host, local_rank, host_index);
  }
};

// What every rank starts with, decided by rank 0.
struct StartupPlan {
  std::string error;  // non-empty: every rank refuses to start
  std::vector<std::string> hosts;
  Layout layout;
  PlacementTable placement;
  ElemType wire_type = ElemType::kF32;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(error, hosts, layout, placement, wire_type);
  }
};

struct HandshakeInput {
  std::filesystem::path model_dir;
  std::optional<std::filesystem::path> layout_file;
  PlacementPolicy placement = PlacementPolicy::kBalanced;
  uint64_t expert_bytes = 0;
  ElemType wire_type = ElemType::kF32;  // rank 0's choice is everyone's
};

// FNV-1a of config.json and the tensor index (names, dtypes, shapes).
uint64_t model_hash(const std::filesystem::path& model_dir, const Checkpoint& checkpoint);

// Collective over `comm`. Throws StartupRefused (on every rank) when rank 0 refuses.
StartupPlan handshake(MPI_Comm comm, const ModelConfig& config, const Checkpoint& checkpoint,
                      const HandshakeInput& input);

// Rank `root` broadcasts a byte string to every rank.
std::string broadcast_bytes(MPI_Comm comm, int root, std::string bytes);
// Every rank's byte string, on `root` (empty elsewhere).
std::vector<std::string> gather_bytes(MPI_Comm comm, int root, const std::string& bytes);

}  // namespace colibri
