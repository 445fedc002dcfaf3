// Weights and the KV pool on transparent huge pages. A decode streams every weight once per token
// and gathers cached keys row by row; on 4 KiB pages each page costs a TLB miss and a page walk.
// Buffers of 64 KiB and more are carved one after another from 2 MiB-aligned chunks advised
// MADV_HUGEPAGE before anything touches them, so that even an expert's 1.4 MiB matrices share
// huge pages with their neighbours (a buffer of its own would hold no whole aligned 2 MiB page).
// Where THP is off the memory works the same on 4 KiB pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>
#include <vector>

namespace colibri {

inline constexpr size_t kHugePageBytes = size_t(2) << 20;

// `bytes` from the huge-page arena for 64 KiB and more (uninitialised; fresh pages read as zero),
// from the heap otherwise. A freed block's whole huge pages go back to the system and the block
// serves the next request of its size (an expert tier's evictions and loads). Thread-safe.
void* allocate_on_huge_pages(size_t bytes);
void free_on_huge_pages(void* p, size_t bytes);

// The std::allocator of weight buffers.
template <typename T>
struct WeightAllocator {
  using value_type = T;
  WeightAllocator() = default;
  template <typename U>
  WeightAllocator(const WeightAllocator<U>&) {}
  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(allocate_on_huge_pages(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) { free_on_huge_pages(p, n * sizeof(T)); }
  friend bool operator==(const WeightAllocator&, const WeightAllocator&) { return true; }
};
template <typename T>
using WeightVector = std::vector<T, WeightAllocator<T>>;

// An owned array of n T on the arena, not initialised: its pages are touched as it is written
// (the KV pool).
template <typename T>
class HugePageArray {
 public:
  HugePageArray() = default;
  explicit HugePageArray(size_t n)
      : data_(static_cast<T*>(allocate_on_huge_pages(n * sizeof(T)))), n_(n) {}
  HugePageArray(HugePageArray&& o) noexcept : data_(o.data_), n_(o.n_) { o.data_ = nullptr; }
  HugePageArray& operator=(HugePageArray&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~HugePageArray() {
    if (data_) free_on_huge_pages(data_, n_ * sizeof(T));
  }
  T* get() const { return data_; }

 private:
  T* data_ = nullptr;
  size_t n_ = 0;
};

// False under AddressSanitizer, which checks heap buffers only: every buffer is then on the heap.
bool huge_page_arena_enabled();

// The arena now: bytes handed out and not freed, and bytes mapped for it.
struct HugePageArenaBytes {
  uint64_t in_use = 0, mapped = 0;
};
HugePageArenaBytes huge_page_arena_bytes();

// This process's anonymous memory on huge pages now (AnonHugePages), -1 where unknown.
long long huge_page_bytes();

}  // namespace colibri
