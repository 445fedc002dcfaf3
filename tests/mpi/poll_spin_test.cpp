// How waits poll: the ranks of a host busy-poll only when the union of their CPU sets has a CPU
// for every thread. Each case sets this rank's CPU set, asks host_poll_spin_us, and restores it.
#include <gtest/gtest.h>
#include <mpi.h>
#include <sched.h>

#include <vector>

#include "transport/deadline.h"

namespace colibri {
namespace {

class PollSpin : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(sched_getaffinity(0, sizeof(saved_), &saved_), 0);
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local_);
    MPI_Comm_rank(local_, &rank_);
    MPI_Comm_size(local_, &size_);
    // The CPUs any rank of this host may run on (mpirun may have bound each to its own core).
    cpu_set_t all;
    MPI_Allreduce(&saved_, &all, int(sizeof(cpu_set_t)), MPI_BYTE, MPI_BOR, local_);
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &all)) host_cpus_.push_back(c);
  }
  void TearDown() override {
    sched_setaffinity(0, sizeof(saved_), &saved_);
    MPI_Comm_free(&local_);
  }
  // This rank runs on the host's CPU number `i` alone (counted modulo their number).
  void pin_to(int i) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(host_cpus_[size_t(i) % host_cpus_.size()], &one);
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  }

  cpu_set_t saved_{};
  std::vector<int> host_cpus_;
  MPI_Comm local_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

TEST(PollSpinChoice, SpinsOnlyWithACpuPerThread) {
  EXPECT_GT(choose_poll_spin_us(2, 2), 0);
  EXPECT_GT(choose_poll_spin_us(1, 8), 0);
  EXPECT_EQ(choose_poll_spin_us(3, 2), 0);
  EXPECT_EQ(choose_poll_spin_us(16, 1), 0);
}

TEST_F(PollSpin, RanksPinnedToOneSharedCpuYield) {
  pin_to(0);
  const int spin = host_poll_spin_us(local_, 1);
  if (size_ == 1)
    EXPECT_GT(spin, 0);
  else
    EXPECT_EQ(spin, 0) << size_ << " ranks on one CPU";
}

TEST_F(PollSpin, RanksPinnedToCpusOfTheirOwnSpin) {
  pin_to(rank_);  // mpirun's own binding for np <= 2: a core each
  const int spin = host_poll_spin_us(local_, 1);
  if (size_t(size_) <= host_cpus_.size())
    EXPECT_GT(spin, 0) << size_ << " ranks on " << host_cpus_.size() << " CPUs";
  else
    EXPECT_EQ(spin, 0) << size_ << " ranks on " << host_cpus_.size() << " CPUs";
}

TEST_F(PollSpin, CountsEveryThreadOfTheHost) {
  pin_to(rank_);
  // Two threads on each rank's one CPU: too many, whatever the other ranks have.
  EXPECT_EQ(host_poll_spin_us(local_, 2), 0);
}

}  // namespace
}  // namespace colibri
