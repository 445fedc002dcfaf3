#include "node/node.h"

#include <fstream>

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/error.h"
#include "common/huge_pages.h"
#include "common/serialize.h"
#include "model/container.h"
#include "node/handshake.h"
#include "node/memory_plan.h"
#include "node/node_startup.h"
#include "node/numa.h"
#include "transport/deadline.h"
#include "transport/exchange.h"
#include "transport/liveness.h"
#include "transport/mpi_check.h"
#include "transport/watchdog.h"

namespace colibri {

Node::Node(MPI_Comm comm, const NodeOptions& options) : comm_(comm), options_(options) {
  Startup startup;
  agree_on_plan(startup);
  load_weights(startup);
  ExchangeContext exchange = exchange_context(startup.plan);
  if (options_.gpu_experts && size_ > 1)
    startup.refuse(
        "--experts gpu is for a single process; under mpirun, give expert ranks the gpu-expert "
        "role in --layout");
  if (size_ == 1)
    build_alone(startup);
  else if (is_coordinator())
    build_coordinator(startup, exchange);
  else
    build_expert_rank(startup, exchange);
  build_split_linears(startup);
  check_coordinator(startup);
  const StartupVerdict verdict =
      agree_to_start(comm_, startup.status, startup_deadline("start-up (GPU expert backends)"));
  if (verdict.reporter >= 0) throw StartupRefused(verdict.status.message);
  if (is_coordinator()) build_engine(startup);
  become_ready(startup);
  profiler_->restart_epoch();
}

// Identity, the node-local rank, the model opened, and the handshake's plan (layout, placement,
// wire, routing statistics) taken in.
void Node::agree_on_plan(Startup& startup) {
  CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  CHECK_MPI(MPI_Comm_size(comm_, &size_));
  char host[MPI_MAX_PROCESSOR_NAME];
  int host_length = 0;
  CHECK_MPI(MPI_Get_processor_name(host, &host_length));
  RankIdentity& me = rank_identity();
  me.rank = rank_;
  me.size = size_;
  me.host = std::string(host, size_t(host_length));

  HandshakeInput input;
  // Node-local rank, for the default layout's GPU assignment, and how waits poll on this host.
  // MPI_Comm_split_type and host_poll_spin_us block without a deadline: they come first, while
  // every rank is at the same point, before any file is read.
  raise_test_fault(options_.fault, TestFault::kSplit, rank_);
  MPI_Comm local;
  {
    const WatchdogScope watchdog(options_.startup_timeout_s, "the communicator split at start-up");
    CHECK_MPI(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local));
    CHECK_MPI(MPI_Comm_rank(local, &input.local_rank));
    set_poll_spin_us(host_poll_spin_us(local, omp_get_max_threads()));
    CHECK_MPI(MPI_Comm_free(&local));
  }

  // A model this rank cannot open is reported by the handshake, so that the other ranks learn
  // it instead of waiting.
  try {
    config_ = load_model_config(options_.model_dir);
    checkpoint_ = std::make_unique<Checkpoint>(options_.model_dir, config_.fp8_block,
                                               config_.int4_group_size);
    input.expert_bytes = expert_bytes();
  } catch (const Error& e) {
    input.open_error = e.what();
  }
  input.model_dir = options_.model_dir;
  input.layout_file = options_.layout_file;
  input.placement = options_.placement;
  input.replicas = options_.replicas;
  input.routing_stats = options_.routing_stats;
  input.wire_type = options_.wire_type;
  input.transport = options_.transport;
  input.rank_timeout_s = options_.rank_timeout_s;
  input.settings = options_.settings;
  input.deadline = startup_deadline("start-up (handshake)");
  StartupPlan& plan = startup.plan;
  plan = handshake(comm_, checkpoint_ ? &config_ : nullptr, checkpoint_.get(), input);
  layout_ = std::move(plan.layout);
  placement_ = LivePlacement(std::move(plan.placement));
  routing_stats_file_ = std::move(plan.routing_stats_file);
  learned_routes_ = std::move(plan.learned_routes);
  routing_stats_warning_ = std::move(plan.routing_stats_warning);
  model_identity_ = plan.model_identity;
  wire_type_ = plan.wire_type;
  raise_test_fault(options_.fault, TestFault::kLoad, rank_);
}

