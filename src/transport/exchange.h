// The one place that chooses a transport implementation for a rank: MPI today; NCCL for GPU
// peers (and a composite with MPI for CPU peers) when built with CUDA and NCCL.
#pragma once

#include <mpi.h>

#include <memory>

#include "common/profile.h"
#include "rank/placement.h"
#include "transport/mpi_transport.h"
#include "transport/transport.h"

namespace colibri {

struct ExchangeContext {
  MPI_Comm comm = MPI_COMM_NULL;
  const PlacementTable* placement = nullptr;
  ExchangeShape shape;
  int coordinator = 0;
  Profiler* profiler = nullptr;
  MpiTransportOptions options;
};

// The coordinator's dispatcher to every expert rank.
std::unique_ptr<Dispatcher> make_dispatcher(const ExchangeContext& context);
// An expert rank's channel from the coordinator.
std::unique_ptr<ExpertChannel> make_expert_channel(const ExchangeContext& context);

}  // namespace colibri
