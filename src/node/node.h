// One colibri-node process under MPI: start-up handshake, roles, placement, weight loading, and
// either the coordinator's model or an expert rank's serve loop.
#pragma once

#include <mpi.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/layout.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/reference_model.h"
#include "model/weights.h"
#include "node/profile.h"
#include "rank/expert_store.h"
#include "rank/placement.h"
#include "transport/mpi_transport.h"

namespace colibri {

struct NodeOptions {
  std::filesystem::path model_dir;
  std::optional<std::filesystem::path> layout_file;
  PlacementPolicy placement = PlacementPolicy::kBalanced;
  int max_rows = 256;  // rows per forward call; longer prompts are prefilled in chunks
  double ram_gb = 0;   // expert rank RAM cache for routed experts; 0 = all resident. The
                       // layout's ram_gb column overrides it per rank.
  double pin_gb = 0;   // routed experts pinned in RAM at start, never evicted (with ram_gb > 0)
  double rank_timeout_s = 300;
  bool keep_trace = false;
  int corrupt_reply_at_layer = -1;  // test hook, see MpiTransportOptions
  int signal_at_layer = -1;         // test hook: an expert rank raises `signal` serving this layer
  int signal = 0;
};

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

// FNV-1a of config.json and the tensor index (names, dtypes, shapes).
uint64_t model_hash(const std::filesystem::path& model_dir, const Checkpoint& checkpoint);

class Node {
 public:
  // Collective over `comm`: HELLO, layout, placement, then each rank loads its weights.
  Node(MPI_Comm comm, const NodeOptions& options);
  ~Node();

  bool is_coordinator() const { return rank_ == layout_.coordinator(); }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const ModelConfig& config() const { return config_; }
  const Layout& layout() const { return layout_; }
  const PlacementTable& placement() const { return placement_; }
  Profiler& profiler() { return *profiler_; }
  uint64_t expert_bytes()
      const;  // in-memory bytes of one routed expert (quantized in a container, else fp32)

  // Coordinator: the model whose routed experts run on their owners.
  ReferenceModel& model();
  // Coordinator: ends every expert rank's serve loop.
  void shutdown();
  // Expert rank: serves requests until the coordinator shuts down.
  void serve();
  // Collective: every rank's report, on the coordinator (empty elsewhere).
  std::vector<RankReport> gather_reports();

 private:
  void handshake(const std::filesystem::path& model_dir);
  // Expert rank: the store of owned routed experts, refused (collectively) when its projected
  // peak memory exceeds MemAvailable.
  void open_expert_store();

  MPI_Comm comm_;
  NodeOptions options_;
  int rank_ = 0, size_ = 1;
  ModelConfig config_;
  std::unique_ptr<Checkpoint> checkpoint_;
  Layout layout_;
  PlacementTable placement_;
  ModelWeights weights_;
  std::unique_ptr<ExpertStore> expert_store_;  // expert ranks of a multi-rank run
  std::unique_ptr<Profiler> profiler_;
  std::unique_ptr<MpiTransport> transport_;
  std::unique_ptr<ExpertExecutor> remote_experts_;
  std::unique_ptr<ReferenceModel> model_;
  bool shut_down_ = false;
};

}  // namespace colibri