// This rank's weights: NUMA binding first, the profiler, the weights its role keeps (with
// --split-linears, a row-serving rank's rows of them and its copy of the compressed cache), and
// the store of its routed experts.
void Node::load_weights(Startup& startup) {
  const RankIdentity& me = rank_identity();
  const RankSpec& spec = layout_.ranks[size_t(rank_)];
  // Before any weight is read: the rank's threads and memory on its node.
  if (spec.numa >= 0) bind_to_numa_node(spec.numa);

  profiler_ = std::make_unique<Profiler>(rank_, me.host, role_name(spec.role), config_.num_layers,
                                         options_.keep_trace);
  // --split-linears: the coordinator, then the cpu-expert ranks in rank order.
  SplitOptions& split = startup.split;
  split.max_rows = options_.max_rows;
  split.rank_timeout_s = options_.rank_timeout_s;
  // The engine's KV pool (Engine: KvManager's default blocks), which ranks attending copy.
  split.kv_block_tokens = KvManager::kDefaultBlockTokens;
  startup.kv_tokens = options_.kv_tokens > 0 ? options_.kv_tokens : default_kv_tokens(config_);
  split.kv_blocks = KvManager::pool_blocks(startup.kv_tokens, split.kv_block_tokens);
  if (options_.split_linears) {
    split.ranks.push_back(layout_.coordinator());
    for (int r = 0; r < size_; ++r)
      if (r != layout_.coordinator() && layout_.ranks[size_t(r)].role == Role::kCpuExpert)
        split.ranks.push_back(r);
  }
  startup.split_part =
      int(std::find(split.ranks.begin(), split.ranks.end(), rank_) - split.ranks.begin());
  startup.serves_rows =
      size_ > 1 && startup.split_part > 0 && size_t(startup.split_part) < split.ranks.size();
  LoadOptions load;
  if (is_coordinator()) {
    load.keep_stored = true;  // the engine runs int8/int4, BF16 and FP8 weights as stored
    if (size_ > 1) load.owns_expert = [](int, int) { return false; };
  } else {
    load.dense = false;
    load.split_targets_only = startup.serves_rows;  // its rows of the split linears are cut
    load.keep_stored = true;
    load.mtp = false;
    load.owns_expert = [](int, int) { return false; };  // held by expert_store_
  }
  weights_ = load_model_weights(config_, *checkpoint_, load);
  // A rank that serves rows keeps its own and frees the rest before its experts load; its copy of
  // the compressed cache (at most every layer's) must fit first.
  const int kv_tokens = startup.kv_tokens;
  if (startup.serves_rows)
    startup.split_error = memory_refusal(
        KvManager::pool_bytes(config_, kv_tokens, split.kv_block_tokens, false),
        fmt::format("its copy of the KV cache of {} tokens (--kv-tokens)", kv_tokens),
        available_memory_bytes(), me.name_of(rank_));
  try {
    if (startup.serves_rows && startup.split_error.empty()) {
      linear_server_ = std::make_unique<LinearServer>(comm_, config_, weights_, startup.split_part,
                                                      split, *profiler_);
      weights_ = ModelWeights();
    }
  } catch (const Error& e) {
    startup.split_error = e.what();
  }
  open_expert_store();
  profiler_->counters().weight_bytes_read = checkpoint_->bytes_loaded();
}

void Node::build_engine(Startup& startup) {
  EngineOptions engine;
  engine.max_rows = options_.max_rows;
  engine.kv_tokens = options_.kv_tokens;
  engine.max_seqs = options_.max_seqs;
  engine.prefetch_ahead = options_.prefetch_ahead;
  engine.micro_batches = options_.micro_batches;
  engine.micro_batch_rows = options_.micro_batch_rows;
  engine_ = std::make_unique<Engine>(config_, weights_, placement_, *dispatcher_, engine,
                                     profiler_.get(), startup.coordinator_compute);
  if (options_.micro_batches == 2 && !engine_->splits())
    std::fprintf(stderr,
                 "colibri-node: warning: --micro-batches 2 needs the CPU coordinator and an "
                 "exchange that holds two in flight (MPI without --combine host, in-process "
                 "experts, or both; not NCCL); every call runs whole\n");
  if (options_.repin_every > 0) {
    RepinOptions repin;
    repin.every_tokens = options_.repin_every;
    repin.max_moves = options_.repin_max_moves;
    repin.replicas = options_.replicas;
    repinner_ = std::make_unique<Repinner>(config_, layout_, expert_bytes(), repin, placement_,
                                           *dispatcher_, expert_store_.get(), rank_);
    engine_->set_step_hook([this](int rows) { repinner_->after_step(engine_->routes(), rows); });
    engine_->set_repin_stats(&repinner_->stats());
  }
}

