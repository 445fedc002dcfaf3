#include "transport/mpi_dispatcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "common/serialize.h"
#include "transport/deadline.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr size_t kHeaderBytes = sizeof(wire::Header);

void require_host_f32(ConstView v, const char* what) {
  if (v.device != Device::kHost || v.type != ElemType::kF32)
    fail("the MPI transport takes {} as fp32 host memory", what);
}

}  // namespace

MpiDispatcher::MpiDispatcher(MPI_Comm comm, const ExchangeShape& shape, int coordinator,
                             Profiler& profiler, const MpiTransportOptions& options)
    : comm_(comm),
      shape_(shape),
      coordinator_(coordinator),
      profiler_(profiler),
      options_(options),
      elem_bytes_(elem_bytes(options.wire_type)),
      heartbeat_(comm, MpiTopology(comm_size(comm), coordinator, options).served_ranks(),
                 options.heartbeat_s, options.rank_timeout_s) {
  const int size = comm_size(comm_);
  const MpiTopology topology(size, coordinator_, options_);
  const size_t max_pairs = size_t(shape_.max_rows) * size_t(shape_.top_k);
  request_bytes_ =
      kHeaderBytes + wire::request_payload_bytes(uint32_t(shape_.max_rows), uint32_t(max_pairs),
                                                 shape_.hidden, elem_bytes_);
  reply_bytes_ = kHeaderBytes +
                 wire::reply_payload_bytes(uint32_t(shape_.max_rows), shape_.hidden, elem_bytes_);
  owner_peer_.assign(size_t(size), -1);
  slowest_.assign(size_t(size), 0);
  for (int r : topology.served_ranks()) {
    owner_peer_[size_t(r)] = int(peers_.size());
    Peer& peer = peers_.emplace_back();
    peer.rank = r;
    peer.slots[0].send.resize(request_bytes_);
    peer.slots[0].recv.resize(reply_bytes_);
    peer.remote = topology.remote(r);
  }
  for (Peer& peer : peers_) {
    const std::vector<int> group = topology.host_group(peer.rank);
    if (group.empty()) continue;
    peer.leader = owner_peer_[size_t(group.front())];
    if (group.front() == peer.rank)
      for (int q : group) peer.members.push_back(owner_peer_[size_t(q)]);
  }
  row_marks_.assign(size_t(shape_.max_rows), 0);
  row_f32_.resize(size_t(shape_.hidden));
  // The segments of the expert ranks on this host that reply to it directly.
  std::vector<int> ranks;
  std::vector<bool> share;
  for (const Peer& peer : peers_) {
    ranks.push_back(peer.rank);
    share.push_back(topology.shares_segment(peer.rank));
  }
  const size_t area =
      shared_area_bytes(size_t(shape_.max_rows), size_t(shape_.hidden) * elem_bytes_);
  std::vector<SharedSegment> segments =
      map_shared_segments(comm_, ranks, share, area, options_.setup_timeout_s);
  for (size_t i = 0; i < peers_.size(); ++i) peers_[i].segment = std::move(segments[i]);
}

MpiDispatcher::~MpiDispatcher() {
  heartbeat_.stop();
}

void MpiDispatcher::wait_all(std::vector<MPI_Request*>& requests,
                             const std::vector<int>& peer_ranks, const char* what, int layer) {
  wait_within(requests, peer_ranks, options_.rank_timeout_s, what,
              fmt::format(" in the layer {} exchange", layer), "--rank-timeout");
}

