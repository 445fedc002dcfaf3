// The one place that chooses a transport implementation for a rank: MPI for every expert rank,
// or (built with CUDA and NCCL, and chosen at the handshake: transport/transport_choice.h) NCCL
// between the coordinator and the gpu-expert ranks, composed with MPI for the cpu-expert ranks.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "common/profile.h"
#include "moe/placement.h"
#include "transport/deadline.h"
#include "transport/mpi_channel.h"
#include "transport/mpi_dispatcher.h"
#include "transport/mpi_options.h"
#include "transport/transport.h"

namespace colibri {

struct ExchangeContext {
  MPI_Comm comm = MPI_COMM_NULL;
  const LivePlacement* placement = nullptr;
  ExchangeShape shape;
  int coordinator = 0;
  Profiler* profiler = nullptr;
  ExchangeOptions options;  // every transport's
  MpiSettings mpi;          // the MPI transport's own
  // NCCL between these world ranks (the coordinator and the gpu-expert ranks, ascending); empty:
  // MPI only. Every rank of comm takes part in making the communicator's id.
  std::vector<int> nccl_ranks;
  int device = -1;   // this rank's CUDA device, when it is one of nccl_ranks
  Deadline startup;  // for the NCCL id and communicator
};

// Whether this build has the NCCL transport; when not, why (for --transport nccl's error).
bool nccl_built(std::string* why_not = nullptr);

// The coordinator's dispatcher to every expert rank, and to its own experts when `local` is given
// (they are computed while the expert ranks compute theirs, the partials added in rank order).
// Collective over context.comm when nccl_ranks is set (as is make_expert_channel on every other
// rank).
std::unique_ptr<Dispatcher> make_dispatcher(const ExchangeContext& context,
                                            std::unique_ptr<PartialDispatcher> local = nullptr);
// An expert rank's channel from the coordinator.
std::unique_ptr<ExpertChannel> make_expert_channel(const ExchangeContext& context);

// The MPI exchange of one rank of comm alone (benchmarks, tests): the coordinator's dispatcher,
// or the channel of an expert rank the options serve. Collective: the coordinator and every
// served rank make theirs.
struct MpiExchange {
  std::unique_ptr<MpiDispatcher> dispatcher;  // on the coordinator
  std::unique_ptr<MpiChannel> channel;        // on a served expert rank
};
MpiExchange make_mpi_exchange(MPI_Comm comm, const LivePlacement& placement,
                              const ExchangeShape& shape, int coordinator, Profiler& profiler,
                              const MpiTransportOptions& options);
// The placement must outlive the exchange.
MpiExchange make_mpi_exchange(MPI_Comm, LivePlacement&&, const ExchangeShape&, int, Profiler&,
                              const MpiTransportOptions&) = delete;

}  // namespace colibri
