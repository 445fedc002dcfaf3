// One colibri-node process under MPI: the start-up handshake (node/handshake.h), roles,
// placement and weight loading, then either the coordinator's engine or an expert rank's serve
// loop (node/expert_server.h).
#pragma once

#include <mpi.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/layout.h"
#include "common/profile.h"
#include "coordinator/engine.h"
#include "coordinator/repin.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "node/expert_server.h"
#include "node/handshake.h"
#include "rank/expert_backend.h"
#include "rank/expert_store.h"
#include "rank/vram_tier.h"
#include "tensor_parallel/split_linear.h"
#include "transport/exchange.h"
#include "transport/liveness.h"
#include "transport/transport.h"
#include "transport/transport_choice.h"

namespace colibri {

struct NodeOptions {
  std::filesystem::path model_dir;
  std::optional<std::filesystem::path> layout_file;
  PlacementPolicy placement = PlacementPolicy::kBalanced;
  int max_rows = 256;  // rows per forward call; longer prompts are prefilled in chunks
  int kv_tokens = 0;   // KV pool of the engine; 0 = default_kv_tokens(config)
  int max_seqs = 1;    // sequences the engine holds at once
  ElemType wire_type = ElemType::kF32;  // rows and partials between ranks (rank 0's choice)
  bool host_combine = false;  // --combine host: one summed partial per host (MpiTransportOptions)
  bool shared_memory = true;  // --shared-memory: rows through shared segments on the
                              // coordinator's host (MpiTransportOptions)
  TransportKind transport = TransportKind::kAuto;  // --transport: to the gpu-expert ranks
  double ram_gb = 0;   // expert rank RAM cache for routed experts; 0 = all resident. The
                       // layout's ram_gb column overrides it per rank.
  double pin_gb = 0;   // routed experts pinned in RAM at start, never evicted (with ram_gb > 0)
  double vram_gb = 0;  // gpu-expert ranks: VRAM for routed experts; 0 = the device's free memory.
                       // The layout's vram_gb column overrides it per rank.
  // The VRAM tier's miss rule (rank/vram_tier.h): host-to-device GB/s from pinned memory, and the
  // GB/s of expert weights the rank's CPU threads compute through.
  double pcie_gbps = 25, cpu_expert_gbps = 10;
  double rank_timeout_s = 300;     // longest silence of a peer once started (see the transport)
  double startup_timeout_s = 300;  // longest wait for the other ranks at each start-up step
  std::vector<AgreedSetting> settings;  // compared across ranks at the handshake
  bool keep_trace = false;
  bool gpu_experts = false;  // a single process computes its routed experts on CUDA device 0
  // A single process runs the coordinator's forward on CUDA device 0 (under mpirun: a gpu in the
  // coordinator's layout row).
  bool coordinator_gpu = false;
  // --split-linears: the coordinator's attention projections, dense MLPs and lm_head split by
  // output rows across it and the cpu-expert ranks (tensor_parallel/split_linear.h).
  bool split_linears = false;
  // --routing-stats: "" (none), "auto" (routing_stats_path) or a file. The coordinator reads it at
  // start-up (for --placement heat) and merges this run's routes into it at shutdown.
  std::string routing_stats;
  int replicas = 0;          // --replicas: extra copies of the hottest experts per MoE layer (heat)
  int repin_every = 0;       // --repin-every: routed tokens between re-placement rounds; 0: off
  int repin_max_moves = 64;  // --repin-max-moves: holder changes per round at most
  bool prefetch_ahead = false;  // --prefetch-ahead (EngineOptions::prefetch_ahead)
  int micro_batches = 1;        // --micro-batches (EngineOptions::micro_batches)
  int micro_batch_rows = EngineOptions::kDefaultMicroBatchRows;  // --micro-batch-rows
  TestFault fault;                                               // test hook
};

class Node {
 public:
  // Collective over `comm`: HELLO, layout, placement, then each rank loads its weights; every
  // step waits at most startup_timeout_s for the other ranks. Throws StartupRefused on every rank
  // when the ranks do not agree or one cannot open its model.
  Node(MPI_Comm comm, const NodeOptions& options);
  ~Node();

