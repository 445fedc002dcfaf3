// Buffers on the huge-page arena (common/huge_pages.h): contents kept apart whatever their sizes,
// freed blocks reused by the next buffer of their size and their huge pages given back, the
// arena's accounting, arrays owned through moves.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common/huge_pages.h"

namespace colibri {
namespace {

TEST(WeightBuffers, KeepTheirContentsApart) {
  // Heap-sized, arena chunk-sized (an expert's matrix, a few MiB) and one of a mapping of its own.
  const size_t sizes[] = {100,
                          size_t(70) << 10,
                          size_t(1400) << 10,
                          size_t(3) << 20,
                          size_t(40) << 20,
                          size_t(1400) << 10};
  std::vector<WeightVector<uint8_t>> buffers;
  for (size_t i = 0; i < std::size(sizes); ++i) buffers.emplace_back(sizes[i], uint8_t(i + 1));
  for (size_t i = 0; i < buffers.size(); ++i) {
    const WeightVector<uint8_t>& b = buffers[i];
    EXPECT_TRUE(std::all_of(b.begin(), b.end(), [&](uint8_t v) { return v == uint8_t(i + 1); }))
        << "buffer " << i << " of " << b.size() << " bytes";
    for (size_t j = 0; j < i; ++j) {
      const WeightVector<uint8_t>& o = buffers[j];
      EXPECT_TRUE(b.data() + b.size() <= o.data() || o.data() + o.size() <= b.data())
          << "buffers " << j << " and " << i << " overlap";
    }
  }
  WeightVector<float> grown;
  for (int i = 0; i < 300000; ++i) grown.push_back(float(i));  // reallocated across the threshold
  for (int i = 0; i < 300000; i += 997) ASSERT_EQ(grown[size_t(i)], float(i));
}

TEST(WeightBuffers, AFreedBlockServesTheNextBufferOfItsSize) {
  if (!huge_page_arena_enabled()) GTEST_SKIP() << "AddressSanitizer build: weights on the heap";
  const size_t size = size_t(1400) << 10;
  const HugePageArenaBytes before = huge_page_arena_bytes();
  const uint8_t* first;
  {
    WeightVector<uint8_t> a(size, 7);
    first = a.data();
    EXPECT_EQ(huge_page_arena_bytes().in_use, before.in_use + size);  // whole 4 KiB pages already
    EXPECT_GE(huge_page_arena_bytes().mapped, huge_page_arena_bytes().in_use);
  }
  EXPECT_EQ(huge_page_arena_bytes().in_use, before.in_use);
  WeightVector<uint8_t> b(size);
  EXPECT_EQ(b.data(), first);
  EXPECT_TRUE(std::all_of(b.begin(), b.end(), [](uint8_t v) { return v == 0; }));
  WeightVector<uint8_t> c(size + 1);  // one more page: a block of its own
  EXPECT_NE(c.data(), first);
  EXPECT_EQ(huge_page_arena_bytes().mapped % kHugePageBytes, 0u);
}

// Its whole 2 MiB pages leave RAM (mincore: not resident) while the block waits for reuse.
TEST(WeightBuffers, AFreedBlockGivesItsWholeHugePagesBack) {
  if (!huge_page_arena_enabled()) GTEST_SKIP() << "AddressSanitizer build: weights on the heap";
  const size_t size = size_t(9) << 20;
  uint8_t* p;
  {
    WeightVector<uint8_t> a(size, 1);
    p = a.data();
  }
  const auto begin =
      (reinterpret_cast<uintptr_t>(p) + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const size_t pages = 4 * kHugePageBytes / 4096;  // at least 4 whole huge pages inside 9 MiB
  std::vector<unsigned char> resident(pages);
  ASSERT_EQ(mincore(reinterpret_cast<void*>(begin), 4 * kHugePageBytes, resident.data()), 0);
  EXPECT_EQ(std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return r & 1; }),
            0);
}

TEST(WeightBuffers, ALargeBufferStartsOnAHugePage) {
  if (!huge_page_arena_enabled()) GTEST_SKIP() << "AddressSanitizer build: weights on the heap";
  WeightVector<uint8_t> big(size_t(48) << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % kHugePageBytes, 0u);
}

TEST(WeightBuffers, AHugePageArrayOwnsItsBlockThroughMoves) {
  const size_t n = size_t(3) << 20;  // floats: 12 MiB
  HugePageArray<float> a(n);
  for (size_t i = 0; i < n; i += 1021) a.get()[i] = float(i);
  const float* p = a.get();
  HugePageArray<float> b(std::move(a));
  EXPECT_EQ(b.get(), p);
  EXPECT_EQ(a.get(), nullptr);
  HugePageArray<float> c(16);
  c = std::move(b);
  EXPECT_EQ(c.get(), p);
  for (size_t i = 0; i < n; i += 1021) ASSERT_EQ(c.get()[i], float(i));
}

TEST(WeightBuffers, HugePageBytesAreReadFromTheKernel) {
  EXPECT_GE(huge_page_bytes(), 0) << "/proc/self/smaps_rollup has no AnonHugePages";
}

}  // namespace
}  // namespace colibri
