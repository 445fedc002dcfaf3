// The MPI transport's parts, each alone: who talks to whom (MpiTopology), shared segments, the
// heartbeat and its answers, and a host leader's sum of its host-mates' partials. The whole
// exchange is tested through them in composite_test, node_equality_test and faults_test.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "fake_expert.h"
#include "transport/heartbeat.h"
#include "transport/host_combine.h"
#include "transport/mpi_check.h"
#include "transport/mpi_options.h"
#include "transport/shared_segment.h"

namespace colibri {
namespace {

// A communicator of its own per test, so that no message of one test meets another's receive.
class TransportParts : public ::testing::Test {
 protected:
  void SetUp() override {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    test::set_one_host_identity(comm_);
  }
  void TearDown() override { MPI_Comm_free(&comm_); }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

bool within(std::chrono::steady_clock::time_point start, double seconds) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds;
}

TEST(MpiTopologyTest, ServesGroupsHostsAndSharesSegments) {
  MpiTransportOptions options;
  options.host_of = {0, 0, 0, 1, 1, 2};  // the coordinator (0) and two expert ranks on host 0
  const MpiTopology star(6, 0, options);
  EXPECT_EQ(star.served_ranks(), (std::vector<int>{1, 2, 3, 4, 5}));
  EXPECT_FALSE(star.served(0));
  EXPECT_TRUE(star.host_group(3).empty()) << "no groups without --combine host";
  EXPECT_TRUE(star.shares_segment(1));
  EXPECT_FALSE(star.shares_segment(3)) << "another host";
  EXPECT_TRUE(star.remote(4));
  EXPECT_FALSE(star.remote(2));

  options.host_combine = true;
  const MpiTopology host(6, 0, options);
  EXPECT_EQ(host.host_group(1), (std::vector<int>{1, 2}));
  EXPECT_EQ(host.host_group(4), (std::vector<int>{3, 4}));
  EXPECT_TRUE(host.host_group(5).empty()) << "alone on its host: replies directly";
  EXPECT_FALSE(host.shares_segment(1)) << "replies through its host leader";

  options.expert_ranks = {2, 4};
  options.shared_memory = false;
  const MpiTopology part(6, 0, options);
  EXPECT_EQ(part.served_ranks(), (std::vector<int>{2, 4}));
  EXPECT_TRUE(part.host_group(2).empty()) << "its host-mate 1 is not served";
  EXPECT_FALSE(part.shares_segment(2)) << "shared memory off";
}

// Every other expert rank offers a segment; the coordinator maps them, and rows written on one
// side are read on the other, both ways.
TEST_F(TransportParts, SharedSegmentsCarryRowsBothWays) {
  if (size_ < 2) GTEST_SKIP() << "needs 2 ranks, has " << size_;
  constexpr size_t kFloats = 100;
  const size_t area = shared_area_bytes(10, 10 * sizeof(float));
  ASSERT_EQ(area % 64, 0u);
  ASSERT_GE(area, kFloats * sizeof(float));
  const auto shares = [](int r) { return r % 2 == 1; };
  const auto value = [](int r, size_t i, int way) {
    return float(way * 100000 + r * 1000) + float(i);
  };
  if (rank_ == 0) {
    std::vector<int> ranks;
    std::vector<bool> share;
    for (int r = 1; r < size_; ++r) {
      ranks.push_back(r);
      share.push_back(shares(r));
    }
    std::vector<SharedSegment> segments = map_shared_segments(comm_, ranks, share, area, 30);
    for (size_t i = 0; i < ranks.size(); ++i) {
      EXPECT_EQ(segments[i].mapped(), share[i]) << "rank " << ranks[i];
      if (!segments[i].mapped()) continue;
      auto* rows = reinterpret_cast<float*>(segments[i].request_rows());
      for (size_t j = 0; j < kFloats; ++j) rows[j] = value(ranks[i], j, 1);
    }
    MPI_Barrier(comm_);  // requests written
    MPI_Barrier(comm_);  // replies written
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (!segments[i].mapped()) continue;
      const auto* rows = reinterpret_cast<const float*>(segments[i].reply_rows());
      for (size_t j = 0; j < kFloats; ++j)
        ASSERT_EQ(rows[j], value(ranks[i], j, 2)) << "rank " << ranks[i] << " float " << j;
    }
  } else {
    SharedSegment segment;
    if (shares(rank_)) segment = offer_shared_segment(comm_, 0, area, 30);
    EXPECT_EQ(segment.mapped(), shares(rank_));
    MPI_Barrier(comm_);
    if (segment.mapped()) {
      const auto* rows = reinterpret_cast<const float*>(segment.request_rows());
      for (size_t j = 0; j < kFloats; ++j) EXPECT_EQ(rows[j], value(rank_, j, 1)) << j;
      auto* reply = reinterpret_cast<float*>(segment.reply_rows());
      for (size_t j = 0; j < kFloats; ++j) reply[j] = value(rank_, j, 2);
    }
    MPI_Barrier(comm_);
  }
}

// The coordinator's heartbeats reach every expert rank, whose answers reach the coordinator.
TEST_F(TransportParts, HeartbeatsAreAnswered) {
  if (size_ < 2) GTEST_SKIP() << "needs 2 ranks, has " << size_;
  const auto start = std::chrono::steady_clock::now();
  MPI_Request done = MPI_REQUEST_NULL;
  if (rank_ == 0) {
    std::vector<int> ranks;
    for (int r = 1; r < size_; ++r) ranks.push_back(r);
    HeartbeatSender sender(comm_, ranks, 0.01, 60);
    const auto all_answered = [&] {
      for (size_t i = 0; i < ranks.size(); ++i)
        if (!sender.answered(i)) return false;
      return true;
    };
    while (!all_answered() && within(start, 20)) usleep(1000);
    for (size_t i = 0; i < ranks.size(); ++i)
      EXPECT_TRUE(sender.answered(i)) << "rank " << ranks[i] << " never answered";
    sender.stop();
    MPI_Ibarrier(comm_, &done);
    MPI_Wait(&done, MPI_STATUS_IGNORE);
  } else {
    HeartbeatAnswerer answerer(comm_, 0);
    bool took = false;
    // Answers until the coordinator has heard every rank (its barrier).
    MPI_Ibarrier(comm_, &done);
    for (int finished = 0; !finished && within(start, 30);) {
      took |= answerer.take();
      MPI_Test(&done, &finished, MPI_STATUS_IGNORE);
      usleep(500);
    }
    EXPECT_TRUE(took) << "no heartbeat arrived";
    if (done != MPI_REQUEST_NULL) MPI_Wait(&done, MPI_STATUS_IGNORE);
  }
}

// Ranks 1.. are one host: rank 1 leads, the others send it their partials; the sum is this
// rank's then the host-mates' in ascending rank, over the union of their rows.
TEST_F(TransportParts, HostLeaderSumsItsHostInRankOrder) {
  if (size_ < 3) GTEST_SKIP() << "needs 3 ranks (a leader and a host-mate), has " << size_;
  if (rank_ == 0) return;
  constexpr int kHidden = 6, kMaxRows = 8;
  // Rank r holds coordinator rows r-1, r, r+2 (those below kMaxRows); values that show the order.
  const auto rows_of = [&](int r) {
    std::vector<uint32_t> rows;
    for (int row : {r - 1, r, r + 2})
      if (row < kMaxRows) rows.push_back(uint32_t(row));
    return rows;
  };
  const auto partial_of = [&](int r) {
    std::vector<float> partial;
    for (size_t i = 0; i < rows_of(r).size() * kHidden; ++i)
      partial.push_back(1.0f / float(3 + r * 7 + int(i)) * (i % 2 ? -1e3f : 1e-3f));
    return partial;
  };
  wire::Header request = wire::make_header(wire::Opcode::kExpertRequest, 7, 1, 0, 0, 0, 0);
  const std::vector<uint32_t> mine = rows_of(rank_);
  request.n_rows = uint32_t(mine.size());
  const std::vector<float> own = partial_of(rank_);
  if (rank_ != 1) {
    std::vector<std::byte> message(sizeof(wire::Header) +
                                   wire::host_partial_payload_bytes(kMaxRows, kHidden, 4));
    const size_t bytes = write_host_partial(request, mine, own.data(), kHidden, message.data());
    MPI_Send(message.data(), int(bytes), MPI_BYTE, 1, wire::kTagHostPartial, comm_);
    return;
  }
  std::vector<int> mates;
  for (int r = 2; r < size_; ++r) mates.push_back(r);
  HostLeader leader(comm_, mates, kMaxRows, kHidden, 30);
  leader.post_receives();
  std::vector<float> got(size_t(kMaxRows) * kHidden, -1.0f);
  RankReport counters;
  const uint32_t n = leader.sum(request, mine, own.data(), ElemType::kF32,
                                reinterpret_cast<std::byte*>(got.data()), counters);
  // The same sums, in the same order, by hand.
  std::vector<float> want(size_t(kMaxRows) * kHidden, 0.0f);
  std::vector<bool> present(kMaxRows, false);
  for (int r = 1; r < size_; ++r) {
    const std::vector<uint32_t> rows = rows_of(r);
    const std::vector<float> partial = partial_of(r);
    for (size_t i = 0; i < rows.size(); ++i) {
      present[rows[i]] = true;
      for (int j = 0; j < kHidden; ++j) want[rows[i] * kHidden + j] += partial[i * kHidden + j];
    }
  }
  std::vector<float> compact;  // the union of the rows, ascending
  for (int row = 0; row < kMaxRows; ++row)
    if (present[size_t(row)])
      compact.insert(compact.end(), want.begin() + row * kHidden,
                     want.begin() + (row + 1) * kHidden);
  ASSERT_EQ(n, compact.size() / kHidden);
  EXPECT_EQ(0, std::memcmp(got.data(), compact.data(), compact.size() * sizeof(float)));
  EXPECT_GT(counters.bytes_in, 0u);
}

}  // namespace
}  // namespace colibri
