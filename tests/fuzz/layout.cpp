// Fuzz target: a layout file (docs/LAUNCH.md), parsed by parse_layout (what load_layout does with
// the file's text). The first byte gives the MPI world size, 1 + byte % 64; the rest is the text.
// An accepted layout has one spec per rank, exactly one coordinator, GPU expert ranks with a GPU,
// and finite, non-negative budgets.
#include <cmath>
#include <string>

#include "common/layout.h"
#include "fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int world_size = 1 + data[0] % 64;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  return colibri::fuzz::run_one([&] {
    const colibri::Layout layout = colibri::parse_layout(text, "fuzz.layout", world_size);
    fuzz_require(layout.ranks.size() == size_t(world_size), "one spec per rank");
    int coordinators = 0;
    for (size_t r = 0; r < layout.ranks.size(); ++r) {
      const colibri::RankSpec& spec = layout.ranks[r];
      fuzz_require(spec.rank == int(r), "specs indexed by rank");
      coordinators += spec.role == colibri::Role::kCoordinator;
      if (spec.role == colibri::Role::kGpuExpert) fuzz_require(spec.gpu >= 0, "GPU rank has a GPU");
      if (spec.role == colibri::Role::kCpuExpert) fuzz_require(spec.gpu < 0, "CPU rank has no GPU");
      fuzz_require(spec.gpu >= -1 && spec.numa >= -1, "indices -1 or more");
      fuzz_require(std::isfinite(spec.ram_gb) && spec.ram_gb >= 0, "finite ram_gb");
      fuzz_require(std::isfinite(spec.vram_gb) && spec.vram_gb >= 0, "finite vram_gb");
    }
    fuzz_require(coordinators == 1, "exactly one coordinator");
    fuzz_require(layout.coordinator() >= 0, "coordinator() finds it");
    fuzz_require(layout.expert_ranks().size() == size_t(world_size - 1), "the rest are experts");
  });
}
