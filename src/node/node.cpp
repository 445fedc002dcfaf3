#include "node/node.h"

#include <fmt/format.h>

#include <algorithm>
#include <cereal/archives/binary.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "model/container.h"
#include "node/devices.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

template <typename T>
std::string to_bytes(const T& value) {
  std::ostringstream out;
  {
    cereal::BinaryOutputArchive archive(out);
    archive(value);
  }
  return out.str();
}

template <typename T>
T from_bytes(const std::string& bytes) {
  std::istringstream in(bytes);
  cereal::BinaryInputArchive archive(in);
  T value;
  archive(value);
  return value;
}

// Rank `root` broadcasts a byte string to every rank.
std::string broadcast_bytes(MPI_Comm comm, int root, std::string bytes) {
  uint64_t size = bytes.size();
  CHECK_MPI(MPI_Bcast(&size, 1, MPI_UINT64_T, root, comm));
  bytes.resize(size);
  CHECK_MPI(MPI_Bcast(bytes.data(), int(size), MPI_BYTE, root, comm));
  return bytes;
}

// Every rank's byte string, on `root` (empty elsewhere).
std::vector<std::string> gather_bytes(MPI_Comm comm, int root, const std::string& bytes) {
  int rank = 0, size = 0;
  CHECK_MPI(MPI_Comm_rank(comm, &rank));
  CHECK_MPI(MPI_Comm_size(comm, &size));
  int length = int(bytes.size());
  std::vector<int> lengths(size), offsets(size);
  CHECK_MPI(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, root, comm));
  std::string all;
  if (rank == root) {
    int total = 0;
    for (int r = 0; r < size; ++r) {
      offsets[size_t(r)] = total;
      total += lengths[size_t(r)];
    }
    all.resize(size_t(total));
  }
  CHECK_MPI(MPI_Gatherv(bytes.data(), length, MPI_BYTE, all.data(), lengths.data(), offsets.data(),
                        MPI_BYTE, root, comm));
  std::vector<std::string> out;
  if (rank == root)
    for (int r = 0; r < size; ++r)
      out.push_back(all.substr(size_t(offsets[size_t(r)]), size_t(lengths[size_t(r)])));
  return out;
}

struct StartupPlan {
  std::string error;  // non-empty: every rank refuses to start
  std::vector<std::string> hosts;
  Layout layout;
  PlacementTable placement;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(error, hosts, layout, placement);
  }
};

uint64_t fnv1a(uint64_t hash, std::string_view bytes) {
  for (char c : bytes) hash = (hash ^ uint8_t(c)) * 1099511628211ull;
  return hash;
}

// Routes rows to the expert owners through the transport.
class RemoteExperts final : public ExpertExecutor {
 public:
  explicit RemoteExperts(Transport& transport) : transport_(transport) {}
  void begin(int layer, const float* x, int n, const Routing& routing) override {
    transport_.dispatch(layer, x, n, routing);
  }
  void finish(float* out) override { transport_.combine(out); }

 private:
  Transport& transport_;
};

}  // namespace

