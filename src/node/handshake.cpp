#include "node/handshake.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "node/devices.h"
#include "node/serialize.h"
#include "transport/mpi_check.h"
#include "transport/protocol.h"

namespace colibri {
namespace {

uint64_t fnv1a(uint64_t hash, std::string_view bytes) {
  for (char c : bytes) hash = (hash ^ uint8_t(c)) * 1099511628211ull;
  return hash;
}

}  // namespace

std::string broadcast_bytes(MPI_Comm comm, int root, std::string bytes) {
  uint64_t size = bytes.size();
  CHECK_MPI(MPI_Bcast(&size, 1, MPI_UINT64_T, root, comm));
  bytes.resize(size);
  CHECK_MPI(MPI_Bcast(bytes.data(), int(size), MPI_BYTE, root, comm));
  return bytes;
}

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

StartupPlan handshake(MPI_Comm comm, const ModelConfig& config, const Checkpoint& checkpoint,
                      const HandshakeInput& input) {
  int rank = 0, size = 0;
  CHECK_MPI(MPI_Comm_rank(comm, &rank));
  CHECK_MPI(MPI_Comm_size(comm, &size));
  // Node-local rank and host index, for the default layout's GPU assignment.
  MPI_Comm local;
  CHECK_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local));
  Hello hello;
  hello.protocol_version = wire::kProtocolVersion;
  hello.rank = rank;
  hello.host = rank_identity().host;
  hello.model_hash = model_hash(input.model_dir, checkpoint);
  hello.gpus_on_host = local_gpu_count();
  CHECK_MPI(MPI_Comm_rank(local, &hello.local_rank));
  CHECK_MPI(MPI_Comm_free(&local));

  const int root = 0;
  const std::vector<std::string> hellos = gather_bytes(comm, root, to_bytes(hello));
  StartupPlan plan;
  if (rank == root) {
    plan.wire_type = input.wire_type;
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
                        h.host, h.protocol_version, rank, all[0].host, wire::kProtocolVersion);
      if (h.model_hash != hello.model_hash && plan.error.empty())
        plan.error = fmt::format(
            "rank {}@{} loaded a different model than rank {}@{} (config or tensor index differ: "
            "{:016x} vs {:016x}) from {}",
            h.rank, h.host, rank, all[0].host, h.model_hash, hello.model_hash,
            input.model_dir.string());
    }
    if (plan.error.empty()) {
      try {
        plan.layout = input.layout_file ? load_layout(*input.layout_file, size)
                                        : default_layout(size, local_rank, gpus, host_index);
        plan.placement = make_placement(config, plan.layout, input.placement, input.expert_bytes);
      } catch (const Error& e) {
        plan.error = e.what();
      }
    }
  }
  plan = from_bytes<StartupPlan>(
      broadcast_bytes(comm, root, rank == root ? to_bytes(plan) : std::string()));
  rank_identity().hosts = plan.hosts;
  if (!plan.error.empty()) throw StartupRefused(plan.error);
  return plan;
}

}  // namespace colibri