  bool is_coordinator() const { return rank_ == layout_.coordinator(); }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const ModelConfig& config() const { return config_; }
  const Layout& layout() const { return layout_; }
  const PlacementTable& placement() const { return placement_.current(); }
  const NodeOptions& options() const { return options_; }
  ElemType wire_type() const { return wire_type_; }
  Profiler& profiler() { return *profiler_; }
  // In-memory bytes of one routed expert (as stored: container, BF16, FP8 or NVFP4; else fp32).
  uint64_t expert_bytes() const;
  // Bytes of the routed experts this rank's store holds in RAM (pinned included); 0 without one.
  uint64_t resident_expert_bytes() const;
  // An expert rank's part of a change of placement (prepare: read the experts it gains; commit:
  // switch its table, drop what it lost).
  void on_placement_change(const PlacementChange& change);
  // Coordinator: one line per rank, gathered at start-up: its resident weights by representation,
  // routed experts in RAM, KV pool and RSS.
  const std::vector<std::string>& memory_report() const { return memory_report_; }
  // Coordinator: the routing statistics file of this run ("" without one), what it held at
  // start-up, and a warning about it ("" when none).
  const std::string& routing_stats_file() const { return routing_stats_file_; }
  const RoutingStats& learned_routes() const { return learned_routes_; }
  const std::string& routing_stats_warning() const { return routing_stats_warning_; }
  // Coordinator: merges the engine's routes into the statistics file; an error is returned as a
  // line, not thrown (a run's output is not lost to it). Called by shutdown().
  std::string save_routing_stats();
  // Coordinator with --repin-every: what live re-placement did; null otherwise.
  const RepinStats* repin_stats() const { return repinner_ ? &repinner_->stats() : nullptr; }

  // Coordinator: how many linears --split-linears split across ranks.
  int split_linear_count() const { return splitter_ ? splitter_->split_count() : 0; }
  // Layers whose attention is split by heads.
  int split_heads_count() const { return splitter_ ? splitter_->split_heads_count() : 0; }
  // The model's identity (config, tensor index, sampled weight bytes), as the handshake agreed.
  const ModelIdentity& model_identity() const { return model_identity_; }
  // Coordinator: the engine whose routed experts run on their owners.
  Engine& engine();
  // Coordinator: ends every expert rank's serve loop.
  void shutdown();
  // Expert rank: serves requests until the coordinator shuts down.
  void serve();
  // Collective with the --rank-timeout deadline: every rank's report, on the coordinator (empty
  // elsewhere).
  std::vector<RankReport> gather_reports();
  // Coordinator, between steps: every expert rank's counters now, asked for over the exchange
  // (those its transport can ask), and the coordinator's own when it owns routed experts; by rank.
  std::vector<LiveCounters> live_counters();

 private:
  // Start-up, in stages (node.cpp): every rank agrees on the plan and loads its weights, then
  // the builder of its role (roles.cpp) makes its side of the exchange; refusals are collective.
  struct Startup;  // node/node_startup.h
  void agree_on_plan(Startup& startup);
  void load_weights(Startup& startup);
  ExchangeContext exchange_context(const StartupPlan& plan);
  void build_alone(Startup& startup);
  void build_coordinator(Startup& startup, ExchangeContext& exchange);
  void build_expert_rank(Startup& startup, ExchangeContext& exchange);
  void build_split_linears(Startup& startup);
  // This rank's counters now: its profiler's, its store's and its device's.
  LiveCounters own_counters() const;
  void check_coordinator(Startup& startup);
  void build_engine(Startup& startup);
  void become_ready(const Startup& startup);
  // Expert rank: the store of owned routed experts, refused (collectively) when its projected
  // peak memory exceeds MemAvailable.
  void open_expert_store();
  Deadline startup_deadline(std::string stage) const;
  std::string memory_line(const std::string& host) const;
  // The VRAM tier's miss rule from --pcie-gbps and --cpu-expert-gbps.
  VramCostModel vram_cost() const;

  MPI_Comm comm_;
  NodeOptions options_;
  int rank_ = 0, size_ = 1;
  ModelConfig config_;
  std::unique_ptr<Checkpoint> checkpoint_;
  Layout layout_;
  LivePlacement placement_;  // replaced whole when a change of placement commits
  ElemType wire_type_ = ElemType::kF32;
  std::unique_ptr<LinearSplitter> splitter_;     // coordinator, --split-linears (before weights_:
                                                 // its split matrices call it)
  std::unique_ptr<LinearServer> linear_server_;  // cpu-expert ranks, --split-linears
  ModelWeights weights_;
  std::unique_ptr<ExpertStore> expert_store_;  // owners of a multi-rank run
  std::vector<std::pair<int, int>> owned_;     // its (layer, expert) pairs
  std::unique_ptr<Profiler> profiler_;
  std::unique_ptr<ExpertBackend> expert_backend_;  // owners of routed experts
  std::unique_ptr<Dispatcher> dispatcher_;         // coordinator
  std::unique_ptr<ExpertChannel> channel_;         // expert ranks
  std::unique_ptr<Engine> engine_;                 // coordinator
  std::unique_ptr<Repinner> repinner_;             // coordinator, --repin-every
  std::unique_ptr<LivenessHub> liveness_hub_;      // coordinator of a job
  std::unique_ptr<LivenessLink> liveness_link_;    // the other ranks of a job
  bool shut_down_ = false;
  std::vector<std::string> memory_report_;
  std::string routing_stats_file_, routing_stats_warning_;
  RoutingStats learned_routes_;
  ModelIdentity model_identity_;
  int fault_requests_ = 0;  // requests for the test fault's layer (expert ranks)
};

}  // namespace colibri