uint64_t model_hash(const std::filesystem::path& model_dir, const Checkpoint& checkpoint) {
  std::ifstream in(model_dir / "config.json", std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  uint64_t hash = fnv1a(14695981039346656037ull, text.str());
  for (const std::string& name : checkpoint.names()) {
    const TensorView* view = checkpoint.find(name);
    hash = fnv1a(
        hash, fmt::format("{}|{}|{};", name, dtype_name(view->dtype), fmt::join(view->shape, ",")));
  }
  return hash;
}

Node::Node(MPI_Comm comm, const NodeOptions& options) : comm_(comm), options_(options) {
  CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  CHECK_MPI(MPI_Comm_size(comm_, &size_));
  char host[MPI_MAX_PROCESSOR_NAME];
  int host_length = 0;
  CHECK_MPI(MPI_Get_processor_name(host, &host_length));
  RankIdentity& me = rank_identity();
  me.rank = rank_;
  me.size = size_;
  me.host = std::string(host, size_t(host_length));

  config_ = load_model_config(options_.model_dir);
  checkpoint_ = std::make_unique<Checkpoint>(options_.model_dir, config_.fp8_block);
  handshake(options_.model_dir);

  const int coordinator = layout_.coordinator();
  profiler_ =
      std::make_unique<Profiler>(rank_, me.host, role_name(layout_.ranks[size_t(rank_)].role),
                                 config_.num_layers, options_.keep_trace);
  LoadOptions load;
  if (is_coordinator()) {
    if (size_ > 1) load.owns_expert = [](int, int) { return false; };
  } else {
    load.dense = false;
    load.mtp = false;
    load.owns_expert = [](int, int) { return false; };  // held by expert_store_
  }
  weights_ = load_model_weights(config_, *checkpoint_, load);
  open_expert_store();
  profiler_->counters().weight_bytes_read = checkpoint_->bytes_loaded();

  if (size_ > 1) {
    const ExchangeShape shape{options_.max_rows, config_.hidden_size, config_.num_experts_per_tok,
                              config_.n_routed_experts};
    MpiTransportOptions transport_options;
    transport_options.rank_timeout_s = options_.rank_timeout_s;
    transport_options.corrupt_reply_at_layer = options_.corrupt_reply_at_layer;
    transport_ = std::make_unique<MpiTransport>(comm_, placement_, shape, coordinator, *profiler_,
                                                transport_options);
  }
  if (is_coordinator()) {
    if (transport_) remote_experts_ = std::make_unique<RemoteExperts>(*transport_);
    model_ = std::make_unique<ReferenceModel>(config_, weights_, remote_experts_.get());
    model_->set_profiler(profiler_.get());
  }
  CHECK_MPI(MPI_Barrier(comm_));
  profiler_->restart_epoch();
}

Node::~Node() {
  if (is_coordinator() && transport_ && !shut_down_) shutdown();
}

namespace {

// MemAvailable of /proc/meminfo in bytes; 0 when unknown.
uint64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

uint64_t gib_to_bytes(double gib) {
  return uint64_t(gib * double(1ull << 30));
}

}  // namespace

void Node::open_expert_store() {
  // The coordinator of a multi-rank run owns no routed expert; alone it keeps them in weights_.
  const bool has_store = !is_coordinator() && size_ > 1;
  std::vector<std::pair<int, int>> owned;
  for (int l = 0; has_store && l < config_.num_layers; ++l)
    for (int e = 0; e < config_.n_routed_experts; ++e)
      if (config_.layer_is_moe[size_t(l)] && placement_.owner_of(l, e) == rank_)
        owned.emplace_back(l, e);
  const double layout_ram_gb = layout_.ranks[size_t(rank_)].ram_gb;
  ExpertStore::Options store_options;
  store_options.ram_bytes = gib_to_bytes(layout_ram_gb > 0 ? layout_ram_gb : options_.ram_gb);
  store_options.pin_bytes = store_options.ram_bytes > 0 ? gib_to_bytes(options_.pin_gb) : 0;

  // Projected peak: pinned + RAM cache + one layer's owned experts in flight.
  std::string refusal;
  if (has_store && store_options.ram_bytes > 0 && !owned.empty()) {
    std::vector<uint64_t> per_layer(size_t(config_.num_layers), 0);
    for (const auto& [l, e] : owned) ++per_layer[size_t(l)];
    const uint64_t in_flight =
        *std::max_element(per_layer.begin(), per_layer.end()) * expert_bytes();
    const uint64_t peak = store_options.pin_bytes + store_options.ram_bytes + in_flight;
    const uint64_t available = available_memory_bytes();
    const double gib = double(1ull << 30);
    if (available > 0 && peak > available)
      refusal = fmt::format(
          "rank {}@{}: expert memory plan needs {:.2f} GiB (pinned {:.2f} + RAM cache {:.2f} + one "
          "layer in flight {:.2f}) but MemAvailable is {:.2f} GiB",
          rank_, rank_identity().host, double(peak) / gib, double(store_options.pin_bytes) / gib,
          double(store_options.ram_bytes) / gib, double(in_flight) / gib, double(available) / gib);
  }
  // Collective, so that every rank refuses together and rank 0 can print the reason.
  int refused_rank = refusal.empty() ? -1 : rank_;
  CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &refused_rank, 1, MPI_INT, MPI_MAX, comm_));
  if (refused_rank >= 0) throw StartupRefused(broadcast_bytes(comm_, refused_rank, refusal));
  if (!has_store) return;

  expert_store_ = std::make_unique<ExpertStore>(
      std::move(owned),
      [this](int layer, int expert) {
        return load_routed_expert(config_, *checkpoint_, layer, expert);
      },
      store_options);
}

uint64_t Node::expert_bytes() const {
  const uint64_t fp32 = 3ull * uint64_t(config_.moe_intermediate_size) *
                        uint64_t(config_.hidden_size) * sizeof(float);
  // A container's routed experts stay quantized in memory: count their packed bytes and scales.
  int layer = 0;
  while (layer < config_.num_layers && !config_.layer_is_moe[size_t(layer)]) ++layer;
  if (!checkpoint_ || layer == config_.num_layers) return fp32;
  uint64_t bytes = 0;
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
    const std::string name = fmt::format("model.layers.{}.mlp.experts.0.{}.weight", layer, proj);
    const TensorView* w = checkpoint_->find(name);
    const TensorView* qs = checkpoint_->find(name + kQuantScaleSuffix);
    if (!w || w->dtype != Dtype::U8 || !qs) return fp32;
    bytes += w->nbytes + qs->nbytes;
  }
  return bytes;
}

