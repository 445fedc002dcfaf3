// ExpertStore on synthetic experts: every expert's weights encode (layer, expert), so a wrong
// entry or a stale reference is visible, and the load function counts reads.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <vector>

#include "common/error.h"
#include "rank/expert_store.h"

namespace colibri {
namespace {

constexpr int kFloats = 256;                        // per matrix
constexpr uint64_t kExpertBytes = 3 * 4 * kFloats;  // one expert's MlpWeights::bytes()

MlpWeights make_expert(int layer, int expert) {
  MlpWeights w;
  const float tag = float(layer * 100 + expert);
  w.gate = Matrix{16, 16, std::vector<float>(kFloats, tag), {}, {}, {}, 0, {}, {}};
  w.up = Matrix{16, 16, std::vector<float>(kFloats, tag + 0.5f), {}, {}, {}, 0, {}, {}};
  w.down = Matrix{16, 16, std::vector<float>(kFloats, -tag), {}, {}, {}, 0, {}, {}};
  return w;
}

std::vector<std::pair<int, int>> owned(int layers, int experts) {
  std::vector<std::pair<int, int>> pairs;
  for (int l = 0; l < layers; ++l)
    for (int e = 0; e < experts; ++e) pairs.emplace_back(l, e);
  return pairs;
}

struct CountingLoader {
  std::atomic<int> reads{0};
  ExpertStore::LoadFn fn() {
    return [this](int layer, int expert) {
      ++reads;
      return make_expert(layer, expert);
    };
  }
};

void expect_expert(const MlpWeights& w, int layer, int expert) {
  ASSERT_EQ(w.gate.data.size(), size_t(kFloats));
  EXPECT_EQ(w.gate.data[7], float(layer * 100 + expert));
  EXPECT_EQ(w.down.data[3], -float(layer * 100 + expert));
}

TEST(ExpertStore, ZeroBudgetKeepsEveryExpertResidentAndReadsNothingLater) {
  CountingLoader loader;
  ExpertStore store(owned(2, 4), loader.fn(), {});
  EXPECT_EQ(loader.reads, 8);
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 4; ++e) expect_expert(store.acquire(l, e), l, e);
  store.release();
  const StoreCounters s = store.stats();
  EXPECT_EQ(s.pinned_hits, 8u);
  EXPECT_EQ(s.ram_hits + s.disk_hits + s.disk_bytes_read + s.waits, 0u);
  EXPECT_EQ(loader.reads, 8);
}

TEST(ExpertStore, LruEvictsLeastRecentlyUsedUnderABudgetSmallerThanTheWorkingSet) {
  CountingLoader loader;
  ExpertStore store(owned(1, 4), loader.fn(), {.ram_bytes = 2 * kExpertBytes});
  EXPECT_EQ(loader.reads, 0);
  for (int e : {0, 1}) {
    expect_expert(store.acquire(0, e), 0, e);
    store.release();
  }
  EXPECT_TRUE(store.resident(0, 0));
  EXPECT_TRUE(store.resident(0, 1));
  expect_expert(store.acquire(0, 0), 0, 0);  // 0 becomes most recent: 1 is the LRU
  store.release();
  expect_expert(store.acquire(0, 2), 0, 2);
  store.release();
  EXPECT_TRUE(store.resident(0, 0));
  EXPECT_FALSE(store.resident(0, 1));
  EXPECT_TRUE(store.resident(0, 2));
  EXPECT_LE(store.resident_bytes(), 2 * kExpertBytes);

  const StoreCounters s = store.stats();
  EXPECT_EQ(s.disk_hits, 3u);
  EXPECT_EQ(s.ram_hits, 1u);
  EXPECT_EQ(s.pinned_hits, 0u);
  EXPECT_EQ(s.disk_bytes_read, 3 * kExpertBytes);
  EXPECT_EQ(loader.reads, 3);
}

TEST(ExpertStore, ExpertsAcquiredForTheCurrentRequestAreNotEvicted) {
  CountingLoader loader;
  ExpertStore store(owned(1, 4), loader.fn(), {.ram_bytes = kExpertBytes});
  std::vector<const MlpWeights*> held;
  for (int e = 0; e < 4; ++e) held.push_back(&store.acquire(0, e));
  for (int e = 0; e < 4; ++e) {
    EXPECT_TRUE(store.resident(0, e));
    expect_expert(*held[size_t(e)], 0, e);  // references stay valid over the budget
  }
  store.release();
  EXPECT_LE(store.resident_bytes(), kExpertBytes);
  EXPECT_TRUE(store.resident(0, 3));  // the most recent survives
}

TEST(ExpertStore, PinnedExpertsAreNeverEvicted) {
  CountingLoader loader;
  ExpertStore store(owned(1, 6), loader.fn(),
                    {.ram_bytes = kExpertBytes, .pin_bytes = 2 * kExpertBytes});
  EXPECT_EQ(loader.reads, 2);  // experts 0 and 1 pinned at start
  EXPECT_EQ(store.pinned_bytes(), 2 * kExpertBytes);
  for (int round = 0; round < 3; ++round)
    for (int e = 0; e < 6; ++e) {
      expect_expert(store.acquire(0, e), 0, e);
      store.release();
    }
  EXPECT_TRUE(store.resident(0, 0));
  EXPECT_TRUE(store.resident(0, 1));
  const StoreCounters s = store.stats();
  EXPECT_EQ(s.pinned_hits, 6u);
  EXPECT_EQ(s.disk_hits, 12u);  // 4 unpinned experts cycling through a one-expert cache
  EXPECT_EQ(s.ram_hits, 0u);
  EXPECT_EQ(loader.reads, 2 + 12);
}

TEST(ExpertStore, PrefetchReadsInTheBackgroundSoAcquireDoesNotWait) {
  CountingLoader loader;
  ExpertStore store(owned(2, 8), loader.fn(), {.ram_bytes = 64 * kExpertBytes});
  const std::vector<int> wanted = {1, 3, 5};
  store.prefetch(1, wanted);
  store.wait_idle();
  EXPECT_EQ(loader.reads, 3);
  for (int e : wanted) expect_expert(store.acquire(1, e), 1, e);
  store.release();
  const StoreCounters s = store.stats();
  EXPECT_EQ(s.disk_hits, 3u);
  EXPECT_EQ(s.waits, 0u);
  EXPECT_EQ(s.loader_wait_us, 0u);
  EXPECT_EQ(s.disk_bytes_read, 3 * kExpertBytes);
}

TEST(ExpertStore, AcquireOfAnExpertBeingReadWaitsForThatReadInsteadOfASecondOne) {
  std::promise<void> release_read;
  std::shared_future<void> may_finish = release_read.get_future().share();
  std::promise<void> read_started;
  std::atomic<int> reads{0};
  ExpertStore store(owned(1, 2),
                    [&](int layer, int expert) {
                      if (++reads == 1) {
                        read_started.set_value();
                        may_finish.wait();
                      }
                      return make_expert(layer, expert);
                    },
                    {.ram_bytes = 8 * kExpertBytes});
  const int wanted[] = {1};
  store.prefetch(0, wanted);
  read_started.get_future().wait();  // the loader is inside the read
  auto acquired = std::async(std::launch::async, [&] { return &store.acquire(0, 1); });
  release_read.set_value();
  expect_expert(*acquired.get(), 0, 1);
  store.release();
  EXPECT_EQ(reads, 1);
  const StoreCounters s = store.stats();
  EXPECT_EQ(s.disk_hits, 1u);
  EXPECT_EQ(s.disk_bytes_read, kExpertBytes);
}

TEST(ExpertStore, UnownedExpertIsAnError) {
  CountingLoader loader;
  ExpertStore store(owned(1, 2), loader.fn(), {.ram_bytes = kExpertBytes});
  EXPECT_THROW(store.acquire(0, 5), std::exception);
  const int wanted[] = {7};
  EXPECT_THROW(store.prefetch(0, wanted), std::exception);
}

// A change of placement while the job runs: gained experts are read in the background and
// pinned (every owned expert resident), lost ones are freed; under a RAM budget a gained expert
// is read on first use.
TEST(ExpertStore, OwnedExpertsGrowAndShrinkWhileRunning) {
  CountingLoader loader;
  ExpertStore store(owned(1, 2), loader.fn(), {});
  EXPECT_EQ(store.pinned_bytes(), 2 * kExpertBytes);
  const std::vector<std::pair<int, int>> gained{{1, 0}, {1, 3}}, lost{{0, 1}};
  store.add_owned(gained);
  store.wait_idle();
  EXPECT_EQ(loader.reads, 4);
  EXPECT_TRUE(store.owns(1, 3));
  EXPECT_TRUE(store.resident(1, 3));
  EXPECT_EQ(store.pinned_bytes(), 4 * kExpertBytes);
  expect_expert(store.acquire(1, 3), 1, 3);
  store.release();
  store.remove_owned(lost);
  EXPECT_FALSE(store.owns(0, 1));
  EXPECT_EQ(store.pinned_bytes(), 3 * kExpertBytes);
  EXPECT_THROW(store.acquire(0, 1), Error);
  EXPECT_EQ(loader.reads, 4);  // nothing read again

  CountingLoader budgeted_loader;
  ExpertStore::Options budget;
  budget.ram_bytes = 2 * kExpertBytes;
  ExpertStore budgeted(owned(1, 3), budgeted_loader.fn(), budget);
  budgeted.add_owned(gained);
  budgeted.wait_idle();
  EXPECT_EQ(budgeted_loader.reads, 0);
  expect_expert(budgeted.acquire(1, 0), 1, 0);
  budgeted.release();
  EXPECT_EQ(budgeted_loader.reads, 1);
  const std::vector<std::pair<int, int>> first{{1, 0}};
  budgeted.remove_owned(first);
  EXPECT_EQ(budgeted.resident_bytes(), 0u);
  EXPECT_FALSE(budgeted.owns(1, 0));
}

// A hint reads in the background like a prefetch, but what it read stays evictable: a wrong
// hint costs a read, never the budget. Experts not owned are skipped.
TEST(ExpertStore, HintedExpertsAreReadAheadAndStayEvictable) {
  CountingLoader loader;
  ExpertStore::Options budget;
  budget.ram_bytes = 2 * kExpertBytes;
  ExpertStore store(owned(1, 6), loader.fn(), budget);
  const int hinted[] = {0, 1, 2, 3, 9};  // 9: not owned
  store.hint(0, hinted);
  store.wait_idle();
  EXPECT_EQ(loader.reads, 4);
  EXPECT_LE(store.resident_bytes(), 2 * kExpertBytes);  // read, then evicted to the budget
  EXPECT_EQ(store.stats().hint_reads, 4u);
  // The last two hinted are resident: acquiring one counts as a hint hit, not a read.
  EXPECT_TRUE(store.resident(0, 3));
  expect_expert(store.acquire(0, 3), 0, 3);
  store.release();
  EXPECT_EQ(loader.reads, 4);
  EXPECT_EQ(store.stats().hint_hits, 1u);
}

}  // namespace
}  // namespace colibri
