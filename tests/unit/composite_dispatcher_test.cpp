// The composite dispatcher against one dispatcher over every rank: the same plan, the same
// partials, and sums with the same bits, whichever ranks each part serves.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "common/error.h"
#include "transport/composite_dispatcher.h"
#include "transport/local_dispatcher.h"

namespace colibri {
namespace {

constexpr int kHidden = 24, kTopK = 3, kExperts = 12, kRanks = 6, kRows = 9;

// partial row = sum over its pairs of weight * (row * (expert + 1) * 1.37 + expert / 7), values
// whose sums depend on the order of addition.
class FakeBackend final : public ExpertBackend {
 public:
  void prefetch(int, std::span<const int>) override {}
  void compute(const ExpertRequest& request, float* partial) override {
    const auto* rows = static_cast<const float*>(request.rows.data);
    std::fill_n(partial, size_t(request.n_rows) * kHidden, 0.0f);
    for (const RoutedPair& p : request.pairs)
      for (int j = 0; j < kHidden; ++j)
        partial[size_t(p.row) * kHidden + j] +=
            p.weight * (rows[size_t(p.row) * kHidden + j] * float(p.expert + 1) * 1.37f +
                        float(p.expert) / 7.0f);
  }
};

// Experts on ranks 1..kRanks-1 (rank 0 coordinates), round robin; rows of mixed magnitudes.
struct Case {
  PlacementTable placement;
  Routing routing;
  std::vector<float> x;
};

Case make_case(unsigned seed) {
  Case c;
  c.placement.num_layers = 1;
  c.placement.num_experts = kExperts;
  for (int e = 0; e < kExperts; ++e) c.placement.owner.push_back(1 + (e * 7 + 3) % (kRanks - 1));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  c.routing.top_k = kTopK;
  for (int t = 0; t < kRows; ++t) {
    std::vector<int> experts(kExperts);
    for (int e = 0; e < kExperts; ++e) experts[size_t(e)] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    experts.resize(kTopK);
    std::sort(experts.begin(), experts.end());
    for (int e : experts) {
      c.routing.expert.push_back(e);
      c.routing.weight.push_back(std::abs(uniform(rng)));
    }
  }
  for (int i = 0; i < kRows * kHidden; ++i)
    c.x.push_back(uniform(rng) * std::pow(10.0f, float(i % 7 - 3)));
  return c;
}

std::vector<float> run(Dispatcher& d, const Case& c) {
  DispatchPlan plan;
  plan.build(c.placement, 0, c.routing, kRows);
  std::vector<float> out(size_t(kRows) * kHidden, std::nanf(""));
  d.dispatch(plan, host_f32(c.x.data(), c.x.size()));
  d.combine(host_f32(out.data(), out.size()));
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::unique_ptr<CompositeDispatcher> composite(ExpertBackend& backend,
                                               std::vector<std::vector<int>> ranks) {
  std::vector<CompositeDispatcher::Part> parts;
  for (auto& r : ranks)
    parts.push_back({std::make_unique<LocalDispatcher>(backend, kHidden), std::move(r)});
  return std::make_unique<CompositeDispatcher>(std::move(parts), kHidden);
}

TEST(CompositeDispatcher, SumHasTheBitsOfOneDispatcher) {
  FakeBackend backend;
  for (unsigned seed = 1; seed <= 20; ++seed) {
    const Case c = make_case(seed);
    LocalDispatcher one(backend, kHidden);
    const std::vector<float> expected = run(one, c);
    bool nonzero = false;
    for (float v : expected) nonzero |= v != 0.0f && std::isfinite(v);
    ASSERT_TRUE(nonzero);
    // Interleaved ranks (GPU ranks 1, 3, 5 and CPU ranks 2, 4), blocks, and one part alone.
    for (const auto& split : std::vector<std::vector<std::vector<int>>>{{{1, 3, 5}, {2, 4}},
                                                                        {{1, 2}, {3, 4, 5}},
                                                                        {{4}, {1, 2, 3, 5}},
                                                                        {{1, 2, 3, 4, 5}, {}}}) {
      auto d = composite(backend, split);
      EXPECT_TRUE(same_bits(run(*d, c), expected)) << "seed " << seed;
    }
  }
}

// The check above can fail: adding the same partials part by part (each part's sum, then the
// parts) changes the bits of some sum.
TEST(CompositeDispatcher, OrderOfAdditionIsVisible) {
  FakeBackend backend;
  bool differs = false;
  for (unsigned seed = 1; seed <= 20 && !differs; ++seed) {
    const Case c = make_case(seed);
    LocalDispatcher one(backend, kHidden);
    const std::vector<float> expected = run(one, c);
    std::vector<float> by_part(expected.size(), 0.0f);
    for (const std::vector<int>& part : {std::vector<int>{1, 3, 5}, std::vector<int>{2, 4}}) {
      std::vector<float> part_sum(expected.size(), 0.0f);
      LocalDispatcher local(backend, kHidden);
      DispatchPlan plan;
      plan.build(c.placement, 0, c.routing, kRows);
      std::erase_if(plan.owners, [&](const OwnerShare& s) {
        return std::find(part.begin(), part.end(), s.rank) == part.end();
      });
      local.dispatch(plan, host_f32(c.x.data(), c.x.size()));
      local.combine(host_f32(part_sum.data(), part_sum.size()));
      for (size_t i = 0; i < by_part.size(); ++i) by_part[i] += part_sum[i];
    }
    differs = !same_bits(by_part, expected);
  }
  EXPECT_TRUE(differs);
}

TEST(CompositeDispatcher, OwnerOutsideEveryPartIsAnError) {
  FakeBackend backend;
  const Case c = make_case(3);
  auto d = composite(backend, {{1, 2}, {3}});  // ranks 4 and 5 own experts too
  DispatchPlan plan;
  plan.build(c.placement, 0, c.routing, kRows);
  try {
    d->dispatch(plan, host_f32(c.x.data(), c.x.size()));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("which no transport serves"), std::string::npos);
  }
}

TEST(CompositeDispatcher, RankInTwoPartsIsAnError) {
  FakeBackend backend;
  EXPECT_THROW(composite(backend, {{1, 2}, {2, 3}}), Error);
}

TEST(CompositeDispatcher, RowsNoOwnerCoversAreZero) {
  FakeBackend backend;
  auto d = composite(backend, {{1, 2}, {3, 4, 5}});
  DispatchPlan plan;
  plan.layer = 0;
  plan.n_rows = 2;  // no owner: every row routed nowhere
  std::vector<float> x(2 * kHidden, 1.0f), out(2 * kHidden, std::nanf(""));
  d->dispatch(plan, host_f32(x.data(), x.size()));
  d->combine(host_f32(out.data(), out.size()));
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace colibri