void MpiDispatcher::choose_peers(const DispatchPlan& plan) {
  Exchange& e = exchange();
  for (Peer& peer : peers_) peer.slots[current_].share = nullptr;
  for (const OwnerShare& share : plan.owners) {
    const int index = share.rank >= 0 && size_t(share.rank) < owner_peer_.size()
                          ? owner_peer_[size_t(share.rank)]
                          : -1;
    if (index < 0)
      fail("layer {}: experts placed on rank {}, which is not an expert rank", plan.layer,
           share.rank);
    peers_[size_t(index)].slots[current_].share = &share;
  }
  // With host combine, every expert rank of a host with work gets a request (an empty one when
  // it has no rows), so that its leader knows whom to wait for.
  const auto host_has_work = [&](const Peer& peer) {
    if (peer.leader < 0) return false;
    for (int m : peers_[size_t(peer.leader)].members)
      if (const OwnerShare* s = peers_[size_t(m)].slots[current_].share; s && s != &empty_share_)
        return true;
    return false;
  };
  e.active.clear();
  e.repliers.clear();
  for (size_t index = 0; index < peers_.size(); ++index) {
    Peer& peer = peers_[index];
    PeerSlot& slot = peer.slots[current_];
    if (!slot.share && !host_has_work(peer)) continue;
    if (!slot.share) slot.share = &empty_share_;
    e.active.push_back(&peer);
    ++peer.in_flight;
    heartbeat_.set_busy(index, true);
    slot.replies = peer.leader < 0 || peer.leader == int(index);
    if (peer.leader == int(index)) {  // the union of its host's rows, ascending
      slot.reply_rows.clear();
      for (int m : peer.members) {
        const OwnerShare* member = peers_[size_t(m)].slots[current_].share;
        if (member)
          for (int row : member->rows) row_marks_[size_t(row)] = 1;
      }
      for (int row = 0; row < plan.n_rows; ++row)
        if (row_marks_[size_t(row)]) {
          slot.reply_rows.push_back(row);
          row_marks_[size_t(row)] = 0;
        }
    } else if (slot.replies) {
      slot.reply_rows.assign(slot.share->rows.begin(), slot.share->rows.end());
    }
    if (slot.replies) e.repliers.push_back(&peer);
  }
}

void MpiDispatcher::send_request(Peer& peer, const float* x, int layer) {
  PeerSlot& slot = peer.slots[current_];
  if (slot.send.empty()) {
    slot.send.resize(request_bytes_);
    slot.recv.resize(reply_bytes_);
  }
  const OwnerShare& share = *slot.share;
  const int hidden = shape_.hidden;
  const size_t row_bytes = size_t(hidden) * elem_bytes_;
  const uint32_t n_rows = uint32_t(share.rows.size()), n_pairs = uint32_t(share.pairs.size());
  if (n_pairs > size_t(shape_.max_rows) * size_t(shape_.top_k))
    fail("{} routed pairs exceed the exchange buffers", n_pairs);
  // One segment per peer: slot 0 uses it, slot 1 sends its rows in the message.
  const bool shared = current_ == 0 && peer.segment.mapped();
  slot.shared = shared;
  std::byte* payload = slot.send.data() + kHeaderBytes;
  std::byte* rows = shared ? peer.segment.request_rows() : payload;
  // Each row is checksummed as it is written.
  wire::Checksum rows_sum;
  for (uint32_t r = 0; r < n_rows; ++r)
    wire::write_summed(x + size_t(share.rows[r]) * hidden, size_t(hidden), options_.wire_type,
                       rows + r * row_bytes, rows_sum);
  std::byte* pairs = shared ? payload : payload + n_rows * row_bytes;
  for (uint32_t i = 0; i < n_pairs; ++i) {
    const wire::Pair pair{share.pairs[i].row, share.pairs[i].expert, share.pairs[i].weight};
    std::memcpy(pairs + size_t(i) * sizeof(wire::Pair), &pair, sizeof(wire::Pair));
  }
  std::byte* row_indices = pairs + size_t(n_pairs) * sizeof(wire::Pair);
  for (uint32_t r = 0; r < n_rows; ++r) {
    const auto row = uint32_t(share.rows[r]);
    std::memcpy(row_indices + size_t(r) * sizeof(row), &row, sizeof(row));
  }
  const size_t payload_bytes =
      shared ? wire::shared_request_payload_bytes(n_rows, n_pairs)
             : wire::request_payload_bytes(n_rows, n_pairs, hidden, elem_bytes_);
  uint32_t sum = 0;
  if (shared) {
    sum = wire::shared_checksum(rows_sum.value(), wire::checksum(payload, payload_bytes));
  } else {  // the pairs and row indices follow the rows
    rows_sum.add(pairs, payload_bytes - n_rows * row_bytes);
    sum = rows_sum.value();
  }
  const wire::Header header =
      wire::make_header(shared ? wire::Opcode::kSharedRequest : wire::Opcode::kExpertRequest,
                        ++peer.sequence, layer, n_rows, n_pairs, uint32_t(payload_bytes), sum);
  slot.sequence = peer.sequence;
  std::memcpy(slot.send.data(), &header, kHeaderBytes);
  // The reply receive is posted before the request leaves. A peer answers its requests in the
  // order they were sent, and MPI matches its replies to these receives in the order they were
  // posted: each slot's reply lands in its own buffer.
  if (slot.replies)
    CHECK_MPI(MPI_Irecv(slot.recv.data(), int(slot.recv.size()), MPI_BYTE, peer.rank,
                        wire::kTagReply, comm_, &slot.recv_request));
  CHECK_MPI(MPI_Isend(slot.send.data(), int(kHeaderBytes + payload_bytes), MPI_BYTE, peer.rank,
                      wire::kTagRequest, comm_, &slot.send_request));
  // Counted as the bytes of the request, wherever its rows went.
  const size_t sent = kHeaderBytes + payload_bytes + (shared ? n_rows * row_bytes : 0);
  RankReport& counters = profiler_.counters();
  counters.rows += n_rows;
  counters.experts += n_pairs;
  counters.bytes_out += sent;
  counters.bytes_to_rank[peer.rank] += sent;
  if (shared) counters.bytes_shared += n_rows * row_bytes;
  if (peer.remote) counters.bytes_cross_host += sent;
}