// Every rank has loaded its weights and built its exchange; the coordinator keeps each rank's
// resident-memory line and answers with its liveness address (transport/liveness.h).
void Node::become_ready(const Startup& startup) {
  LivenessOptions liveness;
  liveness.silence_s = options_.rank_timeout_s;
  liveness.period_s = std::clamp(options_.rank_timeout_s / 8, 0.05, 1.0);
  for (int r : startup.plan.nccl_ranks)  // their exchange has no heartbeat of its own
    if (r != layout_.coordinator()) liveness.silence.push_back(r);
  if (size_ > 1 && is_coordinator()) {
    std::vector<int> others;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) others.push_back(r);
    try {
      liveness_hub_ = std::make_unique<LivenessHub>(rank_, others, liveness);
    } catch (const Error& e) {
      std::fprintf(stderr, "colibri-node: warning: %s; a rank's death is noticed by mpirun only\n",
                   e.what());
    }
  }
  const std::string liveness_address = agree_within(
      comm_, layout_.coordinator(), memory_line(rank_identity().host),
      [this](const std::vector<std::string>& lines) {
        memory_report_ = lines;
        return liveness_hub_ ? liveness_hub_->address() : std::string();
      },
      startup_deadline("start-up (exchange ready)"));
  if (size_ > 1 && !is_coordinator() && !liveness_address.empty())
    liveness_link_ =
        std::make_unique<LivenessLink>(rank_, layout_.coordinator(), liveness_address, liveness);
}

void Node::on_placement_change(const PlacementChange& change) {
  if (!change.commit) {
    raise_test_fault(options_.fault, TestFault::kMove, rank_);
    if (expert_store_)
      expert_store_->add_owned(experts_gained(placement_.current(), change.changes, rank_));
    return;
  }
  const std::vector<std::pair<int, int>> lost =
      experts_lost(placement_.current(), change.changes, rank_);
  placement_.replace(placement_.next(change));
  if (expert_store_) expert_store_->remove_owned(lost);
}

std::string Node::memory_line(const std::string& host) const {
  const WeightBytes w = weight_bytes(weights_);
  const auto gb = [](uint64_t bytes) { return double(bytes) / 1e9; };
  std::string line = fmt::format(
      "rank {}@{} ({}): weights {:.3f} GB (fp32 {:.3f}, bf16 {:.3f}, fp8 {:.3f}, "
      "int8/int4 {:.3f}, nvfp4 {:.3f})",
      rank_, host, role_name(layout_.ranks[size_t(rank_)].role), gb(w.total()), gb(w.f32),
      gb(w.bf16), gb(w.fp8), gb(w.quantized), gb(w.nvfp4));
  if (expert_store_)
    line += fmt::format(", routed experts {:.3f} GB resident ({:.3f} pinned)",
                        gb(expert_store_->resident_bytes() + expert_store_->pinned_bytes()),
                        gb(expert_store_->pinned_bytes()));
  if (splitter_)
    line += fmt::format(", {} linears split by rows, {} layers' attention by heads",
                        splitter_->split_count(), splitter_->split_heads_count());
  if (linear_server_)
    line += fmt::format(", rows of split linears {:.3f} GB, KV copy {:.3f} GB reserved",
                        gb(linear_server_->bytes()), gb(linear_server_->kv_copy_bytes()));
  if (engine_) line += fmt::format(", KV pool {:.3f} GB reserved", gb(engine_->kv_bytes()));
  // The process as the kernel sees it (VmRSS: what is in RAM now, mappings included).
  std::ifstream status("/proc/self/status");
  for (std::string entry; std::getline(status, entry);)
    if (entry.rfind("VmRSS:", 0) == 0) {
      line += fmt::format("; RSS {:.3f} GB", double(std::stoull(entry.substr(6))) * 1024 / 1e9);
      break;
    }
  if (const long long huge = huge_page_bytes(); huge >= 0)
    line += fmt::format(", {:.3f} GB on huge pages", gb(uint64_t(huge)));
  const int numa = layout_.ranks[size_t(rank_)].numa;
  const std::string by_node = resident_by_numa_node();
  if (!by_node.empty())
    line += fmt::format(" ({}; {})", by_node,
                        numa >= 0 ? fmt::format("bound to node {}", numa) : "not bound");
  return line;
}

