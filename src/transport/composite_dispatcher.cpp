#include "transport/composite_dispatcher.h"

#include <algorithm>

#include "common/error.h"

namespace colibri {

void combine_partials(PartialDispatcher& dispatcher, View out) {
  if (out.device != Device::kHost || out.type != ElemType::kF32)
    fail("combine_partials writes fp32 host memory");
  dispatcher.wait_partials();
  const int n = dispatcher.exchange_rows(), hidden = dispatcher.exchange_hidden();
  if (out.count < size_t(n) * size_t(hidden)) fail("combine: {} values for {} rows", out.count, n);
  auto* sum = static_cast<float*>(out.data);
  std::vector<uint8_t> started(size_t(n), 0);
  for (size_t i = 0; i < dispatcher.partial_ranks().size(); ++i)
    dispatcher.add_partial(i, sum, started);
  for (int t = 0; t < n; ++t)
    if (!started[size_t(t)]) std::fill_n(sum + size_t(t) * hidden, hidden, 0.0f);
  dispatcher.finish_combine();
}

CompositeDispatcher::CompositeDispatcher(std::vector<Part> parts, int hidden)
    : parts_(std::move(parts)), hidden_(hidden) {
  for (size_t p = 0; p < parts_.size(); ++p) {
    if (!parts_[p].dispatcher) fail("composite dispatcher: part {} has no dispatcher", p);
    for (int rank : parts_[p].ranks) {
      if (rank < 0) fail("composite dispatcher: rank {} in part {}", rank, p);
      if (size_t(rank) >= part_of_.size()) part_of_.resize(size_t(rank) + 1, -1);
      if (part_of_[size_t(rank)] >= 0)
        fail("composite dispatcher: rank {} is in parts {} and {}", rank, part_of_[size_t(rank)],
             p);
      part_of_[size_t(rank)] = int(p);
    }
  }
  for (Exchange& e : exchanges_) e.plans.resize(parts_.size());
}

int CompositeDispatcher::exchange_slots() const {
  int slots = 2;  // exchanges_
  for (const Part& part : parts_) slots = std::min(slots, part.dispatcher->exchange_slots());
  return slots;
}

void CompositeDispatcher::dispatch_slot(int slot, const DispatchPlan& plan, ConstView x) {
  if (slot < 0 || slot >= exchange_slots()) fail("exchange slot {} of {}", slot, exchange_slots());
  Exchange& e = exchanges_[slot];
  e.n_rows = plan.n_rows;
  for (DispatchPlan& sub : e.plans) {
    sub.layer = plan.layer;
    sub.n_rows = plan.n_rows;
    sub.owners.clear();
  }
  for (const OwnerShare& share : plan.owners) {
    const int part =
        share.rank >= 0 && size_t(share.rank) < part_of_.size() ? part_of_[size_t(share.rank)] : -1;
    if (part < 0)
      fail("layer {}: experts placed on rank {}, which no transport serves", plan.layer,
           share.rank);
    e.plans[size_t(part)].owners.push_back(share);  // ascending rank within each part
  }
  e.active.clear();
  for (size_t p = 0; p < parts_.size(); ++p) {
    if (e.plans[p].owners.empty()) continue;
    e.active.push_back(p);
    parts_[p].dispatcher->dispatch_slot(slot, e.plans[p], x);
  }
}

void CompositeDispatcher::combine_slot(int slot, View out) {
  if (out.device != Device::kHost || out.type != ElemType::kF32)
    fail("the composite dispatcher combines into fp32 host memory");
  if (slot < 0 || slot >= exchange_slots()) fail("exchange slot {} of {}", slot, exchange_slots());
  Exchange& e = exchanges_[slot];
  for (size_t p : e.active) {
    parts_[p].dispatcher->select_slot(slot);
    parts_[p].dispatcher->wait_partials();
  }
  const int hidden = hidden_;
  // Every partial of every part as (rank, part, index), in ascending rank.
  struct Source {
    int rank;
    size_t part, index;
  };
  std::vector<Source> sources;
  for (size_t p : e.active) {
    PartialDispatcher& d = *parts_[p].dispatcher;
    if (d.exchange_hidden() != hidden)
      fail("composite dispatcher: part {} has width {}, not {}", p, d.exchange_hidden(), hidden);
    const std::span<const int> ranks = d.partial_ranks();
    for (size_t i = 0; i < ranks.size(); ++i) sources.push_back({ranks[i], p, i});
  }
  std::sort(sources.begin(), sources.end(),
            [](const Source& a, const Source& b) { return a.rank < b.rank; });
  const int n_rows = e.n_rows;
  if (out.count < size_t(n_rows) * size_t(hidden))
    fail("combine: {} values for {} rows", out.count, n_rows);
  auto* sum = static_cast<float*>(out.data);
  row_started_.assign(size_t(n_rows), 0);
  for (const Source& s : sources)
    parts_[s.part].dispatcher->add_partial(s.index, sum, row_started_);
  for (int t = 0; t < n_rows; ++t)
    if (!row_started_[size_t(t)]) std::fill_n(sum + size_t(t) * hidden, hidden, 0.0f);
  for (size_t p : e.active) parts_[p].dispatcher->finish_combine();
  e.active.clear();
}

void CompositeDispatcher::shutdown() {
  for (Part& part : parts_) part.dispatcher->shutdown();
}

std::vector<uint64_t> CompositeDispatcher::slowest_counts() const {
  std::vector<uint64_t> total;
  for (const Part& part : parts_) {
    const std::vector<uint64_t> counts = part.dispatcher->slowest_counts();
    if (counts.size() > total.size()) total.resize(counts.size(), 0);
    for (size_t r = 0; r < counts.size(); ++r) total[r] += counts[r];
  }
  return total;
}

void CompositeDispatcher::change_placement(const PlacementChange& change) {
  for (Part& part : parts_) part.dispatcher->change_placement(change);
}

std::vector<LiveCounters> CompositeDispatcher::live_counters() {
  std::vector<LiveCounters> all;
  for (Part& part : parts_) {
    std::vector<LiveCounters> some = part.dispatcher->live_counters();
    all.insert(all.end(), some.begin(), some.end());
  }
  std::sort(all.begin(), all.end(),
            [](const LiveCounters& a, const LiveCounters& b) { return a.rank < b.rank; });
  return all;
}

void CompositeDispatcher::hint(int layer, std::span<const OwnerHint> hints) {
  for (Part& part : parts_) part.dispatcher->hint(layer, hints);
}

void Dispatcher::change_placement(const PlacementChange&) {
  fail(
      "this transport cannot move experts while the job runs (--repin-every needs the MPI "
      "transport to every expert rank)");
}

void Dispatcher::dispatch_slot(int slot, const DispatchPlan& plan, ConstView x) {
  if (slot != 0) fail("this transport holds one exchange in flight, not slot {}", slot);
  dispatch(plan, x);
}

void Dispatcher::combine_slot(int slot, View out) {
  if (slot != 0) fail("this transport holds one exchange in flight, not slot {}", slot);
  combine(out);
}

void PartialDispatcher::select_slot(int slot) {
  if (slot != 0) fail("this transport holds one exchange in flight, not slot {}", slot);
}

void ExpertChannel::set_idle_work(IdleWork) {
  fail(
      "this rank's transport does no other work while it waits for requests (split linears need "
      "the MPI transport)");
}

}  // namespace colibri