void MpiDispatcher::dispatch_slot(int slot, const DispatchPlan& plan, ConstView x) {
  auto scope = profiler_.scope(Phase::kDispatch, plan.layer);
  require_host_f32(x, "dispatched rows");
  if (slot < 0 || slot >= exchange_slots()) fail("exchange slot {} of {}", slot, exchange_slots());
  if (exchanges_[slot].open)
    fail("layer {}: slot {} still holds the layer {} exchange", plan.layer, slot,
         exchanges_[slot].layer);
  const int n = plan.n_rows;
  if (n > shape_.max_rows)
    fail("{} rows exceed the exchange buffers sized for {} rows", n, shape_.max_rows);
  if (x.count < size_t(n) * shape_.hidden) fail("dispatch: {} values for {} rows", x.count, n);
  current_ = slot;
  Exchange& e = exchange();
  e.layer = plan.layer;
  e.n_rows = n;
  e.open = true;
  choose_peers(plan);
  for (Peer* peer : e.active) send_request(*peer, static_cast<const float*>(x.data), plan.layer);
  e.dispatched_us = profiler_.now_us();
}

void MpiDispatcher::validate_reply(Peer& peer, int count_bytes) {
  PeerSlot& slot = peer.slots[current_];
  const int layer = exchange().layer;
  wire::ReplyCheck check;
  check.expected_sequence = slot.sequence;
  check.layer = layer;
  check.n_rows = uint32_t(slot.reply_rows.size());
  check.hidden = shape_.hidden;
  check.elem_bytes = elem_bytes_;
  wire::Header h;
  const std::string problem = wire::check_reply_header(
      slot.recv.data(), size_t(std::max(count_bytes, 0)), check, slot.shared, h);
  slot.reply_checksum = h.checksum;
  if (!problem.empty())
    abort_job(fmt::format("corrupted reply from {} in layer {}: {}",
                          rank_identity().name_of(peer.rank), layer, problem));
}

void MpiDispatcher::select_slot(int slot) {
  if (slot < 0 || slot >= exchange_slots() || !exchanges_[slot].open)
    fail("no exchange in slot {}", slot);
  current_ = slot;
}

void MpiDispatcher::combine_slot(int slot, View out) {
  require_host_f32(out, "the combined partials");
  select_slot(slot);
  wait_partials();
  {
    const Exchange& e = exchange();
    auto scope = profiler_.scope(Phase::kCombine, e.layer);
    auto* sum = static_cast<float*>(out.data);
    const int hidden = shape_.hidden;
    row_started_.assign(size_t(e.n_rows), 0);
    for (size_t i = 0; i < e.repliers.size(); ++i)  // ascending rank: a fixed summation order
      add_partial(i, sum, row_started_);
    for (int t = 0; t < e.n_rows; ++t)  // rows no owner was sent
      if (!row_started_[size_t(t)]) std::fill_n(sum + size_t(t) * hidden, hidden, 0.0f);
  }
  finish_combine();
}

