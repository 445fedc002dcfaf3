// The NCCL transport under mpirun, one GPU per rank (rank r on device r): every rank is in the
// communicator, rank 0 coordinates. Rank-tagged integer-valued rows and partials, so that
// combine(dispatch(x)) has one exact answer; it must equal that answer and the MPI transport's
// sum bit for bit, on f32 and bf16 wires, with x and out in host and device memory. Skips with
// "needs N GPUs, found M" where there are fewer GPUs than ranks. With COLIBRI_NCCL_SILENT_RANK=r,
// rank r never replies and the coordinator must name it within --rank-timeout (the job ends).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "../mpi/fake_expert.h"
#include "transport/exchange.h"
#include "transport/mpi_check.h"
#include "transport/nccl_transport.h"

namespace colibri {
namespace {

constexpr int kHidden = 64, kTopK = 2, kMaxRows = 16, kLayers = 3;

int world(int* rank) {
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// The fewest CUDA devices any rank sees (0 where CUDA cannot start).
int fewest_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  int fewest = 0;
  MPI_Allreduce(&count, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return fewest;
}

// Expert e of every layer on rank 1 + e % (size - 1); 4 experts per expert rank.
PlacementTable placement(int size) {
  PlacementTable p;
  p.num_layers = kLayers;
  p.num_experts = 4 * (size - 1);
  for (int l = 0; l < kLayers; ++l)
    for (int e = 0; e < p.num_experts; ++e) p.owner.push_back(1 + e % (size - 1));
  return p;
}

// Row t routes to experts (t + layer) % E and (3t + 1 + layer) % E (or the next one), weights 1
// and 2; x[t][j] = (t + 3j) % 17 - 8.
Routing routing(int n, int layer, int experts) {
  Routing r;
  r.top_k = kTopK;
  for (int t = 0; t < n; ++t) {
    int a = (t + layer) % experts, b = (3 * t + 1 + layer) % experts;
    if (b == a) b = (a + 1) % experts;
    r.expert.push_back(std::min(a, b));
    r.expert.push_back(std::max(a, b));
    r.weight.push_back(1.0f);
    r.weight.push_back(2.0f);
  }
  return r;
}

std::vector<float> rows(int n) {
  std::vector<float> x(size_t(n) * kHidden);
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < kHidden; ++j) x[size_t(t) * kHidden + j] = float((t + 3 * j) % 17 - 8);
  return x;
}

// An owner's contribution for one pair: weight * (x * (expert + 1) + rank), integers that stay
// exact in bf16 (|value| <= 8 * 8 + 2 = 66, summed <= 200 < 256).
float contribution(float x, const RoutedPair& p, int rank) {
  return p.weight * (x * float(p.expert + 1) + float(rank));
}

// The expert rank's loop: answers every request until shutdown; `silent` never replies.
void serve(ExpertChannel& channel, int rank, bool silent) {
  test::serve_requests(
      channel, kHidden, [rank](float x, const RoutedPair& p) { return contribution(x, p, rank); },
      silent);
}

// The exact sum of every owner's partial.
std::vector<float> expected(const PlacementTable& placement, const Routing& routing, int n,
                            const std::vector<float>& x) {
  std::vector<float> out(size_t(n) * kHidden, 0.0f);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < kTopK; ++i) {
      const RoutedPair p{0, uint32_t(routing.expert[size_t(t) * kTopK + i]),
                         routing.weight[size_t(t) * kTopK + i]};
      const int owner = placement.owner_of(0, int(p.expert));
      for (int j = 0; j < kHidden; ++j)
        out[size_t(t) * kHidden + j] += contribution(x[size_t(t) * kHidden + j], p, owner);
    }
  return out;
}

class NcclTransportTest : public ::testing::TestWithParam<ElemType> {
 protected:
  void SetUp() override {
    size_ = world(&rank_);
    const int gpus = fewest_gpus();
    if (size_ < 2 || gpus < size_)
      GTEST_SKIP() << "needs " << std::max(size_, 2) << " GPUs, found " << gpus
                   << " (one GPU per rank, at least 2 ranks)";
    test::set_one_host_identity(MPI_COMM_WORLD);
  }
  int rank_ = 0, size_ = 1;
};

TEST_P(NcclTransportTest, CombineOfDispatchIsExactAndEqualsMpi) {
  const char* silent_env = std::getenv("COLIBRI_NCCL_SILENT_RANK");
  const int silent = silent_env ? std::atoi(silent_env) : -1;
  const ElemType wire = GetParam();
  const PlacementTable table = placement(size_);
  const ExchangeShape shape{kMaxRows, kHidden, kTopK, table.num_experts};
  Profiler profiler(rank_, rank_identity().host, rank_ == 0 ? "coordinator" : "gpu-expert", kLayers,
                    false);
  std::vector<int> all(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) all[size_t(r)] = r;
  const Deadline deadline{60, "--startup-timeout", "test (NCCL id)"};
  NcclTransportOptions options;
  options.rank_timeout_s = silent >= 0 ? 3 : 60;
  options.setup_timeout_s = 60;
  options.wire_type = wire;
  options.device = rank_;
  const LivePlacement live(table);
  NcclTransport nccl(all, nccl_unique_id(MPI_COMM_WORLD, 0, deadline), live, shape, 0, profiler,
                     options);
  MpiTransportOptions mpi_options;
  mpi_options.rank_timeout_s = 60;
  mpi_options.wire_type = wire;
  MpiExchange mpi = make_mpi_exchange(MPI_COMM_WORLD, live, shape, 0, profiler, mpi_options);

  if (rank_ != 0) {
    serve(nccl, rank_, rank_ == silent);
    serve(*mpi.channel, rank_, false);
    return;
  }
  float *x_dev = nullptr, *out_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&x_dev, sizeof(float) * kMaxRows * kHidden), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out_dev, sizeof(float) * kMaxRows * kHidden), cudaSuccess);
  DispatchPlan plan;
  for (int layer = 0; layer < kLayers; ++layer)
    for (int n : {1, 5, kMaxRows}) {
      const Routing r = routing(n, layer, table.num_experts);
      plan.build(table, layer, r, n);
      const std::vector<float> x = rows(n), want = expected(table, r, n, x);
      bool nonzero = false;
      for (float v : want) nonzero |= v != 0.0f;
      ASSERT_TRUE(nonzero);
      const size_t values = want.size();
      std::vector<float> by_mpi(values), by_nccl(values), by_nccl_device(values);
      mpi.dispatcher->dispatch(plan, host_f32(x.data(), values));
      mpi.dispatcher->combine(host_f32(by_mpi.data(), values));
      nccl.dispatch(plan, host_f32(x.data(), values));
      nccl.combine(host_f32(by_nccl.data(), values));
      // x and out in device memory.
      ASSERT_EQ(cudaMemcpy(x_dev, x.data(), values * sizeof(float), cudaMemcpyHostToDevice),
                cudaSuccess);
      nccl.dispatch(plan, {x_dev, ElemType::kF32, Device::kCuda, values});
      nccl.combine(View{out_dev, ElemType::kF32, Device::kCuda, values});
      ASSERT_EQ(cudaMemcpy(by_nccl_device.data(), out_dev, values * sizeof(float),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(by_mpi, want) << "layer " << layer << ", " << n << " rows";
      EXPECT_EQ(0, std::memcmp(by_nccl.data(), by_mpi.data(), values * sizeof(float)))
          << "layer " << layer << ", " << n << " rows";
      EXPECT_EQ(0, std::memcmp(by_nccl_device.data(), by_mpi.data(), values * sizeof(float)))
          << "device views, layer " << layer << ", " << n << " rows";
    }
  cudaFree(x_dev);
  cudaFree(out_dev);
  nccl.shutdown();
  mpi.dispatcher->shutdown();
}

INSTANTIATE_TEST_SUITE_P(Wire, NcclTransportTest,
                         ::testing::Values(ElemType::kF32, ElemType::kBF16));

}  // namespace
}  // namespace colibri
