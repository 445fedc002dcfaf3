// Weights on transparent huge pages. A decode streams every weight once per token; on 4 KiB pages
// each page costs a TLB miss and a page walk. Weight buffers of 64 KiB and more (WeightVector)
// are carved one after another from 2 MiB-aligned chunks advised MADV_HUGEPAGE before anything
// touches them, so that even an expert's 1.4 MiB matrices share huge pages with their neighbours
// (a buffer of its own would hold no whole aligned 2 MiB page). Where THP is off the memory
// works the same on 4 KiB pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace colibri {

inline constexpr size_t kHugePageBytes = size_t(2) << 20;

// `bytes` for a weight buffer: from the huge-page arena for 64 KiB and more, whose freed blocks
// are kept for the next buffer of the same size (an expert tier's evictions and loads; the
// memory is not returned to the system); the heap otherwise. Thread-safe.
void* allocate_weight_bytes(size_t bytes);
void free_weight_bytes(void* p, size_t bytes);

// The std::allocator of weight buffers.
template <typename T>
struct WeightAllocator {
  using value_type = T;
  WeightAllocator() = default;
  template <typename U>
  WeightAllocator(const WeightAllocator<U>&) {}
  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(allocate_weight_bytes(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) { free_weight_bytes(p, n * sizeof(T)); }
  friend bool operator==(const WeightAllocator&, const WeightAllocator&) { return true; }
};
template <typename T>
using WeightVector = std::vector<T, WeightAllocator<T>>;

// False under AddressSanitizer, which checks heap buffers only: every buffer is then on the heap.
bool weight_arena_enabled();

// The arena now: bytes handed out and not freed, and bytes mapped for it.
struct WeightArenaBytes {
  uint64_t in_use = 0, mapped = 0;
};
WeightArenaBytes weight_arena_bytes();

// This process's anonymous memory on huge pages now (AnonHugePages), -1 where unknown.
long long huge_page_bytes();

}  // namespace colibri
