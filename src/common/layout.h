// Which rank does what: the coordinator, GPU expert ranks and CPU expert ranks, with their GPU,
// NUMA node and memory budgets. Read from a human-written layout file or derived from the world.
//
// Layout file: one line per rank, '#' starts a comment, columns separated by spaces:
//   rank  role         gpu  numa  ram_gb  vram_gb  host
//   0     coordinator  -    0     -       -        node-a
//   1     gpu-expert   0    0     16      28       node-a
//   7     cpu-expert   -    1     100     -        node-b
// '-' means unset; an unset host is the rank's MPI processor name (filled in at the handshake).
// Roles: coordinator (exactly one), gpu-expert, cpu-expert. Ranks 0..N-1 each appear exactly once.
// A coordinator row with a ram_gb budget makes the coordinator an expert owner too: it runs its
// share of the routed experts on its own CPU threads while the expert ranks compute theirs.
#pragma once

#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <filesystem>
#include <string>
#include <vector>

namespace colibri {

// Largest memory budget accepted, in GiB (layout columns, --ram-gb, --pin-gb): 1 PiB, so that a
// budget converted to bytes (x 2^30) can never overflow 64 bits.
inline constexpr double kMaxBudgetGib = double(1 << 20);

enum class Role : int { kCoordinator = 0, kGpuExpert = 1, kCpuExpert = 2 };

const char* role_name(Role role);

struct RankSpec {
  int rank = 0;
  Role role = Role::kCpuExpert;
  int gpu = -1;        // device index on its host; -1 = none
  int numa = -1;       // NUMA node to bind to; -1 = unbound
  double ram_gb = 0;   // expert RAM budget; 0 = unset
  double vram_gb = 0;  // expert VRAM budget; 0 = unset
  std::string host;    // the host it runs on (placement by host); "" = unset

  template <class Archive>
  void serialize(Archive& ar) {
    ar(rank, role, gpu, numa, ram_gb, vram_gb, host);
  }
};

struct Layout {
  std::vector<RankSpec> ranks;  // indexed by rank
  std::string source;           // file name, or "default"

  int coordinator() const;
  std::vector<int> expert_ranks() const;  // ascending
  // The ranks that own routed experts: the expert ranks, and the coordinator when its row has a
  // ram_gb budget (or when it is alone); ascending.
  std::vector<int> owner_ranks() const;
  bool coordinator_owns_experts() const;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(ranks, source);
  }
};

// Parses a layout file for `world_size` ranks; errors name the file and line.
Layout parse_layout(const std::string& text, const std::string& source, int world_size);
Layout load_layout(const std::filesystem::path& path, int world_size);

// Refuses two ranks with the same GPU on the same host (NCCL refuses two ranks on one device, and
// two would share its memory), naming both ranks. Hosts must be resolved first (the handshake
// sets an unset host column to where the rank runs).
void check_one_rank_per_gpu(const Layout& layout);

// Rank 0 coordinates; every other rank is an expert rank: a GPU expert rank when its host has
// GPUs (gpu = (local_rank - 1) % gpus_on_host on the coordinator's host, local_rank % gpus
// elsewhere), a CPU expert rank otherwise.
Layout default_layout(int world_size, const std::vector<int>& local_rank,
                      const std::vector<int>& gpus_on_host, const std::vector<int>& host_index);

}  // namespace colibri
