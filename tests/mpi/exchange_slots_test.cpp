// Two exchanges in flight on the MPI transport (Dispatcher::exchange_slots): requests of two
// micro-batches out at once, each combined from its own slot, give the bits of the same exchanges
// one at a time, with and without the shared segments of the coordinator's host, on f32 and bf16
// wires. Every expert rank answers its requests in arrival order; the engine's pattern (the next
// layer's slot 0 out while slot 1 is) included. A silent rank with two exchanges in flight is
// named after --rank-timeout by mpi_cli_test (MpiCli.StoppedExpertRankIsNamedWithTwoExchanges...).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "common/error.h"
#include "fake_expert.h"
#include "transport/exchange.h"
#include "transport/mpi_check.h"

namespace colibri {
namespace {

constexpr int kHidden = 24, kTopK = 2, kMaxRows = 10, kLayers = 3;

// Order-sensitive values: a sum of them differs with the order of addition.
float contribution(float x, const RoutedPair& p, int rank) {
  return p.weight * (x * float(p.expert + 1) * 1.37f + float(rank) / 7.0f);
}

// A micro-batch of n rows at `layer`: its routing (seeded by `half`) and rows.
struct Half {
  Routing routing;
  std::vector<float> x;
  DispatchPlan plan;
};

Half make_half(const PlacementTable& table, int layer, int n, int half) {
  Half h;
  h.routing.top_k = kTopK;
  h.x.resize(size_t(n) * kHidden);
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < kTopK; ++i) {
      h.routing.expert.push_back((t * 5 + layer * 3 + half + i * 2) % table.num_experts);
      h.routing.weight.push_back(0.25f + 0.2f * float(i) + 0.01f * float(t + half));
    }
    std::sort(h.routing.expert.end() - kTopK, h.routing.expert.end());
    if (h.routing.expert.end()[-1] == h.routing.expert.end()[-2])
      h.routing.expert.end()[-1] = (h.routing.expert.end()[-1] + 1) % table.num_experts;
    std::sort(h.routing.expert.end() - kTopK, h.routing.expert.end());
    for (int j = 0; j < kHidden; ++j)
      h.x[size_t(t) * kHidden + j] = std::cos(float((t + 3 * half) * kHidden + j)) * 2.3f;
  }
  h.plan.build(table, layer, h.routing, n);
  return h;
}

using Case = std::tuple<ElemType, bool>;  // wire, shared memory
class ExchangeSlots : public ::testing::TestWithParam<Case> {};