Deadline Node::startup_deadline(std::string stage) const {
  return {options_.startup_timeout_s, "--startup-timeout", std::move(stage)};
}

Node::~Node() {
  if (is_coordinator() && size_ > 1 && !shut_down_) shutdown();
}

void Node::open_expert_store() {
  // Alone, the coordinator keeps the routed experts in weights_; in a multi-rank run it owns those
  // the placement gives it (a ram_gb budget in its layout row) in a store, as an expert rank does.
  const bool has_store = size_ > 1 && (!is_coordinator() || layout_.coordinator_owns_experts());
  std::vector<std::pair<int, int>> owned;
  for (int l = 0; has_store && l < config_.num_layers; ++l)
    for (int e = 0; e < config_.n_routed_experts; ++e)
      if (config_.layer_is_moe[size_t(l)] && placement_.current().holds(l, e, rank_))
        owned.emplace_back(l, e);
  const double layout_ram_gb = layout_.ranks[size_t(rank_)].ram_gb;
  ExpertStore::Options store_options;
  store_options.ram_bytes =
      gib_to_bytes(layout_ram_gb > 0 ? layout_ram_gb : options_.ram_gb, "RAM budget");
  store_options.pin_bytes =
      store_options.ram_bytes > 0 ? gib_to_bytes(options_.pin_gb, "--pin-gb") : 0;
  // History pinning: under heat, without --pin-gb, half the RAM budget holds the rank's hottest
  // experts (owned is ordered hottest first below); the LRU keeps the rest.
  if (!placement_.current().heat.empty() && options_.pin_gb == 0)
    store_options.pin_bytes = store_options.ram_bytes / 2;

  // With --placement sliced, the rank's slice of each expert.
  const ExpertSlice slice = placement_.current().slice_of(rank_);
  const uint64_t held_bytes =
      uint64_t(std::ceil(double(expert_bytes()) * placement_.current().held_fraction(rank_)));
  std::string refusal;
  if (has_store && store_options.ram_bytes > 0 && !owned.empty())
    refusal = memory_refusal(expert_memory_plan(owned, config_.num_layers, held_bytes,
                                                store_options.ram_bytes, store_options.pin_bytes),
                             available_memory_bytes(), rank_identity().name_of(rank_));
  // Collective, so that every rank refuses together and rank 0 can print the reason.
  StartupStatus status;
  status.stop = status.is_error = !refusal.empty();
  status.exit_code = 1;
  status.message = refusal;
  const StartupVerdict verdict =
      agree_to_start(comm_, status, startup_deadline("start-up (weights loaded, memory checked)"));
  if (verdict.reporter >= 0) throw StartupRefused(verdict.status.message);
  if (!has_store) return;
  // A budget that holds every owned expert loads them all at start, as no budget does.
  if (store_options.ram_bytes >= uint64_t(owned.size()) * held_bytes)
    store_options.ram_bytes = store_options.pin_bytes = 0;
  // Under heat the hottest first: --pin-gb pins them, and a VRAM tier takes them first.
  if (!placement_.current().heat.empty())
    std::stable_sort(owned.begin(), owned.end(), [this](const auto& a, const auto& b) {
      return placement_.current().heat_of(a.first, a.second) >
             placement_.current().heat_of(b.first, b.second);
    });
  owned_ = owned;

  expert_store_ = std::make_unique<ExpertStore>(
      std::move(owned),
      [this, slice](int layer, int expert) {
        return load_routed_expert(config_, *checkpoint_, layer, expert, slice);
      },
      store_options);
}

