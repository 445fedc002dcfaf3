#include "node/handshake.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "common/input_file.h"
#include "common/output_file.h"
#include "common/serialize.h"
#include "node/devices.h"
#include "transport/exchange.h"
#include "transport/mpi_check.h"
#include "transport/protocol.h"

namespace colibri {

uint64_t fnv1a(uint64_t hash, std::string_view bytes) {
  for (char c : bytes) hash = (hash ^ uint8_t(c)) * 1099511628211ull;
  return hash;
}

namespace {

uint64_t fnv1a(uint64_t hash, const std::vector<std::byte>& bytes) {
  return colibri::fnv1a(
      hash, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

// Hashes `bytes` bytes of `file` starting `offset` bytes after `first`'s data.
uint64_t hash_range(uint64_t hash, const SafetensorsFile& file, const TensorView& first,
                    uint64_t offset, size_t bytes, std::vector<std::byte>& buffer) {
  TensorView range = first;
  range.data = first.data + offset;
  range.nbytes = bytes;
  buffer.resize(bytes);
  file.read(range, buffer.data());
  return fnv1a(hash, buffer);
}

// The heartbeat period for expert ranks whose --rank-timeout is `timeout_s` at the least: four
// beats per timeout, at least one a second.
double heartbeat_period(double timeout_s) {
  return std::min(1.0, timeout_s / 4);
}

// The first setting of `scope` on which `h` disagrees with `reference`: the root for job-wide
// settings (every value compared), the coordinator for the settings it alone uses (compared where
// `h` was given them); "" if none.
std::string setting_mismatch(const Hello& h, const Hello& reference, AgreedSetting::Scope scope) {
  const RankIdentity& me = rank_identity();
  auto find = [](const Hello& hello, const AgreedSetting& s) -> const AgreedSetting* {
    for (const AgreedSetting& other : hello.settings)
      if (other.flag == s.flag) return &other;
    return nullptr;
  };
  if (h.rank == reference.rank) return {};
  for (const AgreedSetting& s : h.settings) {
    if (s.scope != scope || (scope == AgreedSetting::kCoordinator && !s.given)) continue;
    const AgreedSetting* r = find(reference, s);
    if (!r || r->value == s.value) continue;
    if (scope == AgreedSetting::kJob)
      return fmt::format(
          "{} and {} disagree on {}: '{}' on {}, '{}' on {}; every rank must be given the same",
          me.name_of(h.rank), me.name_of(reference.rank), s.flag, s.value, me.name_of(h.rank),
          r->value, me.name_of(reference.rank));
    return fmt::format(
        "{} and {} disagree on {}: {} is given '{}' but the coordinator {} runs with '{}'; the "
        "coordinator's value applies to the job: give every rank the same or leave {} out on the "
        "expert ranks",
        me.name_of(h.rank), me.name_of(reference.rank), s.flag, me.name_of(h.rank), s.value,
        me.name_of(reference.rank), r->value, s.flag);
  }
  return {};
}

// What each rank sends at agree_to_start, and what rank 0 answers.
struct Report {
  std::string host;
  StartupStatus status;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(host, status);
  }
};
struct Answer {
  int reporter = -1;
  StartupStatus status;
  std::vector<std::string> hosts;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(reporter, status, hosts);
  }
};

}  // namespace

StartupVerdict agree_to_start(MPI_Comm comm, const StartupStatus& mine, const Deadline& deadline) {
  int rank = 0, size = 0;
  CHECK_MPI(MPI_Comm_rank(comm, &rank));
  CHECK_MPI(MPI_Comm_size(comm, &size));
  const int root = 0;
  const auto decide = [&](const std::vector<std::string>& reports) {
    Answer answer;
    int first_help = -1;
    for (int r = 0; r < size; ++r) {
      const Report report = from_bytes<Report>(reports[size_t(r)]);
      answer.hosts.push_back(report.host);
      if (!report.status.stop) continue;
      if (report.status.is_error && (answer.reporter < 0 || !answer.status.is_error)) {
        answer.reporter = r;
        answer.status = report.status;
      } else if (!report.status.is_error && first_help < 0) {
        first_help = r;
        if (answer.reporter < 0) {
          answer.reporter = r;
          answer.status = report.status;
        }
      }
    }
    return to_bytes(answer);
  };
  Answer answer = from_bytes<Answer>(
      agree_within(comm, root, to_bytes(Report{rank_identity().host, mine}), decide, deadline));
  rank_identity().hosts = answer.hosts;
  return {answer.reporter, std::move(answer.status), std::move(answer.hosts)};
}

uint64_t model_hash(const std::filesystem::path& model_dir, const Checkpoint& checkpoint) {
  std::ifstream in(model_dir / "config.json", std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  uint64_t hash = fnv1a(kFnvOffset, text.str());
  for (const std::string& name : checkpoint.names()) {
    const TensorView* view = checkpoint.find(name);
    hash = fnv1a(
        hash, fmt::format("{}|{}|{};", name, dtype_name(view->dtype), fmt::join(view->shape, ",")));
  }
  return hash;
}

uint64_t weights_fingerprint(const Checkpoint& checkpoint) {
  constexpr size_t kSamples = 16, kSampleBytes = 4096, kTensorBytes = 64;
  uint64_t hash = kFnvOffset;
  std::vector<std::byte> buffer;
  for (const auto& shard : checkpoint.shards()) {
    hash =
        fnv1a(hash, fmt::format("{}|{};", shard->path().filename().string(), shard->file_bytes()));
    // The data section: from the first tensor's bytes to the last one's end.
    const TensorView* first = nullptr;
    const std::byte* end = nullptr;
    for (const auto& [name, view] : shard->tensors()) {
      if (!first || view.data < first->data) first = &view;
      if (!end || view.data + view.nbytes > end) end = view.data + view.nbytes;
    }
    if (!first) continue;
    const uint64_t span = uint64_t(end - first->data);
    if (span <= kSamples * kSampleBytes) {
      hash = hash_range(hash, *shard, *first, 0, span, buffer);
      continue;
    }
    for (size_t i = 0; i < kSamples; ++i)
      hash = hash_range(hash, *shard, *first, (span - kSampleBytes) * i / (kSamples - 1),
                        kSampleBytes, buffer);
  }
  for (const std::string& name : checkpoint.names()) {
    if (name.find(".mlp.experts.") != std::string::npos) continue;  // routed: too many to read
    const TensorView* view = checkpoint.find(name);
    const size_t bytes = std::min(view->nbytes, kTensorBytes);
    hash = hash_range(hash, checkpoint.shard_of(*view), *view, (view->nbytes - bytes) / 2, bytes,
                      buffer);
  }
  return hash;
}

std::filesystem::path routing_stats_path(const std::string& option,
                                         const std::filesystem::path& model_dir,
                                         const ModelIdentity& id) {
  if (option != "auto") return option;
  if (::access(model_dir.c_str(), W_OK) == 0) return model_dir / "colibri-routing.stats";
  const char* state = std::getenv("XDG_STATE_HOME");
  const char* home = std::getenv("HOME");
  const std::filesystem::path dir =
      state && *state ? std::filesystem::path(state)
                      : std::filesystem::path(home && *home ? home : "/tmp") / ".local" / "state";
  return dir / "colibri-node" / fmt::format("routing-{:016x}.stats", id.model_hash);
}

namespace {

// Rank 0 reads the routing statistics into the plan. A file given by name that cannot be read or
// written is refused; the automatic one, damaged or learned on another model, is set aside with a
// warning (this run's routes replace it at shutdown).
void load_routing_stats(StartupPlan& plan, const ModelConfig& config, const HandshakeInput& input) {
  plan.learned_routes.reset(config.num_layers, config.n_routed_experts);
  if (input.routing_stats.empty()) return;
  const bool automatic = input.routing_stats == "auto";
  const std::filesystem::path path =
      routing_stats_path(input.routing_stats, input.model_dir, plan.model_identity);
  plan.routing_stats_file = path.string();
  try {
    if (!automatic) check_output_path(path, "--routing-stats");
    if (path_present(path, "the routing statistics"))
      plan.learned_routes =
          read_routing_stats(path, config.num_layers, config.n_routed_experts, plan.model_identity);
  } catch (const Error& e) {
    if (!automatic) throw;
    plan.routing_stats_warning = fmt::format("{}; not used, replaced at shutdown", e.what());
    plan.learned_routes.reset(config.num_layers, config.n_routed_experts);
  }
}

// This rank's HELLO: its protocol, host, model and what it may agree to.
Hello my_hello(const Checkpoint* checkpoint, const HandshakeInput& input, int rank) {
  Hello hello;
  hello.protocol_version = wire::kProtocolVersion;
  hello.rank = rank;
  hello.host = rank_identity().host;
  hello.error = input.open_error;
  hello.model_dir = input.model_dir.string();
  if (hello.error.empty()) {
    try {
      hello.model_hash = model_hash(input.model_dir, *checkpoint);
      hello.weights_fingerprint = weights_fingerprint(*checkpoint);
    } catch (const Error& e) {
      hello.error = e.what();
    }
  }
  hello.gpus_on_host = local_gpu_count(&hello.gpu_why_none);
  hello.local_rank = input.local_rank;
  CHECK_MPI(MPI_Query_thread(&hello.thread_level));
  hello.rank_timeout_s = input.rank_timeout_s;
  hello.settings = input.settings;
  hello.nccl_built = nccl_built();
  return hello;
}

// Rank 0's decision, in steps below: each sets plan.error at the first refusal, and a step after
// one does nothing.

// Every rank's HELLO, its version first: a HELLO of another version is named, not misread. Then
// the ranks' hosts.
std::vector<Hello> read_hellos(const std::vector<std::string>& hellos, int size, int rank,
                               StartupPlan& plan) {
  const RankIdentity& me = rank_identity();
  std::vector<Hello> all(static_cast<size_t>(size));
  for (int r = 0; r < size && plan.error.empty(); ++r) {
    int version = -1;
    try {
      version = from_bytes<int>(hellos[size_t(r)]);
      if (version == wire::kProtocolVersion) all[size_t(r)] = from_bytes<Hello>(hellos[size_t(r)]);
    } catch (const std::exception&) {
    }
    if (version != wire::kProtocolVersion)
      plan.error = fmt::format(
          "{} speaks protocol version {}, {} speaks {} (every rank must run the same "
          "colibri-node build)",
          me.name_of(r), version, me.name_of(rank), wire::kProtocolVersion);
  }
  // Hosts come from the HELLOs when this is the first exchange (tests start a Node directly).
  if (plan.error.empty()) {
    for (const Hello& h : all) plan.hosts.push_back(h.host);
    rank_identity().hosts = plan.hosts;
  }
  return all;
}

// One job: a rank that could not open its model reports it itself; then every rank's model and
// weight data against this rank's, and the settings every rank must share.
void check_same_job(StartupPlan& plan, const std::vector<Hello>& all, const Hello& mine) {
  const RankIdentity& me = rank_identity();
  const int rank = mine.rank;
  for (const Hello& h : all) {
    if (!plan.error.empty()) break;
    if (!h.error.empty()) {
      plan.error = h.error;
      plan.reporter = h.rank;
      plan.names_reporter = true;
    }
  }
  for (const Hello& h : all) {
    if (!plan.error.empty()) break;
    if (h.model_hash != mine.model_hash)
      plan.error = fmt::format(
          "{} loaded a different model than {} (config or tensor index differ: {:016x} vs "
          "{:016x}): --model {} on {}, --model {} on {}",
          me.name_of(h.rank), me.name_of(rank), h.model_hash, mine.model_hash, h.model_dir,
          me.name_of(h.rank), mine.model_dir, me.name_of(rank));
    else if (h.weights_fingerprint != mine.weights_fingerprint)
      plan.error = fmt::format(
          "{} loaded different weight data than {} (same config and tensor shapes, but the "
          "sampled bytes or sizes of the safetensors files differ: fingerprint {:016x} vs "
          "{:016x}): --model {} on {}, --model {} on {}",
          me.name_of(h.rank), me.name_of(rank), h.weights_fingerprint, mine.weights_fingerprint,
          h.model_dir, me.name_of(h.rank), mine.model_dir, me.name_of(rank));
  }
  for (const Hello& h : all) {
    if (!plan.error.empty()) break;
    plan.error = setting_mismatch(h, mine, AgreedSetting::kJob);
  }
}

// The layout (--layout, or the default one from the ranks' hosts and GPUs), the routing
// statistics and the placement.
void plan_layout(StartupPlan& plan, const std::vector<Hello>& all, const Hello& mine,
                 const ModelConfig* config, const HandshakeInput& input, int size) {
  if (!plan.error.empty()) return;
  std::vector<int> local_rank, gpus, host_index;
  std::vector<std::string> distinct_hosts;
  for (const Hello& h : all) {
    auto it = std::find(distinct_hosts.begin(), distinct_hosts.end(), h.host);
    if (it == distinct_hosts.end()) it = distinct_hosts.insert(distinct_hosts.end(), h.host);
    host_index.push_back(int(it - distinct_hosts.begin()));
    local_rank.push_back(h.local_rank);
    gpus.push_back(h.gpus_on_host);
  }
  try {
    plan.layout = input.layout_file ? load_layout(*input.layout_file, size)
                                    : default_layout(size, local_rank, gpus, host_index);
    // A host the layout leaves unset is where the rank runs (its MPI processor name).
    for (RankSpec& spec : plan.layout.ranks)
      if (spec.host.empty()) spec.host = all[size_t(spec.rank)].host;
    check_one_rank_per_gpu(plan.layout);
    plan.model_identity = {mine.model_hash, mine.weights_fingerprint};
    load_routing_stats(plan, *config, input);
    plan.placement = make_placement(*config, plan.layout, input.placement, input.expert_bytes,
                                    &plan.learned_routes, input.replicas);
  } catch (const Error& e) {
    plan.error = e.what();
  }
}

// The transport to the GPU ranks, once the layout has one rank per GPU (NCCL refuses two);
// before the device check, so that --transport nccl on a build without it says so. A gpu-expert
// rank computes its experts on its GPU: one that sees no device is refused (run it as a
// cpu-expert instead), not quietly run on its CPU.
void check_gpu_ranks(StartupPlan& plan, const std::vector<Hello>& all, const HandshakeInput& input,
                     int size) {
  const RankIdentity& me = rank_identity();
  if (plan.error.empty() && size > 1) {
    std::vector<TransportRank> ranks;
    for (const Hello& h : all) ranks.push_back({h.nccl_built, h.gpus_on_host, h.gpu_why_none});
    const TransportChoice choice = choose_transport(
        input.transport, plan.layout, ranks, [&](int r) { return rank_identity().name_of(r); });
    plan.error = choice.error;
    plan.nccl_ranks = choice.nccl_ranks;
  }
  for (const Hello& h : all) {
    if (!plan.error.empty()) break;
    const RankSpec& spec = plan.layout.ranks[size_t(h.rank)];
    if (spec.role == Role::kGpuExpert && h.gpus_on_host == 0)
      plan.error = fmt::format(
          "layout {}: {} is a gpu-expert (GPU {}) but sees no CUDA device ({}); make it a "
          "cpu-expert or run it where its GPU is visible",
          plan.layout.source, me.name_of(h.rank), spec.gpu, h.gpu_why_none);
  }
}

// The settings the coordinator alone uses, and its heartbeat from the shortest --rank-timeout.
void agree_with_coordinator(StartupPlan& plan, const std::vector<Hello>& all) {
  if (!plan.error.empty()) return;
  const Hello& coordinator = all[size_t(plan.layout.coordinator())];
  for (const Hello& h : all) {
    if (!plan.error.empty()) break;
    plan.error = setting_mismatch(h, coordinator, AgreedSetting::kCoordinator);
  }
  double shortest_timeout = coordinator.rank_timeout_s;
  for (const Hello& h : all) shortest_timeout = std::min(shortest_timeout, h.rank_timeout_s);
  // The coordinator's heartbeat runs on its own thread.
  plan.heartbeat_s =
      coordinator.thread_level >= MPI_THREAD_MULTIPLE ? heartbeat_period(shortest_timeout) : 0;
}

}  // namespace

StartupPlan handshake(MPI_Comm comm, const ModelConfig* config, const Checkpoint* checkpoint,
                      const HandshakeInput& input) {
  int rank = 0, size = 0;
  CHECK_MPI(MPI_Comm_rank(comm, &rank));
  CHECK_MPI(MPI_Comm_size(comm, &size));
  const Hello hello = my_hello(checkpoint, input, rank);
  const int root = 0;
  const auto decide = [&](const std::vector<std::string>& hellos) {
    StartupPlan plan;
    plan.wire_type = input.wire_type;
    const std::vector<Hello> all = read_hellos(hellos, size, rank, plan);
    check_same_job(plan, all, hello);
    plan_layout(plan, all, hello, config, input, size);
    check_gpu_ranks(plan, all, input, size);
    agree_with_coordinator(plan, all);
    return to_bytes(plan);
  };
  const StartupPlan plan =
      from_bytes<StartupPlan>(agree_within(comm, root, to_bytes(hello), decide, input.deadline));
  if (!plan.hosts.empty()) rank_identity().hosts = plan.hosts;
  if (!plan.error.empty()) throw StartupRefused(plan.error, plan.reporter, plan.names_reporter);
  return plan;
}

}  // namespace colibri
