#include "rank/vram_tier.h"

#include <algorithm>
#include <map>

#include "common/error.h"

namespace colibri {

double upload_us(const VramCostModel& cost, uint64_t bytes) {
  return cost.upload_latency_us + double(bytes) / cost.pcie_bytes_per_us;
}

double cpu_us(const VramCostModel& cost, uint64_t bytes, int rows, double flops_per_row) {
  return double(bytes) / cost.cpu_bytes_per_us +
         double(rows) * flops_per_row / cost.cpu_flops_per_us;
}

MissAction miss_action(const VramCostModel& cost, uint64_t bytes, int rows, double flops_per_row,
                       uint64_t previous_misses) {
  if (cost.promote_after > 0 && previous_misses >= uint64_t(cost.promote_after))
    return MissAction::kUpload;
  return upload_us(cost, bytes) <= cpu_us(cost, bytes, rows, flops_per_row) ? MissAction::kUpload
                                                                            : MissAction::kCpu;
}

VramCache::VramCache(int slots) : slot_key_(size_t(std::max(slots, 0)), -1) {
  for (int s = slots - 1; s >= 0; --s) free_.push_back(s);
}

bool VramCache::contains(int layer, int expert) const {
  return where_.count(key(layer, expert)) != 0;
}

int VramCache::find(int layer, int expert) {
  const uint64_t k = key(layer, expert);
  const auto it = where_.find(k);
  if (it == where_.end()) return -1;
  Entry& e = it->second;
  lru_.splice(lru_.begin(), lru_, e.lru);
  if (!e.in_use) {
    e.in_use = true;
    in_use_.push_back(k);
  }
  return e.slot;
}

int VramCache::insert(int layer, int expert, std::pair<int, int>* evicted) {
  const uint64_t k = key(layer, expert);
  if (where_.count(k)) fail("VRAM cache: layer {} expert {} inserted twice", layer, expert);
  if (evicted) *evicted = {-1, -1};
  int slot = -1;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    // The least recently used entry that the current request does not use.
    for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
      const auto victim = where_.find(*it);
      if (victim->second.in_use) continue;
      slot = victim->second.slot;
      if (evicted) *evicted = {int(uint32_t(*it >> 32)), int(uint32_t(*it))};
      lru_.erase(victim->second.lru);
      where_.erase(victim);
      break;
    }
    if (slot < 0) return -1;
  }
  lru_.push_front(k);
  where_[k] = {slot, true, lru_.begin()};
  in_use_.push_back(k);
  slot_key_[size_t(slot)] = int64_t(k);
  return slot;
}

void VramCache::release() {
  for (uint64_t k : in_use_) {
    const auto it = where_.find(k);
    if (it != where_.end()) it->second.in_use = false;
  }
  in_use_.clear();
}

VramTier::VramTier(int slots, uint64_t expert_bytes, double flops_per_row, VramCostModel cost)
    : cache_(slots), expert_bytes_(expert_bytes), flops_per_row_(flops_per_row), cost_(cost) {}

int VramTier::preload(int layer, int expert) {
  if (cache_.used() >= cache_.slots()) return -1;
  const int slot = cache_.insert(layer, expert);
  cache_.release();
  return slot;
}

std::vector<VramPlanEntry> VramTier::plan(int layer, std::span<const int> experts,
                                          std::span<const int> rows) {
  if (rows.size() != experts.size())
    fail("VRAM tier: {} row counts for {} experts", rows.size(), experts.size());
  std::vector<VramPlanEntry> out(experts.size());
  // Hits first, so that no miss evicts an expert the same request finds resident.
  for (size_t i = 0; i < experts.size(); ++i) {
    out[i].expert = experts[i];
    out[i].slot = cache_.find(layer, experts[i]);
    if (out[i].slot >= 0) {
      out[i].kind = VramPlanEntry::kHit;
      ++stats_.hits;
    }
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    VramPlanEntry& e = out[i];
    if (e.slot >= 0) continue;
    uint64_t& misses = misses_[(uint64_t(uint32_t(layer)) << 32) | uint32_t(e.expert)];
    const MissAction action = miss_action(cost_, expert_bytes_, rows[i], flops_per_row_, misses);
    ++misses;
    if (action == MissAction::kUpload) e.slot = cache_.insert(layer, e.expert, &e.evicted);
    if (e.slot >= 0) {
      e.kind = VramPlanEntry::kUpload;
      ++stats_.uploads;
      stats_.upload_bytes += expert_bytes_;
      if (e.evicted.first >= 0) ++stats_.evictions;
    } else {
      e.kind = VramPlanEntry::kCpu;
      ++stats_.cpu_experts;
    }
  }
  return out;
}

std::vector<std::pair<int, int>> vram_fill_order(std::span<const std::pair<int, int>> owned) {
  std::map<int, int> seen;                                  // layer -> owned experts of it so far
  std::vector<std::pair<int, std::pair<int, int>>> ranked;  // (rank within layer, pair)
  ranked.reserve(owned.size());
  for (const auto& p : owned) ranked.push_back({seen[p.first]++, p});
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<int, int>> order;
  order.reserve(ranked.size());
  for (const auto& r : ranked) order.push_back(r.second);
  return order;
}

}  // namespace colibri
