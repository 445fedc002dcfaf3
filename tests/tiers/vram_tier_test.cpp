// The VRAM tier's decisions (rank/vram_tier.h), on the CPU: the slot cache (LRU, experts of the
// running request never evicted), the miss rule (upload vs CPU) at its boundary, and the plan of
// a request. No device needed: the CUDA backend only carries these decisions out.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "rank/vram_tier.h"

namespace colibri {
namespace {

TEST(VramCache, FillsFreeSlotsThenEvictsLeastRecentlyUsed) {
  VramCache cache(2);
  EXPECT_EQ(cache.find(0, 1), -1);
  const int a = cache.insert(0, 1), b = cache.insert(0, 2);
  EXPECT_NE(a, b);
  EXPECT_GE(a, 0);
  EXPECT_GE(b, 0);
  // Both in use by the current request: nothing can be evicted.
  EXPECT_EQ(cache.insert(0, 3), -1);
  cache.release();
  EXPECT_EQ(cache.find(0, 1), a);  // 1 is now the most recently used
  cache.release();
  std::pair<int, int> evicted;
  EXPECT_EQ(cache.insert(0, 3, &evicted), b);
  EXPECT_EQ(evicted, std::make_pair(0, 2));
  EXPECT_FALSE(cache.contains(0, 2));
  EXPECT_TRUE(cache.contains(0, 1));
  EXPECT_TRUE(cache.contains(0, 3));
  EXPECT_EQ(cache.used(), 2);
}

TEST(VramCache, SkipsEntriesInUseWhenEvicting) {
  VramCache cache(2);
  const int a = cache.insert(1, 0);
  cache.release();
  const int b = cache.insert(1, 1);
  cache.release();
  // 0 is least recently used but the request holds it: 1 goes instead.
  EXPECT_EQ(cache.find(1, 0), a);
  std::pair<int, int> evicted;
  EXPECT_EQ(cache.insert(2, 5, &evicted), b);
  EXPECT_EQ(evicted, std::make_pair(1, 1));
}

TEST(VramCache, SameExpertOnTwoLayersIsTwoEntries) {
  VramCache cache(4);
  const int a = cache.insert(0, 7), b = cache.insert(1, 7);
  EXPECT_NE(a, b);
  EXPECT_EQ(cache.find(0, 7), a);
  EXPECT_EQ(cache.find(1, 7), b);
  EXPECT_THROW(cache.insert(1, 7), std::exception);
}

TEST(VramMissRule, UploadsWhenTheCopyIsNoSlowerThanTheCpu) {
  VramCostModel cost;
  cost.pcie_bytes_per_us = 20e3;
  cost.upload_latency_us = 0;
  cost.cpu_bytes_per_us = 10e3;
  cost.cpu_flops_per_us = 1e3;
  cost.promote_after = 0;
  const uint64_t bytes = 1'000'000;  // 50 us up, 100 us on the CPU before any arithmetic
  EXPECT_DOUBLE_EQ(upload_us(cost, bytes), 50.0);
  EXPECT_DOUBLE_EQ(cpu_us(cost, bytes, 2, 1000.0), 102.0);
  EXPECT_EQ(miss_action(cost, bytes, 1, 0.0, 0), MissAction::kUpload);
  // A slow link: 200 us up against 100 us + rows * 10 us on the CPU; equal at 10 rows.
  cost.pcie_bytes_per_us = 5e3;
  EXPECT_EQ(miss_action(cost, bytes, 1, 10e3, 0), MissAction::kCpu);
  EXPECT_EQ(miss_action(cost, bytes, 9, 10e3, 0), MissAction::kCpu);
  EXPECT_EQ(miss_action(cost, bytes, 10, 10e3, 0), MissAction::kUpload);
  EXPECT_EQ(miss_action(cost, bytes, 16, 10e3, 0), MissAction::kUpload);
  // A hot expert is uploaded whatever the costs.
  cost.promote_after = 3;
  EXPECT_EQ(miss_action(cost, bytes, 1, 10e3, 2), MissAction::kCpu);
  EXPECT_EQ(miss_action(cost, bytes, 1, 10e3, 3), MissAction::kUpload);
}

VramCostModel always(MissAction action) {
  VramCostModel cost;
  cost.promote_after = 0;
  cost.upload_latency_us = action == MissAction::kUpload ? 0 : 1e12;
  cost.cpu_bytes_per_us = action == MissAction::kUpload ? 1 : 1e12;
  return cost;
}

TEST(VramTier, PlanHitsUploadsAndEvictsOnlyOutsideTheRequest) {
  VramTier tier(3, 1000, 0.0, always(MissAction::kUpload));
  EXPECT_GE(tier.preload(0, 1), 0);
  EXPECT_GE(tier.preload(0, 2), 0);
  const std::vector<int> experts = {2, 5, 1, 6}, rows = {1, 1, 1, 1};
  const auto plan = tier.plan(0, experts, rows);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].kind, VramPlanEntry::kHit);
  EXPECT_EQ(plan[2].kind, VramPlanEntry::kHit);
  // One free slot: 5 takes it; 6 finds every slot in use by this request and runs on the CPU.
  EXPECT_EQ(plan[1].kind, VramPlanEntry::kUpload);
  EXPECT_EQ(plan[1].evicted.first, -1);
  EXPECT_EQ(plan[3].kind, VramPlanEntry::kCpu);
  std::set<int> slots = {plan[0].slot, plan[1].slot, plan[2].slot};
  EXPECT_EQ(slots.size(), 3u);
  EXPECT_EQ(tier.stats().hits, 2u);
  EXPECT_EQ(tier.stats().uploads, 1u);
  EXPECT_EQ(tier.stats().cpu_experts, 1u);
  EXPECT_EQ(tier.stats().upload_bytes, 1000u);
  tier.release();