void MpiDispatcher::wait_partials() {
  Exchange& e = exchange();
  const int layer = e.layer;
  std::vector<MPI_Request*> requests;
  std::vector<int> ranks;
  std::vector<double> limits;  // a host leader waits for its host-mates first: it names them
  for (Peer* peer : e.repliers) {
    requests.push_back(&peer->slots[current_].recv_request);
    ranks.push_back(peer->rank);
    limits.push_back(options_.rank_timeout_s + (peer->leader >= 0 ? kAbortTeardownSeconds : 0));
  }
  auto scope = profiler_.scope(Phase::kWaitSlowest, layer);
  std::vector<MPI_Status> statuses(requests.size());
  WaitClock clock;
  Backoff backoff;
  size_t remaining = requests.size();
  int last = -1;
  std::vector<int> counts(requests.size(), 0);
  while (remaining > 0) {
    // Partials found in one sweep arrived at one time as far as this loop can tell: the same
    // reply time for each (a tie, not an order by rank).
    const double seen_us = profiler_.now_us();
    for (size_t i = 0; i < requests.size(); ++i) {
      if (*requests[i] == MPI_REQUEST_NULL) continue;
      int done = 0;
      CHECK_MPI(MPI_Test(requests[i], &done, &statuses[i]));
      if (!done) continue;
      CHECK_MPI(MPI_Get_count(&statuses[i], MPI_BYTE, &counts[i]));
      const auto index = size_t(owner_peer_[size_t(ranks[i])]);
      std::vector<int> heard{int(index)};
      if (peers_[index].leader == int(index)) heard = peers_[index].members;
      for (int h : heard) {
        heartbeat_.heard(size_t(h));
        Peer& p = peers_[size_t(h)];
        if (p.in_flight > 0) --p.in_flight;
        if (p.in_flight == 0) heartbeat_.set_busy(size_t(h), false);
      }
      profiler_.add_reply(layer, ranks[i], seen_us - e.dispatched_us);
      last = int(i);
      --remaining;
    }
    if (remaining == 0) break;
    const double elapsed = clock.elapsed();
    for (size_t i = 0; i < requests.size(); ++i)
      if (*requests[i] != MPI_REQUEST_NULL && elapsed > limits[i])
        abort_job(fmt::format(
            "{} is silent: no reply within {:.1f} s in the layer {} exchange (--rank-timeout)",
            rank_identity().name_of(ranks[i]), options_.rank_timeout_s, layer));
    backoff.pause();
  }
  if (last >= 0) ++slowest_[size_t(ranks[size_t(last)])];
  for (size_t i = 0; i < e.repliers.size(); ++i) validate_reply(*e.repliers[i], counts[i]);
  e.replier_ranks = ranks;
}

void MpiDispatcher::add_partial(size_t i, float* sum, std::span<uint8_t> started) {
  const Peer* peer = exchange().repliers.at(i);
  const PeerSlot& slot = peer->slots[current_];
  const int layer = exchange().layer;
  const int hidden = shape_.hidden;
  const size_t row_bytes = size_t(hidden) * elem_bytes_;
  const std::byte* partial =
      slot.shared ? peer->segment.reply_rows() : slot.recv.data() + kHeaderBytes;
  const std::vector<int>& rows = slot.reply_rows;
  // The rows are checksummed as they are added (the reply's header was checked on arrival); a
  // mismatch found after adding ends the job all the same.
  wire::Checksum rows_sum;
  for (size_t r = 0; r < rows.size(); ++r) {
    float* dst = sum + size_t(rows[r]) * hidden;
    const bool first = !started[size_t(rows[r])];
    if (options_.wire_type == ElemType::kF32) {  // one pass
      rows_sum.add_accumulate(dst, partial + r * row_bytes, size_t(hidden), first);
    } else {
      rows_sum.add(partial + r * row_bytes, row_bytes);
      to_f32({partial + r * row_bytes, options_.wire_type, Device::kHost, size_t(hidden)},
             row_f32_.data());
      wire::add_row(dst, row_f32_.data(), size_t(hidden), first);
    }
    started[size_t(rows[r])] = 1;
  }
  if (rows_sum.value() != slot.reply_checksum)
    abort_job(fmt::format("corrupted reply from {} in layer {}: payload checksum mismatch",
                          rank_identity().name_of(peer->rank), layer));
  const size_t reply_bytes =
      kHeaderBytes + wire::reply_payload_bytes(uint32_t(rows.size()), hidden, elem_bytes_);
  RankReport& counters = profiler_.counters();
  counters.bytes_in += reply_bytes;
  if (slot.shared) counters.bytes_shared += reply_bytes - kHeaderBytes;
  if (peer->remote) counters.bytes_cross_host += reply_bytes;
}

