#include "node/node.h"

#include <fmt/format.h>

#include <cereal/archives/binary.hpp>
#include <csignal>
#include <fstream>
#include <sstream>

#include "common/error.h"
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
    for (int r = 0; r < size; ++r) out.push_back(all.substr(size_t(offsets[size_t(r)]), size_t(lengths[size_t(r)])));
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
    hash = fnv1a(hash, fmt::format("{}|{}|{};", name, dtype_name(view->dtype), fmt::join(view->shape, ",")));
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
  profiler_ = std::make_unique<Profiler>(rank_, me.host, role_name(layout_.ranks[size_t(rank_)].role),
                                         config_.num_layers, options_.keep_trace);
  LoadOptions load;
  if (is_coordinator()) {
    if (size_ > 1) load.owns_expert = [](int, int) { return false; };
  } else {
    load.dense = false;
    load.mtp = false;
    load.owns_expert = [this](int layer, int expert) { return placement_.owner_of(layer, expert) == rank_; };
  }
  weights_ = load_model_weights(config_, *checkpoint_, load);
  profiler_->counters().weight_bytes_read = checkpoint_->bytes_loaded();

  if (size_ > 1) {
    const ExchangeShape shape{options_.max_rows, config_.hidden_size, config_.num_experts_per_tok,
                              config_.n_routed_experts};
    MpiTransportOptions transport_options;
    transport_options.rank_timeout_s = options_.rank_timeout_s;
    transport_options.corrupt_reply_at_layer = options_.corrupt_reply_at_layer;
    transport_ = std::make_unique<MpiTransport>(comm_, placement_, shape, coordinator, *profiler_, transport_options);
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

uint64_t Node::expert_bytes() const {
  return 3ull * uint64_t(config_.moe_intermediate_size) * uint64_t(config_.hidden_size) * sizeof(float);
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
        plan.error = fmt::format("rank {}@{} speaks protocol version {}, rank {}@{} speaks {}", h.rank, h.host,
                                 h.protocol_version, rank_, all[0].host, wire::kProtocolVersion);
      if (h.model_hash != hello.model_hash && plan.error.empty())
        plan.error = fmt::format(
            "rank {}@{} loaded a different model than rank {}@{} (config or tensor index differ: {:016x} vs {:016x}) "
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
  plan = from_bytes<StartupPlan>(broadcast_bytes(comm_, root, rank_ == root ? to_bytes(plan) : std::string()));
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
  const int hidden = config_.hidden_size;
  while (transport_->receive(request)) {
    if (request.layer == options_.signal_at_layer) std::raise(options_.signal);
    {
      auto scope = profiler_->scope(Phase::kCompute, request.layer);
      partial.resize(size_t(request.n_rows) * hidden);
      run_expert_pairs(weights_.layers[size_t(request.layer)], hidden, request.rows, request.n_rows,
                       std::span<const RoutedPair>(request.pairs, size_t(request.n_pairs)), partial.data());
    }
    transport_->reply(partial.data());
  }
}

std::vector<RankReport> Node::gather_reports() {
  RankReport mine = profiler_->report();
  const std::vector<std::string> all = gather_bytes(comm_, layout_.coordinator(), to_bytes(mine));
  std::vector<RankReport> reports;
  for (const auto& bytes : all) reports.push_back(from_bytes<RankReport>(bytes));
  if (transport_ && is_coordinator())
    for (RankReport& report : reports) report.slowest_count = transport_->slowest_counts()[size_t(report.rank)];
  return reports;
}

}  // namespace colibri