TEST_P(ExchangeSlots, TwoInFlightGiveTheBitsOfOneAtATime) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 2) GTEST_SKIP() << "needs an expert rank, has " << size << " rank";
  test::set_one_host_identity(MPI_COMM_WORLD);
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);

  PlacementTable table;
  table.num_layers = kLayers;
  table.num_experts = 3 * (size - 1) + 1;
  for (int l = 0; l < kLayers; ++l)
    for (int e = 0; e < table.num_experts; ++e) table.owner.push_back(1 + (e * 3 + l) % (size - 1));
  const ExchangeShape shape{kMaxRows, kHidden, kTopK, table.num_experts};
  Profiler profiler(rank, rank_identity().host, rank == 0 ? "coordinator" : "cpu-expert", kLayers,
                    false);
  MpiTransportOptions options;
  options.rank_timeout_s = 60;
  options.wire_type = std::get<0>(GetParam());
  options.shared_memory = std::get<1>(GetParam());
  {
    const LivePlacement live(table);
    MpiExchange exchange = make_mpi_exchange(comm, live, shape, 0, profiler, options);
    if (rank != 0) {
      test::serve_requests(*exchange.channel, kHidden, [rank](float x, const RoutedPair& p) {
        return contribution(x, p, rank);
      });
    } else {
      Dispatcher& d = *exchange.dispatcher;
      ASSERT_EQ(d.exchange_slots(), 2);
      const auto values = [](Half& h) { return host_f32(h.x.data(), h.x.size()); };
      const auto one_at_a_time = [&](Half& h) {
        std::vector<float> out(h.x.size(), std::nanf(""));
        d.dispatch(h.plan, values(h));
        d.combine(host_f32(out.data(), out.size()));
        return out;
      };
      const auto expect_same = [](const std::vector<float>& want, const std::vector<float>& got,
                                  const std::string& what) {
        bool nonzero = false;
        for (float v : want) nonzero |= v != 0.0f && std::isfinite(v);
        EXPECT_TRUE(nonzero) << what;
        ASSERT_EQ(want.size(), got.size()) << what;
        EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) << what;
      };
      for (const auto& [na, nb] : {std::pair{1, 1}, std::pair{4, 7}, std::pair{kMaxRows, 3}}) {
        // Both halves of every layer one at a time, then the engine's order: a(l) out, b(l-1)
        // back, b(l) out, a(l) back, ..., b(last) back.
        std::vector<Half> a, b;
        std::vector<std::vector<float>> want_a, want_b;
        for (int l = 0; l < kLayers; ++l) {
          a.push_back(make_half(table, l, na, 0));
          b.push_back(make_half(table, l, nb, 1));
          want_a.push_back(one_at_a_time(a.back()));
          want_b.push_back(one_at_a_time(b.back()));
        }
        std::vector<std::vector<float>> got_a(kLayers), got_b(kLayers);
        for (int l = 0; l < kLayers; ++l) {
          got_a[size_t(l)].assign(a[size_t(l)].x.size(), std::nanf(""));
          got_b[size_t(l)].assign(b[size_t(l)].x.size(), std::nanf(""));
        }
        const auto combine = [&](int slot, std::vector<float>& out) {
          d.combine_slot(slot, host_f32(out.data(), out.size()));
        };
        for (int l = 0; l < kLayers; ++l) {
          d.dispatch_slot(0, a[size_t(l)].plan, values(a[size_t(l)]));
          if (l > 0) combine(1, got_b[size_t(l - 1)]);
          d.dispatch_slot(1, b[size_t(l)].plan, values(b[size_t(l)]));
          combine(0, got_a[size_t(l)]);
        }
        combine(1, got_b[kLayers - 1]);
        for (int l = 0; l < kLayers; ++l) {
          const std::string rows = std::to_string(na) + "+" + std::to_string(nb) + " rows";
          expect_same(want_a[size_t(l)], got_a[size_t(l)],
                      "slot 0, layer " + std::to_string(l) + ", " + rows);
          expect_same(want_b[size_t(l)], got_b[size_t(l)],
                      "slot 1, layer " + std::to_string(l) + ", " + rows);
        }
      }
      // A slot is reused only once combined; a slot past the transport's is refused.
      Half h = make_half(table, 0, 3, 0);
      d.dispatch_slot(1, h.plan, values(h));
      EXPECT_THROW(d.dispatch_slot(1, h.plan, values(h)), Error);
      EXPECT_THROW(d.dispatch_slot(2, h.plan, values(h)), Error);
      std::vector<float> out(h.x.size());
      d.combine_slot(1, host_f32(out.data(), out.size()));
      EXPECT_THROW(d.combine_slot(1, host_f32(out.data(), out.size())), Error);
      d.shutdown();
    }
  }
  MPI_Comm_free(&comm);
}

INSTANTIATE_TEST_SUITE_P(
    Wire, ExchangeSlots,
    ::testing::Combine(::testing::Values(ElemType::kF32, ElemType::kBF16), ::testing::Bool()),
    [](const auto& param_info) {
      return std::string(std::get<0>(param_info.param) == ElemType::kF32 ? "f32" : "bf16") +
             (std::get<1>(param_info.param) ? "_shared_memory" : "_messages");
    });

}  // namespace
}  // namespace colibri
