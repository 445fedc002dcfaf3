// Which transport runs between the coordinator and the GPU expert ranks (--transport
// mpi|nccl|auto), decided once by rank 0 at the handshake from every rank's HELLO.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common/layout.h"

namespace colibri {

enum class TransportKind : int { kAuto = 0, kMpi = 1, kNccl = 2 };

// "auto", "mpi" or "nccl"; an Error naming `flag` otherwise.
TransportKind parse_transport(const std::string& text, const std::string& flag);
const char* transport_name(TransportKind kind);

// What one rank reports about itself.
struct TransportRank {
  bool nccl_built = false;  // this build has CUDA and NCCL
  int gpus = 0;             // CUDA devices it sees
  std::string why_no_gpu;   // when gpus is 0
};

struct TransportChoice {
  bool nccl = false;
  // NCCL: the coordinator and the gpu-expert ranks, ascending (the communicator's ranks in this
  // order); the other expert ranks stay on MPI.
  std::vector<int> nccl_ranks;
  std::string error;  // non-empty: the request cannot be met
};

// kMpi: MPI for every expert rank. kNccl: NCCL between the coordinator (which needs a gpu in the
// layout) and the gpu-expert ranks (at least one), each built with NCCL and seeing a device; an
// error naming the first rank that falls short (a build without NCCL is named first). kAuto: NCCL
// when all of that holds, else MPI. `name_of(r)` is "rank r@host".
TransportChoice choose_transport(TransportKind requested, const Layout& layout,
                                 const std::vector<TransportRank>& ranks,
                                 const std::function<std::string(int)>& name_of);

}  // namespace colibri
