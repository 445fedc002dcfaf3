// The composite dispatcher over real MPI transports: parts serving the odd and the even expert
// ranks (as NCCL and MPI would serve the GPU and the CPU ones) against one MPI transport over
// every rank, on f32 and bf16 wires: sums with the same bits. Each transport has its own
// communicator; an expert rank serves its two channels from two threads.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "fake_expert.h"
#include "transport/composite_dispatcher.h"
#include "transport/exchange.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr int kHidden = 40, kTopK = 3, kMaxRows = 12, kLayers = 2;

// Order-sensitive values: sums of them differ with the order of addition.
float contribution(float x, const RoutedPair& p, int rank) {
  return p.weight * (x * float(p.expert + 1) * 1.37f + float(rank) / 7.0f);
}

void serve(ExpertChannel& channel, int rank) {
  test::serve_requests(channel, kHidden,
                       [rank](float x, const RoutedPair& p) { return contribution(x, p, rank); });
}

class CompositeOverMpi : public ::testing::TestWithParam<ElemType> {};

TEST_P(CompositeOverMpi, EqualsOneMpiTransportBitForBit) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 3) GTEST_SKIP() << "needs 3 ranks (two parts), has " << size;
  test::set_one_host_identity(MPI_COMM_WORLD);

  PlacementTable table;
  table.num_layers = kLayers;
  table.num_experts = 3 * (size - 1);
  for (int l = 0; l < kLayers; ++l)
    for (int e = 0; e < table.num_experts; ++e) table.owner.push_back(1 + (e * 5 + l) % (size - 1));
  const ExchangeShape shape{kMaxRows, kHidden, kTopK, table.num_experts};
  std::vector<int> odd, even;
  for (int r = 1; r < size; ++r) (r % 2 ? odd : even).push_back(r);
  // One communicator per transport: every rank, the odd part, the even part.
  MPI_Comm comms[3];
  for (MPI_Comm& c : comms) MPI_Comm_dup(MPI_COMM_WORLD, &c);
  Profiler profiler(rank, rank_identity().host, rank == 0 ? "coordinator" : "cpu-expert", kLayers,
                    false);
  MpiTransportOptions options;
  options.rank_timeout_s = 60;
  options.wire_type = GetParam();
  {
    const LivePlacement live(table);
    MpiExchange all = make_mpi_exchange(comms[0], live, shape, 0, profiler, options);
    if (rank != 0) {
      MpiTransportOptions mine = options;
      mine.expert_ranks = rank % 2 ? odd : even;
      MpiChannel part(comms[rank % 2 ? 1 : 2], live, shape, 0, profiler, mine);
      std::thread second([&] { serve(part, rank); });
      serve(*all.channel, rank);
      second.join();
    } else {
      std::vector<CompositeDispatcher::Part> parts;
      for (int p = 0; p < 2; ++p) {
        MpiTransportOptions mine = options;
        mine.expert_ranks = p == 0 ? odd : even;
        parts.push_back({std::make_unique<MpiDispatcher>(comms[1 + p], shape, 0, profiler, mine),
                         mine.expert_ranks});
      }
      CompositeDispatcher composite(std::move(parts), kHidden);
      DispatchPlan plan;
      for (int layer = 0; layer < kLayers; ++layer)
        for (int n : {1, 7, kMaxRows}) {
          Routing routing;
          routing.top_k = kTopK;
          std::vector<float> x(size_t(n) * kHidden);
          for (int t = 0; t < n; ++t) {
            for (int i = 0; i < kTopK; ++i) {
              routing.expert.push_back((t * 7 + layer + i) % table.num_experts);
              routing.weight.push_back(0.3f + 0.17f * float(i) + 0.01f * float(t));
            }
            std::sort(routing.expert.end() - kTopK, routing.expert.end());
            for (int j = 0; j < kHidden; ++j)
              x[size_t(t) * kHidden + j] = std::sin(float(t * kHidden + j)) * 3.1f;
          }
          plan.build(table, layer, routing, n);
          std::vector<float> want(x.size()), got(x.size(), std::nanf(""));
          all.dispatcher->dispatch(plan, host_f32(x.data(), x.size()));
          all.dispatcher->combine(host_f32(want.data(), want.size()));
          composite.dispatch(plan, host_f32(x.data(), x.size()));
          composite.combine(host_f32(got.data(), got.size()));
          bool nonzero = false;
          for (float v : want) nonzero |= v != 0.0f && std::isfinite(v);
          EXPECT_TRUE(nonzero);
          EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
              << "layer " << layer << ", " << n << " rows";
        }
      all.dispatcher->shutdown();
      composite.shutdown();
    }
  }
  for (MPI_Comm& c : comms) MPI_Comm_free(&c);
}

INSTANTIATE_TEST_SUITE_P(Wire, CompositeOverMpi,
                         ::testing::Values(ElemType::kF32, ElemType::kBF16));

}  // namespace
}  // namespace colibri
