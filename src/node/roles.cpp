// Each role's side of the exchange, built once the weights are loaded: a single process, the
// coordinator of a job, an expert rank (CPU or GPU), and the split linears' parts; a failure is
// kept as the start-up's refusal, which every rank learns of together (node.cpp).
#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"
#include "node/devices.h"
#include "node/memory_plan.h"
#include "node/node.h"
#include "node/node_startup.h"
#include "transport/exchange.h"
#include "transport/local_dispatcher.h"
#include "transport/mpi_check.h"

namespace colibri {

VramCostModel Node::vram_cost() const {
  VramCostModel cost;
  cost.pcie_bytes_per_us = options_.pcie_gbps * 1e3;  // GB/s = 1e3 bytes per us
  cost.cpu_bytes_per_us = options_.cpu_expert_gbps * 1e3;
  return cost;
}

ExchangeContext Node::exchange_context(const StartupPlan& plan) {
  ExchangeContext exchange;
  exchange.comm = comm_;
  exchange.placement = &placement_;
  exchange.shape = {options_.max_rows, config_.hidden_size, config_.num_experts_per_tok,
                    config_.n_routed_experts};
  exchange.coordinator = layout_.coordinator();
  exchange.profiler = profiler_.get();
  exchange.options.rank_timeout_s = options_.rank_timeout_s;
  exchange.options.setup_timeout_s = options_.startup_timeout_s;
  exchange.mpi.shared_memory = options_.shared_memory;
  exchange.mpi.heartbeat_s = plan.heartbeat_s;
  exchange.options.wire_type = wire_type_;
  exchange.mpi.host_combine = options_.host_combine;
  for (const std::string& name : plan.hosts) {  // the host index of each rank
    const auto first = std::find(plan.hosts.begin(), plan.hosts.end(), name);
    exchange.mpi.host_of.push_back(int(first - plan.hosts.begin()));
  }
  exchange.options.corrupt_reply_at_layer = options_.fault.corrupt_reply_at_layer;
  exchange.nccl_ranks = plan.nccl_ranks;
  exchange.startup = startup_deadline("start-up (NCCL communicator)");
  return exchange;
}

// A single process: its routed experts on its CPU, or on its GPU with --experts gpu.
void Node::build_alone(Startup& startup) {
  if (options_.gpu_experts) {
    try {
      expert_backend_ =
          make_gpu_expert_backend(config_, weights_, choose_gpu(0, "this process"),
                                  gib_to_bytes(options_.vram_gb, "--vram-gb"), vram_cost());
    } catch (const Error& e) {
      startup.refuse(fmt::format("--experts gpu: {}", e.what()));
    }
  } else {
    expert_backend_ = std::make_unique<CpuExpertBackend>(config_, weights_);
  }
  if (expert_backend_)
    dispatcher_ =
        std::make_unique<LocalDispatcher>(*expert_backend_, config_.hidden_size, profiler_.get());
}

// The coordinator of a job: the exchange to the expert ranks (with NCCL, the communicator, made
// by every rank; a failure refused collectively), and its own share of the routed experts when its
// layout row gives it a RAM budget.
void Node::build_coordinator(Startup& startup, ExchangeContext& exchange) {
  const RankIdentity& me = rank_identity();
  try {
    if (!exchange.nccl_ranks.empty())
      exchange.device = choose_gpu(layout_.ranks[size_t(rank_)].gpu, me.name_of(rank_));
    std::unique_ptr<PartialDispatcher> own_experts;
    if (expert_store_) {
      expert_backend_ = std::make_unique<CpuExpertBackend>(config_, *expert_store_);
      own_experts =
          std::make_unique<LocalDispatcher>(*expert_backend_, config_.hidden_size, profiler_.get());
    }
    dispatcher_ = make_dispatcher(exchange, std::move(own_experts));
  } catch (const Error& e) {
    startup.refuse(fmt::format("{}: {}", me.name_of(rank_), e.what()));
  }
}

// An expert rank: a gpu-expert uploads its experts to its GPU (no such device, or too little VRAM,
// is refused collectively, so that every rank stops and rank 0 can say why); then its channel to
// the coordinator, with the handlers for a change of placement and for hints.
void Node::build_expert_rank(Startup& startup, ExchangeContext& exchange) {
  const RankIdentity& me = rank_identity();
  const RankSpec& spec = layout_.ranks[size_t(rank_)];
  if (spec.role == Role::kGpuExpert) {
    try {
      const int device = choose_gpu(spec.gpu, me.name_of(rank_));
      exchange.device = device;
      expert_backend_ = make_gpu_expert_backend(
          config_, *expert_store_, owned_, device,
          gib_to_bytes(spec.vram_gb > 0 ? spec.vram_gb : options_.vram_gb, "VRAM budget"),
          vram_cost());
    } catch (const Error& e) {
      startup.refuse(fmt::format("{}: {}", me.name_of(rank_), e.what()));
    }
  } else {
    expert_backend_ = std::make_unique<CpuExpertBackend>(config_, *expert_store_);
  }
  try {
    channel_ = make_expert_channel(exchange);
    channel_->set_placement_handler(
        [this](const PlacementChange& change) { on_placement_change(change); });
    channel_->set_hint_handler(
        [this](int layer, std::span<const int> experts) { expert_backend_->hint(layer, experts); });
    channel_->set_counters_handler([this] { return own_counters(); });
  } catch (const Error& e) {
    startup.refuse(fmt::format("{}: {}", me.name_of(rank_), e.what()));
  }
}

// --split-linears: the coordinator's splitter, a row-serving rank's server (served between
// expert requests), or the refusal that says why not.
void Node::build_split_linears(Startup& startup) {
  if (!options_.split_linears) return;
  const RankSpec& spec = layout_.ranks[size_t(rank_)];
  try {
    if (size_ == 1)
      fail("--split-linears splits the coordinator's linears across ranks: run it under mpirun");
    if (startup.split.ranks.size() < 2) fail("--split-linears: the layout has no cpu-expert rank");
    if (is_coordinator() && (spec.gpu >= 0 || options_.coordinator_gpu))
      fail("--split-linears: the coordinator's forward runs on its GPU, not on the CPU");
    if (!startup.split_error.empty()) fail("--split-linears: {}", startup.split_error);
    if (is_coordinator()) {
      splitter_ =
          std::make_unique<LinearSplitter>(comm_, config_, weights_, startup.split, *profiler_);
    } else if (linear_server_) {
      linear_server_->set_request_hook(
          [this](int layer) { raise_test_fault(options_.fault, layer, fault_requests_, rank_); });
      linear_server_->set_corrupt_attention_at(options_.fault.corrupt_reply_at_layer);
      if (channel_)
        channel_->set_idle_work(
            {[this] { return linear_server_->ready(); }, [this] { linear_server_->serve(); }});
    }
  } catch (const Error& e) {
    startup.refuse(fmt::format("{}: {}", rank_identity().name_of(rank_), e.what()));
  }
}

// The coordinator's forward on a GPU (its layout row names one, or --coordinator-gpu), what
// --repin-every needs, and its KV pool in RAM against the memory available.
void Node::check_coordinator(Startup& startup) {
  const RankSpec& spec = layout_.ranks[size_t(rank_)];
  if (options_.coordinator_gpu && size_ > 1)
    startup.refuse(
        "--coordinator-gpu is for a single process; under mpirun, give the coordinator's layout "
        "row a gpu");
  else if (is_coordinator() && (spec.gpu >= 0 || options_.coordinator_gpu)) {
    try {
      startup.coordinator_compute =
          make_gpu_coordinator(choose_gpu(std::max(spec.gpu, 0), rank_identity().name_of(rank_)));
    } catch (const Error& e) {
      startup.refuse(fmt::format("the coordinator on a GPU: {}", e.what()));
    }
  }
  if (is_coordinator() && options_.repin_every > 0) {
    const auto roles = [&](Role role) {
      return std::any_of(layout_.ranks.begin(), layout_.ranks.end(),
                         [role](const RankSpec& r) { return r.role == role; });
    };
    if (size_ == 1)
      startup.refuse("--repin-every moves experts between ranks: run it under mpirun");
    else if (placement_.current().heat.empty())
      startup.refuse("--repin-every re-places experts by their heat: it needs --placement heat");
    else if (roles(Role::kGpuExpert) || !startup.plan.nccl_ranks.empty())
      startup.refuse(
          "--repin-every moves experts between CPU ranks over MPI; the layout has gpu-expert "
          "ranks");
  }
  // The coordinator's KV pool in RAM is allocated with the engine, below.
  const int kv_tokens = startup.kv_tokens;
  if (is_coordinator() && !startup.coordinator_compute && startup.status.message.empty())
    if (const std::string r =
            memory_refusal(KvManager::pool_bytes(config_, kv_tokens),
                           fmt::format("the KV pool of {} tokens (--kv-tokens)", kv_tokens),
                           available_memory_bytes(), rank_identity().name_of(rank_));
        !r.empty())
      startup.refuse(r);
}

}  // namespace colibri