void MpiDispatcher::finish_combine() {
  Exchange& e = exchange();
  std::vector<MPI_Request*> sends;
  std::vector<int> send_ranks;
  for (Peer* peer : e.active) {
    sends.push_back(&peer->slots[current_].send_request);
    send_ranks.push_back(peer->rank);
  }
  wait_all(sends, send_ranks, "request delivery", e.layer);
  for (Peer* peer : e.active) peer->slots[current_].share = nullptr;
  e.open = false;
}

void MpiDispatcher::hint(int layer, std::span<const OwnerHint> hints) {
  for (const OwnerHint& h : hints) {
    const int index = size_t(h.rank) < owner_peer_.size() ? owner_peer_[size_t(h.rank)] : -1;
    if (index < 0 || h.experts.empty()) continue;
    Peer& peer = peers_[size_t(index)];
    if (peer.hint_request != MPI_REQUEST_NULL) {
      std::vector<MPI_Request*> previous{&peer.hint_request};
      wait_all(previous, {peer.rank}, "hint delivery", layer);
    }
    const size_t bytes = h.experts.size() * 4;
    if (kHeaderBytes + bytes > peer.slots[0].send.size())
      continue;  // larger than its receive buffer
    peer.hint.resize(kHeaderBytes + bytes);
    for (size_t i = 0; i < h.experts.size(); ++i) {
      const auto expert = uint32_t(h.experts[i]);
      std::memcpy(peer.hint.data() + kHeaderBytes + 4 * i, &expert, 4);
    }
    const wire::Header header = wire::make_header(
        wire::Opcode::kPrefetchHint, ++peer.sequence, layer, 0, uint32_t(h.experts.size()),
        uint32_t(bytes), wire::checksum(peer.hint.data() + kHeaderBytes, bytes));
    std::memcpy(peer.hint.data(), &header, kHeaderBytes);
    CHECK_MPI(MPI_Isend(peer.hint.data(), int(kHeaderBytes + bytes), MPI_BYTE, peer.rank,
                        wire::kTagRequest, comm_, &peer.hint_request));
    profiler_.counters().bytes_out += kHeaderBytes + bytes;
  }
}

void MpiDispatcher::send_to_all(const std::function<size_t(Peer&)>& write, const char* what) {
  std::vector<MPI_Request*> sends;
  std::vector<int> ranks;
  for (Peer& peer : peers_) {
    const size_t bytes = write(peer);
    PeerSlot& slot = peer.slots[0];
    CHECK_MPI(MPI_Isend(slot.send.data(), int(bytes), MPI_BYTE, peer.rank, wire::kTagRequest, comm_,
                        &slot.send_request));
    sends.push_back(&slot.send_request);
    ranks.push_back(peer.rank);
  }
  wait_all(sends, ranks, what, -1);
}

void MpiDispatcher::shutdown() {
  heartbeat_.stop();
  std::vector<MPI_Request*> hints;
  std::vector<int> ranks;
  for (Peer& peer : peers_)
    if (peer.hint_request != MPI_REQUEST_NULL) {
      hints.push_back(&peer.hint_request);
      ranks.push_back(peer.rank);
    }
  wait_all(hints, ranks, "hint delivery", -1);
  send_to_all(
      [](Peer& peer) {
        const wire::Header header = wire::make_header(wire::Opcode::kShutdown, ++peer.sequence, -1,
                                                      0, 0, 0, wire::checksum(nullptr, 0));
        std::memcpy(peer.slots[0].send.data(), &header, kHeaderBytes);
        return kHeaderBytes;
      },
      "shutdown delivery");
}

