#include "common/huge_pages.h"

#include <sys/mman.h>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <string>
#include <unordered_map>

namespace colibri {
namespace {

constexpr size_t kArenaMinBytes = size_t(64) << 10;  // smaller buffers: the heap
constexpr size_t kChunkBytes = size_t(64) << 20;
constexpr size_t kBlockAlign = 4096;  // a block's size and start: whole 4 KiB pages

size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

// AddressSanitizer checks heap buffers, not mappings: under it every buffer is on the heap.
#if defined(__has_feature)
#define COLIBRI_HAS_FEATURE(x) __has_feature(x)
#else
#define COLIBRI_HAS_FEATURE(x) 0
#endif
#if defined(__SANITIZE_ADDRESS__) || COLIBRI_HAS_FEATURE(address_sanitizer)
constexpr bool kArena = false;
#else
constexpr bool kArena = true;
#endif

class Arena {
 public:
  void* allocate(size_t bytes) {
    const size_t size = round_up(bytes, kBlockAlign);
    std::lock_guard lock(mutex_);
    auto reuse = free_.find(size);
    if (reuse != free_.end() && !reuse->second.empty()) {
      void* p = reuse->second.back();
      reuse->second.pop_back();
      in_use_ += size;
      return p;
    }
    uint8_t* p;
    if (size > kChunkBytes / 2) {  // a mapping of its own; the current chunk goes on
      p = map(round_up(size, kHugePageBytes));
    } else {
      if (size > left_) {
        next_ = map(kChunkBytes);
        left_ = kChunkBytes;
      }
      p = next_;
      next_ += size;
      left_ -= size;
    }
    in_use_ += size;
    return p;
  }
  void free(void* p, size_t bytes) {
    const size_t size = round_up(bytes, kBlockAlign);
    // Its whole huge pages go back to the system (a page it shares with a neighbour stays, not to
    // split it); they come back zeroed, as huge pages, when the block is used again.
    const auto begin = round_up(reinterpret_cast<uintptr_t>(p), kHugePageBytes);
    const auto end = (reinterpret_cast<uintptr_t>(p) + size) / kHugePageBytes * kHugePageBytes;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
    std::lock_guard lock(mutex_);
    free_[size].push_back(p);
    in_use_ -= size;
  }
  HugePageArenaBytes bytes() {
    std::lock_guard lock(mutex_);
    return {in_use_, mapped_};
  }

 private:
  // `bytes` (a multiple of 2 MiB) at a 2 MiB boundary, advised for huge pages.
  uint8_t* map(size_t bytes) {
    void* m = mmap(nullptr, bytes + kHugePageBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    const auto base = reinterpret_cast<uintptr_t>(m);
    const uintptr_t aligned = round_up(base, kHugePageBytes);
    if (aligned > base) munmap(m, aligned - base);
    const size_t tail = base + bytes + kHugePageBytes - (aligned + bytes);
    if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
#ifdef MADV_HUGEPAGE
    madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
#endif
    mapped_ += bytes;
    return reinterpret_cast<uint8_t*>(aligned);
  }

  std::mutex mutex_;
  uint8_t* next_ = nullptr;
  size_t left_ = 0;
  std::unordered_map<size_t, std::vector<void*>> free_;
  uint64_t in_use_ = 0, mapped_ = 0;
};

// Never destroyed: weights may be freed during static destruction.
Arena& arena() {
  static Arena* const a = new Arena;
  return *a;
}

}  // namespace

void* allocate_on_huge_pages(size_t bytes) {
  if (!kArena || bytes < kArenaMinBytes) return ::operator new(bytes);
  return arena().allocate(bytes);
}

void free_on_huge_pages(void* p, size_t bytes) {
  if (!kArena || bytes < kArenaMinBytes) return ::operator delete(p, bytes);
  arena().free(p, bytes);
}

bool huge_page_arena_enabled() {
  return kArena;
}

HugePageArenaBytes huge_page_arena_bytes() {
  return kArena ? arena().bytes() : HugePageArenaBytes{};
}

long long huge_page_bytes() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string key;
  long long kb = 0;
  while (in >> key) {
    if (key == "AnonHugePages:" && in >> kb) return kb * 1024;
    in.ignore(1 << 20, '\n');
  }
  return -1;
}

}  // namespace colibri
