// The routed experts a rank owns, held in tiers: pinned (loaded at start, never evicted), a RAM
// cache bounded by a byte budget with least-recently-used eviction, and the checkpoint on disk.
// One background loader thread reads prefetched experts while resident ones compute.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/profile.h"
#include "model/weights.h"

namespace colibri {

class ExpertStore {
 public:
  // Reads expert `expert` of `layer` from the checkpoint. Called from the loader thread.
  using LoadFn = std::function<MlpWeights(int layer, int expert)>;

  struct Options {
    uint64_t ram_bytes = 0;  // budget of the RAM cache; 0 = every owned expert resident
    uint64_t pin_bytes = 0;  // experts pinned at start, in `owned` order, up to this many bytes
  };

  // `owned`: the (layer, expert) pairs of this rank. With ram_bytes == 0 all are loaded here.
  ExpertStore(std::vector<std::pair<int, int>> owned, LoadFn load, Options options);
  ~ExpertStore();
  ExpertStore(const ExpertStore&) = delete;
  ExpertStore& operator=(const ExpertStore&) = delete;

  // The weights of an owned expert, read on a miss; an expert being read is waited for, not
  // read twice. The reference stays valid until release(): acquired experts are not evicted.
  const MlpWeights& acquire(int layer, int expert);
  // Queues reads of the experts not resident; returns at once. Each prefetched expert is meant to
  // be acquired: until then it is not evicted.
  void prefetch(int layer, std::span<const int> experts);
  // A hint of experts likely acquired soon (the next layer's predicted routing): those owned and
  // not resident are queued for the loader, and once read they are evictable as any other (a
  // wrong hint costs a read, never the budget). Experts not owned here are skipped.
  void hint(int layer, std::span<const int> experts);
  // Ends a request: the experts acquired since the last release become evictable.
  void release();
  // Blocks until the loader has nothing queued or in progress.
  void wait_idle();
  // A change of placement, between requests: experts this rank now holds (read in the background
  // and pinned when every owned expert is resident; read on first use under a RAM budget), and
  // experts it no longer holds (freed; one being read is waited for first).
  void add_owned(std::span<const std::pair<int, int>> experts);
  void remove_owned(std::span<const std::pair<int, int>> experts);

  bool owns(int layer, int expert) const;
  bool resident(int layer, int expert) const;  // pinned or in the RAM cache
  uint64_t resident_bytes() const;             // RAM cache, not pinned
  uint64_t pinned_bytes() const { return pinned_bytes_; }
  StoreCounters stats() const;

 private:
  enum class State { absent, queued, loading, ready };
  struct Entry {
    MlpWeights weights;
    State state = State::absent;
    bool pinned = false;
    bool in_use = false;     // acquired since the last release()
    bool from_disk = false;  // read after start-up and not yet acquired; not evicted until then
    bool pin_when_ready = false;        // gained while running with every owned expert resident
    bool hinted = false;                // queued by hint(): read, it is not held for an acquire
    std::list<uint64_t>::iterator lru;  // valid when state == ready and !pinned
  };
  static uint64_t key(int layer, int expert) {
    return (uint64_t(uint32_t(layer)) << 32) | uint32_t(expert);
  }
  Entry& entry(int layer, int expert);
  // Reads outside the lock, then stores the result; `lock` is held on entry and exit.
  void load_locked(std::unique_lock<std::mutex>& lock, uint64_t k, Entry& e);
  void evict_locked();
  void loader_main();

  LoadFn load_;
  Options options_;
  bool all_resident_;
  uint64_t pinned_bytes_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::unordered_map<uint64_t, Entry> entries_;  // node-based: references stay valid
  std::list<uint64_t> lru_;                      // front = most recently used, unpinned ready
  uint64_t cached_bytes_ = 0;
  std::deque<uint64_t> queue_;
  bool loader_busy_ = false, stop_ = false;
  std::vector<uint64_t> acquired_;
  StoreCounters stats_;
  std::thread loader_;
};

}  // namespace colibri