std::vector<LiveCounters> MpiDispatcher::live_counters() {
  if (peers_.empty()) return {};
  constexpr size_t kAnswerBytes = 4096;  // a header and ~200 bytes of counters
  std::vector<std::vector<std::byte>> answers(peers_.size());
  std::vector<MPI_Request> receives(peers_.size(), MPI_REQUEST_NULL);
  std::vector<MPI_Request*> waits;
  std::vector<int> ranks;
  for (size_t i = 0; i < peers_.size(); ++i) {
    answers[i].resize(kAnswerBytes);
    CHECK_MPI(MPI_Irecv(answers[i].data(), int(kAnswerBytes), MPI_BYTE, peers_[i].rank,
                        wire::kTagCounters, comm_, &receives[i]));
    waits.push_back(&receives[i]);
    ranks.push_back(peers_[i].rank);
  }
  send_to_all(
      [](Peer& peer) {
        const wire::Header header =
            wire::make_header(wire::Opcode::kCountersRequest, ++peer.sequence, -1, 0, 0, 0,
                              wire::checksum(nullptr, 0));
        std::memcpy(peer.slots[0].send.data(), &header, kHeaderBytes);
        return kHeaderBytes;
      },
      "counters request delivery");
  std::vector<MPI_Status> statuses;
  wait_within(waits, ranks, options_.rank_timeout_s, "counters", " between steps", "--rank-timeout",
              &statuses);
  std::vector<LiveCounters> all;
  for (size_t i = 0; i < peers_.size(); ++i) {
    const Peer& peer = peers_[i];
    int count = 0;
    CHECK_MPI(MPI_Get_count(&statuses[i], MPI_BYTE, &count));
    wire::Header h;
    std::string problem =
        wire::check_counters_reply(answers[i].data(), size_t(count), peer.sequence, peer.rank, h);
    LiveCounters counters;
    if (problem.empty()) {
      try {
        counters = from_bytes<LiveCounters>(std::string(
            reinterpret_cast<const char*>(answers[i].data()) + kHeaderBytes, h.payload_bytes));
      } catch (const std::exception& e) {
        problem = e.what();
      }
    }
    if (problem.empty() && counters.rank != peer.rank)
      problem = fmt::format("counters of rank {}", counters.rank);
    if (!problem.empty())
      abort_job(fmt::format("corrupted counters from {}: {}", rank_identity().name_of(peer.rank),
                            problem));
    all.push_back(counters);
  }
  return all;
}

void MpiDispatcher::change_placement(const PlacementChange& change) {
  if (peers_.empty()) return;
  const std::vector<uint32_t> words = encode_holder_changes(change.changes);
  // In messages that fit an expert rank's request buffer, whole changes each, the epoch first.
  const size_t capacity = (peers_.front().slots[0].send.size() - kHeaderBytes) / 4 - 1;
  size_t at = 0;
  while (at < words.size()) {
    size_t end = at, changes = 0;
    while (end < words.size() && end + 3 + words[end + 2] - at <= capacity) {
      end += 3 + words[end + 2];
      ++changes;
    }
    if (changes == 0)
      fail("a change of placement of {} holders does not fit a request of {} bytes", words[at + 2],
           capacity * 4);
    std::vector<uint32_t> message{change.epoch};
    message.insert(message.end(), words.begin() + int64_t(at), words.begin() + int64_t(end));
    const size_t bytes = message.size() * 4;
    const uint32_t sum = wire::checksum(reinterpret_cast<const std::byte*>(message.data()), bytes);
    send_to_all(
        [&](Peer& peer) {
          const wire::Header header =
              wire::make_header(wire::Opcode::kPlacement, ++peer.sequence, -1,
                                change.commit ? 1u : 0u, uint32_t(changes), uint32_t(bytes), sum);
          std::memcpy(peer.slots[0].send.data(), &header, kHeaderBytes);
          std::memcpy(peer.slots[0].send.data() + kHeaderBytes, message.data(), bytes);
          return kHeaderBytes + bytes;
        },
        "placement delivery");
    at = end;
  }
}

}  // namespace colibri