void Node::handshake(const std::filesystem::path& model_dir) {
  // Node-local rank and host index, for the default layout's GPU assignment.
  MPI_Comm local;
  CHECK_MPI(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local));
  Hello hello;
  hello.protocol_version = wire::kProtocolVersion;
  hello.rank = rank_;
  hello.host = rank_identity().host;
  hello.model_hash = model_hash(model_dir, *checkpoint_);
  hello.gpus_on_host = local_gpu_count();  // GPU expert ranks run the CPU backend for now
  CHECK_MPI(MPI_Comm_rank(local, &hello.local_rank));
  CHECK_MPI(MPI_Comm_free(&local));

  const int root = 0;
  const std::vector<std::string> hellos = gather_bytes(comm_, root, to_bytes(hello));
  StartupPlan plan;
  if (rank_ == root) {
    std::vector<Hello> all;
    for (const auto& bytes : hellos) all.push_back(from_bytes<Hello>(bytes));
    std::vector<int> local_rank, gpus, host_index;
    std::vector<std::string> distinct_hosts;
    for (const Hello& h : all) {
      plan.hosts.push_back(h.host);
      auto it = std::find(distinct_hosts.begin(), distinct_hosts.end(), h.host);
      if (it == distinct_hosts.end()) it = distinct_hosts.insert(distinct_hosts.end(), h.host);
      host_index.push_back(int(it - distinct_hosts.begin()));
      local_rank.push_back(h.local_rank);
      gpus.push_back(h.gpus_on_host);
    }
    for (const Hello& h : all) {
      if (h.protocol_version != wire::kProtocolVersion && plan.error.empty())
        plan.error =
            fmt::format("rank {}@{} speaks protocol version {}, rank {}@{} speaks {}", h.rank,
                        h.host, h.protocol_version, rank_, all[0].host, wire::kProtocolVersion);
      if (h.model_hash != hello.model_hash && plan.error.empty())
        plan.error = fmt::format(
            "rank {}@{} loaded a different model than rank {}@{} (config or tensor index differ: "
            "{:016x} vs {:016x}) "
            "from {}",
            h.rank, h.host, rank_, all[0].host, h.model_hash, hello.model_hash, model_dir.string());
    }
    if (plan.error.empty()) {
      try {
        plan.layout = options_.layout_file ? load_layout(*options_.layout_file, size_)
                                           : default_layout(size_, local_rank, gpus, host_index);
        plan.placement = make_placement(config_, plan.layout, options_.placement, expert_bytes());
      } catch (const Error& e) {
        plan.error = e.what();
      }
    }
  }
  plan = from_bytes<StartupPlan>(
      broadcast_bytes(comm_, root, rank_ == root ? to_bytes(plan) : std::string()));
  rank_identity().hosts = plan.hosts;
  if (!plan.error.empty()) throw StartupRefused(plan.error);
  layout_ = std::move(plan.layout);
  placement_ = std::move(plan.placement);
}

ReferenceModel& Node::model() {
  if (!model_) fail("rank {} is not the coordinator", rank_);
  return *model_;
}

void Node::shutdown() {
  if (transport_ && !shut_down_) transport_->shutdown();
  shut_down_ = true;
}

void Node::serve() {
  ExpertRequest request;
  std::vector<float> partial;
  std::vector<int> requested;
  const int hidden = config_.hidden_size;
  while (transport_->receive(request)) {
    if (request.layer == options_.signal_at_layer) {
      const double now =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      std::fprintf(stderr, "colibri-node test fault: rank %d raises signal %d at %.3f\n", rank_,
                   options_.signal, now);
      std::fflush(stderr);
      std::raise(options_.signal);
    }
    {
      auto scope = profiler_->scope(Phase::kCompute, request.layer);
      partial.resize(size_t(request.n_rows) * hidden);
      const std::span<const RoutedPair> pairs(request.pairs, size_t(request.n_pairs));
      // Every requested expert is queued for the loader, then computed in ascending order: the
      // missing ones are read while the resident ones run.
      requested.clear();
      for (const RoutedPair& pair : pairs) requested.push_back(int(pair.expert));
      std::sort(requested.begin(), requested.end());
      requested.erase(std::unique(requested.begin(), requested.end()), requested.end());
      if (!requested.empty() &&
          (requested.front() < 0 || requested.back() >= config_.n_routed_experts))
        fail("layer {}: routed expert out of range [0, {})", request.layer,
             config_.n_routed_experts);
      expert_store_->prefetch(request.layer, requested);
      run_expert_pairs(
          [&](uint32_t e) -> const MlpWeights& {
            return expert_store_->acquire(request.layer, int(e));
          },
          hidden, request.rows, request.n_rows, pairs, partial.data());
      expert_store_->release();
    }
    transport_->reply(partial.data());
  }
}

std::vector<RankReport> Node::gather_reports() {
  RankReport mine = profiler_->report();
  if (expert_store_) {
    const ExpertStoreStats stats = expert_store_->stats();
    mine.pinned_hits = stats.pinned_hits;
    mine.ram_hits = stats.ram_hits;
    mine.disk_hits = stats.disk_hits;
    mine.disk_bytes_read = stats.bytes_read;
    mine.loader_us = stats.load_us;
    mine.loader_wait_us = stats.wait_us;
  }
  const std::vector<std::string> all = gather_bytes(comm_, layout_.coordinator(), to_bytes(mine));
  std::vector<RankReport> reports;
  for (const auto& bytes : all) reports.push_back(from_bytes<RankReport>(bytes));
  if (transport_ && is_coordinator())
    for (RankReport& report : reports)
      report.slowest_count = transport_->slowest_counts()[size_t(report.rank)];
  return reports;
}

}  // namespace colibri
