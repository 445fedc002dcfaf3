#include "rank/expert_store.h"

#include <iterator>

#include "common/error.h"

namespace colibri {

namespace {
using Clock = std::chrono::steady_clock;
uint64_t elapsed_us(Clock::time_point since) {
  return uint64_t(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - since).count());
}
}  // namespace

ExpertStore::ExpertStore(std::vector<std::pair<int, int>> owned, LoadFn load, Options options)
    : load_(std::move(load)), options_(options), all_resident_(options.ram_bytes == 0) {
  for (const auto& [layer, expert] : owned) entries_[key(layer, expert)];
  for (const auto& [layer, expert] : owned) {
    Entry& e = entries_[key(layer, expert)];
    if (!all_resident_ && pinned_bytes_ >= options_.pin_bytes) break;
    e.weights = load_(layer, expert);
    e.state = State::ready;
    e.pinned = true;
    pinned_bytes_ += e.weights.bytes();
  }
  if (!all_resident_) loader_ = std::thread([this] { loader_main(); });
}

ExpertStore::~ExpertStore() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (loader_.joinable()) loader_.join();
}

bool ExpertStore::owns(int layer, int expert) const {
  return entries_.count(key(layer, expert)) != 0;
}

ExpertStore::Entry& ExpertStore::entry(int layer, int expert) {
  const auto it = entries_.find(key(layer, expert));
  if (it == entries_.end())
    fail("expert {} of layer {} is routed here but not owned", expert, layer);
  return it->second;
}

bool ExpertStore::resident(int layer, int expert) const {
  std::lock_guard lock(mutex_);
  const auto it = entries_.find(key(layer, expert));
  return it != entries_.end() && it->second.state == State::ready;
}

uint64_t ExpertStore::resident_bytes() const {
  std::lock_guard lock(mutex_);
  return cached_bytes_;
}

StoreCounters ExpertStore::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void ExpertStore::load_locked(std::unique_lock<std::mutex>& lock, uint64_t k, Entry& e) {
  e.state = State::loading;
  const int layer = int(k >> 32), expert = int(uint32_t(k));
  lock.unlock();
  const auto start = Clock::now();
  MlpWeights weights;
  try {
    weights = load_(layer, expert);
  } catch (...) {
    lock.lock();
    e.state = State::absent;
    changed_.notify_all();
    throw;
  }
  const uint64_t us = elapsed_us(start);
  lock.lock();
  e.weights = std::move(weights);
  e.state = State::ready;
  stats_.disk_bytes_read += e.weights.bytes();
  stats_.loader_us += us;
  if (e.pin_when_ready) {
    e.pinned = true;
    pinned_bytes_ += e.weights.bytes();
  } else {
    e.from_disk = true;
    if (e.hinted) ++stats_.hint_reads;
    cached_bytes_ += e.weights.bytes();
    lru_.push_front(k);
    e.lru = lru_.begin();
    evict_locked();
  }
  changed_.notify_all();
}

// Drops least recently used experts until the cache fits its budget. Experts acquired for the
// current request, and those read but not yet acquired, stay: the cache may exceed its budget by
// the experts of one request in flight.
void ExpertStore::evict_locked() {
  for (auto it = lru_.end(); cached_bytes_ > options_.ram_bytes && it != lru_.begin();) {
    --it;
    Entry& e = entries_.at(*it);
    if (e.in_use || (e.from_disk && !e.hinted)) continue;
    cached_bytes_ -= e.weights.bytes();
    e.weights = MlpWeights{};
    e.state = State::absent;
    e.from_disk = e.hinted = false;
    it = lru_.erase(it);
  }
}

