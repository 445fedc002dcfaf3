#include "transport/transport_choice.h"

#include <fmt/format.h>

#include "common/error.h"

namespace colibri {

TransportKind parse_transport(const std::string& text, const std::string& flag) {
  if (text == "auto") return TransportKind::kAuto;
  if (text == "mpi") return TransportKind::kMpi;
  if (text == "nccl") return TransportKind::kNccl;
  fail("{} '{}': expected auto, mpi or nccl", flag, text);
}

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kMpi:
      return "mpi";
    case TransportKind::kNccl:
      return "nccl";
    case TransportKind::kAuto:
      break;
  }
  return "auto";
}

TransportChoice choose_transport(TransportKind requested, const Layout& layout,
                                 const std::vector<TransportRank>& ranks,
                                 const std::function<std::string(int)>& name_of) {
  TransportChoice choice;
  if (requested == TransportKind::kMpi) return choice;
  if (ranks.size() != layout.ranks.size())
    fail("choose_transport: {} ranks for a layout of {}", ranks.size(), layout.ranks.size());
  // Why NCCL cannot run; the first reason found.
  std::string why_not;
  const int coordinator = layout.coordinator();
  std::vector<int> gpu_ranks;
  for (const RankSpec& spec : layout.ranks)
    if (spec.rank == coordinator || spec.role == Role::kGpuExpert) gpu_ranks.push_back(spec.rank);
  for (int r : gpu_ranks)
    if (why_not.empty() && !ranks[size_t(r)].nccl_built)
      why_not = fmt::format("{} was built without NCCL (it needs a build with CUDA and NCCL)",
                            name_of(r));
  if (why_not.empty() && layout.ranks[size_t(coordinator)].gpu < 0)
    why_not = fmt::format(
        "the coordinator {} has no gpu in layout {} (NCCL runs between the coordinator's GPU and "
        "the gpu-expert ranks)",
        name_of(coordinator), layout.source);
  if (why_not.empty() && gpu_ranks.size() < 2)
    why_not = fmt::format("layout {} has no gpu-expert rank", layout.source);
  for (int r : gpu_ranks)
    if (why_not.empty() && ranks[size_t(r)].gpus == 0)
      why_not = fmt::format("{} sees no CUDA device ({})", name_of(r), ranks[size_t(r)].why_no_gpu);
  if (why_not.empty()) {
    choice.nccl = true;
    choice.nccl_ranks = gpu_ranks;
  } else if (requested == TransportKind::kNccl) {
    choice.error = fmt::format("--transport nccl: {}; use --transport mpi or auto", why_not);
  }
  return choice;
}

}  // namespace colibri
