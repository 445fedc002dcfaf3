// The VRAM tier of a GPU expert rank, as plain C++ (no CUDA): which of the rank's experts are in
// device memory, and what happens to a request's expert that is not. The CUDA backend
// (cuda_expert_backend.h) holds the device slots and does the copies; this decides.
//
// The device holds `slots` experts (every expert of a model has the same bytes). When all owned
// experts fit, all are uploaded at start and every lookup hits. Otherwise the slots are a cache
// over the rank's RAM and disk tiers (ExpertStore), evicted least recently used; the experts of
// the request being computed are never evicted. A miss is either
//   - uploaded: read through the store, copied to pinned memory and sent to a free or evicted
//     slot on a copy stream while the kernels of the request's resident experts run, or
//   - computed on the rank's CPU threads (kernels/cpu), while the device computes the rest.
// The rule (miss_action): upload when the copy is expected to take no longer than computing the
// expert on the CPU,
//     upload_us = upload_latency_us + bytes / pcie_bytes_per_us
//     cpu_us    = bytes / cpu_bytes_per_us + rows * flops_per_row / cpu_flops_per_us
//     upload  iff  upload_us <= cpu_us,
// or when the expert has already missed `promote_after` times (it is hot: its later hits repay
// the copy), and only when a slot can be freed (all slots in use by this request: CPU). The
// constants are parameters, to be set from measurements on the machine (gpu_expert_bench prints
// the host-to-device bandwidth; the CPU rate is the CPU backend's expert time).
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace colibri {

struct VramCostModel {
  double pcie_bytes_per_us = 25e3;  // host-to-device copies from pinned memory (25 GB/s)
  double upload_latency_us = 10;    // fixed cost of one expert's copy (launch, staging memcpy)
  double cpu_bytes_per_us = 10e3;   // the CPU expert FFN streaming its weights (10 GB/s)
  double cpu_flops_per_us = 200e3;  // the CPU's arithmetic on the rank's threads (200 GFLOP/s)
  int promote_after = 2;            // misses after which an expert is uploaded anyway; 0 = never
};

enum class MissAction { kUpload, kCpu };

double upload_us(const VramCostModel& cost, uint64_t bytes);
double cpu_us(const VramCostModel& cost, uint64_t bytes, int rows, double flops_per_row);
// The rule above for one missed expert, `previous_misses` being its misses before this one.
MissAction miss_action(const VramCostModel& cost, uint64_t bytes, int rows, double flops_per_row,
                       uint64_t previous_misses);

struct VramTierStats {
  uint64_t hits = 0;          // request experts found in VRAM
  uint64_t uploads = 0;       // misses uploaded during requests
  uint64_t cpu_experts = 0;   // misses computed on the CPU
  uint64_t evictions = 0;     // experts dropped from VRAM for an upload
  uint64_t upload_bytes = 0;  // expert bytes copied to the device during requests
};

// The slot cache. Keys are (layer, expert); slots are 0 .. slots - 1.
class VramCache {
 public:
  explicit VramCache(int slots);

  int slots() const { return int(slot_key_.size()); }
  int used() const { return int(where_.size()); }
  // The slot holding (layer, expert), marked in use until release() and most recently used; -1
  // when absent.
  int find(int layer, int expert);
  // A slot for (layer, expert), which must be absent: a free one, else the least recently used
  // one not in use (its previous key in *evicted, if given). -1 when every slot is in use. The
  // new entry is in use until release().
  int insert(int layer, int expert, std::pair<int, int>* evicted = nullptr);
  // The request is done: its experts may be evicted again.
  void release();
  bool contains(int layer, int expert) const;

 private:
  static uint64_t key(int layer, int expert) {
    return (uint64_t(uint32_t(layer)) << 32) | uint32_t(expert);
  }
  struct Entry {
    int slot;
    bool in_use;
    std::list<uint64_t>::iterator lru;
  };
  std::unordered_map<uint64_t, Entry> where_;
  std::list<uint64_t> lru_;        // front = most recently used
  std::vector<int64_t> slot_key_;  // -1 = free
  std::vector<int> free_;
  std::vector<uint64_t> in_use_;
};

// What to do with each expert of one request.
struct VramPlanEntry {
  int expert = 0;
  enum Kind { kHit, kUpload, kCpu } kind = kHit;
  int slot = -1;                        // kHit, kUpload: the device slot
  std::pair<int, int> evicted{-1, -1};  // kUpload: the (layer, expert) whose slot it takes
};

// The plan of a request's experts on `layer` (distinct ids, any order) with rows[i] rows for
// experts[i]; updates `cache` (hits marked in use, uploads inserted), the miss counts and
// `stats`. The caller uploads the kUpload experts and calls cache.release() after the request.
class VramTier {
 public:
  VramTier(int slots, uint64_t expert_bytes, double flops_per_row, VramCostModel cost);

  std::vector<VramPlanEntry> plan(int layer, std::span<const int> experts,
                                  std::span<const int> rows);
  // Start-up: places (layer, expert) in a free slot (not counted as an upload); -1 when full.
  int preload(int layer, int expert);
  void release() { cache_.release(); }

  const VramCache& cache() const { return cache_; }
  const VramTierStats& stats() const { return stats_; }
  const VramCostModel& cost() const { return cost_; }

 private:
  VramCache cache_;
  uint64_t expert_bytes_;
  double flops_per_row_;
  VramCostModel cost_;
  std::unordered_map<uint64_t, uint64_t> misses_;
  VramTierStats stats_;
};

// The order in which owned experts fill the VRAM at start when not all fit: round robin over
// layers (each layer's first owned expert, then each layer's second, ...), so that every layer
// starts with some experts on the device.
std::vector<std::pair<int, int>> vram_fill_order(std::span<const std::pair<int, int>> owned);

}  // namespace colibri