const MlpWeights& ExpertStore::acquire(int layer, int expert) {
  std::unique_lock lock(mutex_);
  const uint64_t k = key(layer, expert);
  Entry& e = entry(layer, expert);
  if (e.pinned) {
    ++stats_.pinned_hits;
    return e.weights;
  }
  if (e.state != State::ready) {
    const auto start = Clock::now();
    ++stats_.waits;
    if (e.state == State::absent) {
      load_locked(lock, k, e);
    } else {
      changed_.wait(lock, [&] { return e.state == State::ready || e.state == State::absent; });
      if (e.state == State::absent)
        load_locked(lock, k, e);  // the loader's read failed or was evicted
    }
    stats_.loader_wait_us += elapsed_us(start);
    if (e.pinned) {  // gained while running: read now, pinned from here on
      ++stats_.disk_hits;
      return e.weights;
    }
  }
  if (e.from_disk) {
    ++stats_.disk_hits;
    if (e.hinted) ++stats_.hint_hits;
    e.from_disk = e.hinted = false;
  } else {
    ++stats_.ram_hits;
  }
  lru_.splice(lru_.begin(), lru_, e.lru);
  if (!e.in_use) {
    e.in_use = true;
    acquired_.push_back(k);
  }
  return e.weights;
}

void ExpertStore::prefetch(int layer, std::span<const int> experts) {
  if (all_resident_) return;
  {
    std::lock_guard lock(mutex_);
    // Ahead of any hinted reads: these are wanted now.
    auto at = queue_.begin();
    for (int expert : experts) {
      Entry& e = entry(layer, expert);
      if (e.state == State::queued && e.hinted) e.hinted = false;  // wanted now, held for it
      if (e.state != State::absent) continue;
      e.state = State::queued;
      at = std::next(queue_.insert(at, key(layer, expert)));
    }
  }
  changed_.notify_all();
}

void ExpertStore::hint(int layer, std::span<const int> experts) {
  if (all_resident_) return;
  {
    std::lock_guard lock(mutex_);
    for (int expert : experts) {
      const auto it = entries_.find(key(layer, expert));
      if (it == entries_.end() || it->second.state != State::absent) continue;
      it->second.state = State::queued;
      it->second.hinted = true;
      queue_.push_back(it->first);
    }
  }
  changed_.notify_all();
}

void ExpertStore::release() {
  std::lock_guard lock(mutex_);
  for (uint64_t k : acquired_) entries_.at(k).in_use = false;
  acquired_.clear();
  evict_locked();
}

void ExpertStore::wait_idle() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return queue_.empty() && !loader_busy_; });
}

void ExpertStore::add_owned(std::span<const std::pair<int, int>> experts) {
  {
    std::lock_guard lock(mutex_);
    for (const auto& [layer, expert] : experts) {
      const uint64_t k = key(layer, expert);
      if (entries_.count(k)) continue;
      Entry& e = entries_[k];
      if (!all_resident_) continue;  // read when first routed here
      e.pin_when_ready = true;
      e.state = State::queued;
      queue_.push_back(k);
    }
    if (all_resident_ && !loader_.joinable()) loader_ = std::thread([this] { loader_main(); });
  }
  changed_.notify_all();
}

void ExpertStore::remove_owned(std::span<const std::pair<int, int>> experts) {
  std::unique_lock lock(mutex_);
  for (const auto& [layer, expert] : experts) {
    const auto it = entries_.find(key(layer, expert));
    if (it == entries_.end()) continue;
    Entry& e = it->second;
    changed_.wait(lock, [&] { return e.state != State::loading; });
    if (e.in_use) fail("expert {} of layer {} is dropped while a request uses it", expert, layer);
    if (e.state == State::ready && e.pinned) {
      pinned_bytes_ -= e.weights.bytes();
    } else if (e.state == State::ready) {
      cached_bytes_ -= e.weights.bytes();
      lru_.erase(e.lru);
    }
    entries_.erase(it);
  }
}

void ExpertStore::loader_main() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const uint64_t k = queue_.front();
    queue_.pop_front();
    const auto it = entries_.find(k);
    if (it == entries_.end()) continue;  // no longer held
    Entry& e = it->second;
    if (e.state != State::queued) continue;  // read on demand meanwhile
    loader_busy_ = true;
    try {
      load_locked(lock, k, e);
    } catch (...) {
      // The acquire that needs this expert reads it again and reports the error.
    }
    loader_busy_ = false;
    changed_.notify_all();
  }
}

}  // namespace colibri
