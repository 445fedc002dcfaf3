#include "transport/exchange.h"

#include <algorithm>

#include "common/error.h"
#include "transport/composite_dispatcher.h"
#ifdef COLIBRI_HAVE_NCCL
#include "transport/nccl_transport.h"
#endif

namespace colibri {
namespace {

std::unique_ptr<MpiDispatcher> make_mpi_dispatcher(const ExchangeContext& c) {
  return std::make_unique<MpiDispatcher>(c.comm, c.shape, c.coordinator, *c.profiler,
                                         MpiTransportOptions(c.options, c.mpi));
}

std::unique_ptr<MpiChannel> make_mpi_channel(const ExchangeContext& c) {
  return std::make_unique<MpiChannel>(c.comm, *c.placement, c.shape, c.coordinator, *c.profiler,
                                      MpiTransportOptions(c.options, c.mpi));
}

#ifdef COLIBRI_HAVE_NCCL
bool in(const std::vector<int>& ranks, int r) {
  return std::find(ranks.begin(), ranks.end(), r) != ranks.end();
}

// Every rank of comm takes the id; those of nccl_ranks join the communicator.
std::unique_ptr<NcclTransport> make_nccl(const ExchangeContext& c) {
  const std::string id = nccl_unique_id(c.comm, c.coordinator, c.startup);
  int rank = 0;
  MPI_Comm_rank(c.comm, &rank);
  if (!in(c.nccl_ranks, rank)) return nullptr;
  NcclTransportOptions options;
  static_cast<ExchangeOptions&>(options) = c.options;
  options.setup_timeout_s = c.startup.seconds;
  options.device = c.device;
  return std::make_unique<NcclTransport>(c.nccl_ranks, id, *c.placement, c.shape, c.coordinator,
                                         *c.profiler, options);
}
#endif

}  // namespace

bool nccl_built(std::string* why_not) {
#ifdef COLIBRI_HAVE_NCCL
  (void)why_not;
  return true;
#else
  if (why_not) *why_not = "this build has no NCCL (configure with CUDA and NCCL found)";
  return false;
#endif
}

std::unique_ptr<Dispatcher> make_dispatcher(const ExchangeContext& context,
                                            std::unique_ptr<PartialDispatcher> local) {
  // The coordinator's own experts come first: the composite computes them after every remote
  // request has left and before it waits for the replies.
  std::vector<CompositeDispatcher::Part> parts;
  if (local) parts.push_back({std::move(local), {context.coordinator}});
  const auto compose = [&](std::unique_ptr<PartialDispatcher> remote,
                           std::vector<int> ranks) -> std::unique_ptr<Dispatcher> {
    if (parts.empty()) return remote;
    parts.push_back({std::move(remote), std::move(ranks)});
    return std::make_unique<CompositeDispatcher>(std::move(parts), context.shape.hidden);
  };
  int size = 0;
  MPI_Comm_size(context.comm, &size);
  if (context.nccl_ranks.empty()) {
    std::vector<int> expert_ranks;
    for (int r = 0; r < size; ++r)
      if (r != context.coordinator) expert_ranks.push_back(r);
    return compose(make_mpi_dispatcher(context), expert_ranks);
  }
#ifdef COLIBRI_HAVE_NCCL
  std::unique_ptr<NcclTransport> nccl = make_nccl(context);
  // The cpu-expert ranks stay on MPI; one dispatcher over both when there are any.
  std::vector<int> gpu_ranks, cpu_ranks;
  for (int r = 0; r < size; ++r) {
    if (r == context.coordinator) continue;
    (in(context.nccl_ranks, r) ? gpu_ranks : cpu_ranks).push_back(r);
  }
  if (cpu_ranks.empty()) return compose(std::move(nccl), gpu_ranks);
  ExchangeContext mpi = context;
  mpi.mpi.expert_ranks = cpu_ranks;
  parts.push_back({std::move(nccl), gpu_ranks});
  parts.push_back({make_mpi_dispatcher(mpi), cpu_ranks});
  return std::make_unique<CompositeDispatcher>(std::move(parts), context.shape.hidden);
#else
  fail("the NCCL transport was chosen, but this build has no NCCL");
#endif
}

std::unique_ptr<ExpertChannel> make_expert_channel(const ExchangeContext& context) {
  if (context.nccl_ranks.empty()) return make_mpi_channel(context);
#ifdef COLIBRI_HAVE_NCCL
  std::unique_ptr<NcclTransport> nccl = make_nccl(context);
  if (nccl) return nccl;
  int size = 0;
  MPI_Comm_size(context.comm, &size);
  ExchangeContext mpi = context;
  for (int r = 0; r < size; ++r)
    if (r != context.coordinator && !in(context.nccl_ranks, r)) mpi.mpi.expert_ranks.push_back(r);
  return make_mpi_channel(mpi);
#else
  fail("the NCCL transport was chosen, but this build has no NCCL");
#endif
}

MpiExchange make_mpi_exchange(MPI_Comm comm, const LivePlacement& placement,
                              const ExchangeShape& shape, int coordinator, Profiler& profiler,
                              const MpiTransportOptions& options) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MpiExchange exchange;
  if (rank == coordinator)
    exchange.dispatcher =
        std::make_unique<MpiDispatcher>(comm, shape, coordinator, profiler, options);
  else
    exchange.channel =
        std::make_unique<MpiChannel>(comm, placement, shape, coordinator, profiler, options);
  return exchange;
}

}  // namespace colibri