  // Next request: 6 evicts the least recently used of the three (2, found first above).
  const std::vector<int> next = {6}, one = {1};
  const auto plan2 = tier.plan(0, next, one);
  EXPECT_EQ(plan2[0].kind, VramPlanEntry::kUpload);
  EXPECT_EQ(plan2[0].evicted, std::make_pair(0, 2));
  EXPECT_EQ(plan2[0].slot, plan[0].slot);
  EXPECT_EQ(tier.stats().evictions, 1u);
  tier.release();
  EXPECT_THROW(tier.plan(0, next, {}), std::exception);
}

TEST(VramTier, CpuRuleKeepsTheHotSetUntilAnExpertIsPromoted) {
  VramCostModel cost = always(MissAction::kCpu);
  cost.promote_after = 2;
  VramTier tier(1, 1000, 0.0, cost);
  EXPECT_GE(tier.preload(3, 0), 0);
  EXPECT_EQ(tier.preload(3, 1), -1);  // full
  const std::vector<int> e = {1}, r = {4};
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(tier.plan(3, e, r)[0].kind, VramPlanEntry::kCpu);
    tier.release();
  }
  const auto third = tier.plan(3, e, r);
  EXPECT_EQ(third[0].kind, VramPlanEntry::kUpload);
  EXPECT_EQ(third[0].evicted, std::make_pair(3, 0));
  tier.release();
  EXPECT_EQ(tier.plan(3, e, r)[0].kind, VramPlanEntry::kHit);
  EXPECT_EQ(tier.stats().cpu_experts, 2u);
  EXPECT_EQ(tier.stats().uploads, 1u);
  EXPECT_EQ(tier.stats().hits, 1u);
}

TEST(VramTier, ZeroSlotsComputesEverythingOnTheCpu) {
  VramTier tier(0, 1000, 0.0, always(MissAction::kUpload));
  const std::vector<int> e = {0, 1}, r = {1, 1};
  for (const auto& p : tier.plan(0, e, r)) EXPECT_EQ(p.kind, VramPlanEntry::kCpu);
}

TEST(VramFillOrder, RoundRobinOverLayers) {
  const std::vector<std::pair<int, int>> owned = {{0, 1}, {0, 4}, {0, 9}, {1, 2}, {2, 0}, {2, 3}};
  const std::vector<std::pair<int, int>> want = {{0, 1}, {1, 2}, {2, 0}, {0, 4}, {2, 3}, {0, 9}};
  EXPECT_EQ(vram_fill_order(owned), want);
}

}  // namespace
}  // namespace colibri