uint64_t Node::expert_bytes() const {
  const uint64_t fp32 = 3ull * uint64_t(config_.moe_intermediate_size) *
                        uint64_t(config_.hidden_size) * sizeof(float);
  // Routed experts stay as stored (load_routed_expert): a container's packed bytes and scales
  // (compressed-tensors INT4: its packed bytes, scales widened to fp32, zero points as fp32
  // offsets), BF16, FP8 with its scales, NVFP4 with its block scales and global scale; other
  // dtypes become fp32.
  int layer = 0;
  while (layer < config_.num_layers && !config_.layer_is_moe[size_t(layer)]) ++layer;
  if (!checkpoint_ || layer == config_.num_layers) return fp32;
  const bool fp8_kept = fp8_kept_as_stored(config_);
  uint64_t bytes = 0;
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
    const std::string name = fmt::format("model.layers.{}.mlp.experts.0.{}.weight", layer, proj);
    if (checkpoint_->is_packed_int4(name)) {  // compressed-tensors INT4: as the container holds it
      const bool down = std::string_view(proj) == "down_proj";
      const int64_t h = config_.hidden_size, inter = config_.moe_intermediate_size;
      bytes += checkpoint_->quant_bytes(name, down ? h : inter, down ? inter : h);
      continue;
    }
    if (const Checkpoint::Nvfp4Tensors* nvfp4 = checkpoint_->nvfp4_tensors(name)) {
      bytes += nvfp4->held_bytes();  // NVFP4: codes, block scales and the global, as stored
      continue;
    }
    const TensorView* w = checkpoint_->find(name);
    if (!w) return fp32;
    const TensorView* qs = checkpoint_->find(name + kQuantScaleSuffix);
    const TensorView* fp8_scales = checkpoint_->find(name + "_scale_inv");
    if (w->dtype == Dtype::U8 && qs) {
      bytes += w->nbytes + qs->nbytes;
    } else if (w->dtype == Dtype::BF16) {
      bytes += w->nbytes;
    } else if (w->dtype == Dtype::F8_E4M3 && fp8_kept && fp8_scales) {
      bytes += w->nbytes + uint64_t(fp8_scales->numel()) * sizeof(float);
    } else {
      bytes += uint64_t(w->numel()) * sizeof(float);
    }
  }
  return bytes;
}

uint64_t Node::resident_expert_bytes() const {
  return expert_store_ ? expert_store_->resident_bytes() + expert_store_->pinned_bytes() : 0;
}

Engine& Node::engine() {
  if (!engine_) fail("rank {} is not the coordinator", rank_);
  return *engine_;
}

void Node::shutdown() {
  if (liveness_hub_) liveness_hub_->end();  // before the ranks are told to end
  if (dispatcher_ && !shut_down_) dispatcher_->shutdown();
  if (!shut_down_ && is_coordinator())
    if (const std::string error = save_routing_stats(); !error.empty())
      std::fprintf(stderr, "colibri-node: warning: %s\n", error.c_str());
  shut_down_ = true;
}

std::string Node::save_routing_stats() {
  if (routing_stats_file_.empty() || !engine_ || engine_->routes().empty()) return {};
  try {
    RoutingStats merged = learned_routes_;
    merged.merge(engine_->routes());
    const std::filesystem::path path = routing_stats_file_;
    if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
    write_routing_stats(path, merged, model_identity_);
    return {};
  } catch (const std::exception& e) {
    return fmt::format("routing statistics not saved: {}", e.what());
  }
}

void Node::serve() {
  serve_experts(*channel_, *expert_backend_, *profiler_, config_.hidden_size, options_.fault,
                fault_requests_);
}

LiveCounters Node::own_counters() const {
  LiveCounters c = colibri::live_counters(profiler_->counters());
  c.wall_us = profiler_->now_us();
  if (expert_store_) c.store = expert_store_->stats();
  if (expert_backend_) c.device = expert_backend_->device_stats();
  return c;
}

std::vector<LiveCounters> Node::live_counters() {
  std::vector<LiveCounters> all =
      dispatcher_ ? dispatcher_->live_counters() : std::vector<LiveCounters>{};
  if (is_coordinator() && expert_store_) {
    all.push_back(own_counters());
    std::sort(all.begin(), all.end(),
              [](const LiveCounters& a, const LiveCounters& b) { return a.rank < b.rank; });
  }
  return all;
}

std::vector<RankReport> Node::gather_reports() {
  RankReport mine = profiler_->report();
  if (expert_store_) mine.store = expert_store_->stats();
  if (expert_backend_) mine.device = expert_backend_->device_stats();
  const std::vector<std::string> all =
      gather_within(comm_, layout_.coordinator(), to_bytes(mine),
                    {options_.rank_timeout_s, "--rank-timeout", "the end-of-run reports"});
  std::vector<RankReport> reports;
  for (const auto& bytes : all) reports.push_back(from_bytes<RankReport>(bytes));
  if (dispatcher_ && is_coordinator()) {
    const std::vector<uint64_t> slowest = dispatcher_->slowest_counts();
    for (RankReport& report : reports)
      if (size_t(report.rank) < slowest.size()) report.slowest_count = slowest[size_t(report.rank)];
  }
  return reports;
}

}  // namespace colibri
