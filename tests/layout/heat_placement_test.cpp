// --placement heat: every expert held, counts within each rank's share, the hottest experts on
// the fastest tier, each layer's expected routes even, replicas on distinct ranks, and the
// coordinator's choice of a replica per routed row.
#include <gtest/gtest.h>

#include <cereal/archives/binary.hpp>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/layout.h"
#include "moe/placement.h"
#include "moe/placement_change.h"
#include "transport/transport.h"

namespace colibri {
namespace {

constexpr uint64_t kGiB = 1ull << 30;

// Layer 0 dense, layers 1 and 2 MoE with `experts` experts.
ModelConfig model(int experts) {
  ModelConfig config;
  config.num_layers = 3;
  config.layer_is_moe = {false, true, true};
  config.n_routed_experts = experts;
  return config;
}

// Skewed statistics: expert e of every MoE layer routed (e + 1)^-1.2 * 10000 times, the hottest
// at the highest id in layer 2 (so that the two layers differ).
RoutingStats zipf(const ModelConfig& config) {
  RoutingStats stats;
  stats.reset(config.num_layers, config.n_routed_experts);
  const int n = config.n_routed_experts;
  for (int e = 0; e < n; ++e) {
    stats.count[size_t(1 * n + e)] = std::round(10000 * std::pow(e + 1, -1.2));
    stats.count[size_t(2 * n + (n - 1 - e))] = std::round(10000 * std::pow(e + 1, -1.2));
  }
  stats.tokens = 10000;
  return stats;
}

// Rank 0 coordinates, ranks 1.. are CPU expert ranks on one host.
Layout cpu_layout(int size) {
  const auto n = size_t(size);
  std::vector<int> local(n), none(n, 0), host(n, 0);
  for (int r = 0; r < size; ++r) local[size_t(r)] = r;
  return default_layout(size, local, none, host);
}

// Every expert of a MoE layer held once by its owner and once per replica, on distinct ranks.
void expect_every_expert_held(const PlacementTable& table, const ModelConfig& config) {
  for (int l = 0; l < config.num_layers; ++l)
    for (int e = 0; e < config.n_routed_experts; ++e) {
      const int owner = table.owner_of(l, e);
      if (!config.layer_is_moe[size_t(l)]) {
        EXPECT_EQ(owner, -1);
        continue;
      }
      EXPECT_GE(owner, 0) << l << " " << e;
      const std::vector<int>& more = table.replicas_of(l, e);
      EXPECT_TRUE(std::is_sorted(more.begin(), more.end()));
      EXPECT_EQ(std::count(more.begin(), more.end(), owner), 0);
      EXPECT_EQ(std::adjacent_find(more.begin(), more.end()), more.end());
    }
}

TEST(HeatPlacement, WithoutStatisticsEveryLayerIsEven) {
  const ModelConfig config = model(16);
  const Layout layout = cpu_layout(5);
  const PlacementTable table = make_placement(config, layout, PlacementPolicy::kHeat, kGiB);
  EXPECT_EQ(table.policy, "heat");
  expect_every_expert_held(table, config);
  for (int rank = 1; rank <= 4; ++rank) {
    EXPECT_EQ(table.experts_of(rank, 1).size(), 4u) << rank;
    EXPECT_EQ(table.experts_of(rank, 2).size(), 4u) << rank;
  }
  EXPECT_EQ(table.count_owned(0), 0);
  EXPECT_DOUBLE_EQ(table.heat_of(1, 3), 1.0 / 16);
  EXPECT_NEAR(expected_load(table, layout).max_over_mean, 1.0, 1e-12);
}

// A gpu-expert rank with VRAM for 2 experts a layer, two CPU ranks with RAM for 3 a layer: the 2
// hottest of each layer on the GPU, the next 6 in RAM; the rest on the ranks' disk tiers.
TEST(HeatPlacement, TheHottestExpertsGoToTheFastestTier) {
  const ModelConfig config = model(16);
  const RoutingStats stats = zipf(config);
  const Layout layout =
      parse_layout("0 coordinator\n1 gpu-expert 0 - - 4\n2 cpu-expert - - 6\n3 cpu-expert - - 6\n",
                   "t.layout", 4);
  const PlacementTable table = make_placement(config, layout, PlacementPolicy::kHeat, kGiB, &stats);
  expect_every_expert_held(table, config);
  for (int e : {0, 1}) EXPECT_EQ(table.owner_of(1, e), 1) << e;
  for (int e : {15, 14}) EXPECT_EQ(table.owner_of(2, e), 1) << e;
  // The RAM slots: the next six of layer 1 on ranks 2 and 3, three each.
  int on_two = 0;
  for (int e = 2; e < 8; ++e) {
    EXPECT_NE(table.owner_of(1, e), 1) << e;
    on_two += table.owner_of(1, e) == 2;
  }
  EXPECT_EQ(on_two, 3);
  // Counts in proportion to the budgets (4 : 6 : 6 of 16 a layer).
  EXPECT_EQ(table.experts_of(1, 1).size(), 4u);
  EXPECT_EQ(table.experts_of(2, 1).size(), 6u);
  EXPECT_EQ(table.experts_of(3, 1).size(), 6u);

  // The GPU rank's expected share of the routes, against balanced on the same budgets.
  const PlacementTable balanced = make_placement(config, layout, PlacementPolicy::kBalanced, kGiB);
  PlacementTable balanced_heat = balanced;
  balanced_heat.heat = table.heat;  // the same routing, measured on the balanced table
  const double heat_share = expected_load(table, layout).share[1];
  const double balanced_share = expected_load(balanced_heat, layout).share[1];
  EXPECT_GT(heat_share, 1.6 * balanced_share) << heat_share << " vs " << balanced_share;
}

// Equal CPU ranks: each layer's expected routes spread evenly (longest-processing-time first),
// replicas of the hottest experts bring the busiest rank to within 15 % of the mean.
TEST(HeatPlacement, ExpectedRoutesEvenPerLayerAndReplicasSplitTheHottest) {
  const ModelConfig config = model(32);
  const RoutingStats stats = zipf(config);
  const Layout layout = cpu_layout(7);
  const PlacementTable heat = make_placement(config, layout, PlacementPolicy::kHeat, kGiB, &stats);
  PlacementTable balanced = make_placement(config, layout, PlacementPolicy::kBalanced, kGiB);
  balanced.heat = heat.heat;
  const double heat_ratio = expected_load(heat, layout).max_over_mean;
  const double balanced_ratio = expected_load(balanced, layout).max_over_mean;
  EXPECT_LT(heat_ratio, balanced_ratio);
  // Expert 0 of layer 1 carries about 27 % of the routes: one copy on one of 6 ranks is a
  // straggler whatever the rest does.
  EXPECT_GT(heat_ratio, 1.5);

  const PlacementTable replicated =
      make_placement(config, layout, PlacementPolicy::kHeat, kGiB, &stats, 6);
  expect_every_expert_held(replicated, config);
  EXPECT_EQ(replicated.replica_count(), 12);  // 6 per MoE layer
  EXPECT_FALSE(replicated.replicas_of(1, 0).empty());
  EXPECT_FALSE(replicated.replicas_of(2, 31).empty());
  EXPECT_TRUE(replicated.replicas_of(1, 31).empty());
  EXPECT_LE(expected_load(replicated, layout).max_over_mean, 1.15);
  // Serialized whole, replicas and heat included.
  std::stringstream bytes;
  {
    cereal::BinaryOutputArchive out(bytes);
    out(replicated);
  }
  PlacementTable back;
  {
    cereal::BinaryInputArchive in(bytes);
    in(back);
  }
  EXPECT_EQ(back.replicas, replicated.replicas);
  EXPECT_EQ(back.heat, replicated.heat);
  // The printout says each rank's share and the layer's ratio.
  const std::string printed = format_placement(replicated, layout, kGiB);
  EXPECT_NE(printed.find("12 replicas"), std::string::npos) << printed;
  EXPECT_NE(printed.find("routes"), std::string::npos) << printed;
  EXPECT_NE(printed.find("busiest owner / the mean"), std::string::npos) << printed;
}

// --print-placement's tiers: 8 experts of 1 GiB on a gpu-expert rank with 2 GB of VRAM and 1 GB
// of RAM and a CPU rank with 3 GB of RAM (4 each by the budgets 3 : 3): the bytes each tier
// holds, the rest on disk.
TEST(HeatPlacement, PrintedTiersFollowTheBudgets) {
  ModelConfig config;
  config.num_layers = 1;
  config.layer_is_moe = {true};
  config.n_routed_experts = 8;
  const Layout layout =
      parse_layout("0 coordinator\n1 gpu-expert 0 - 1 2\n2 cpu-expert - - 3\n", "t.layout", 3);
  const PlacementTable table = make_placement(config, layout, PlacementPolicy::kHeat, kGiB);
  ASSERT_EQ(table.count_owned(1), 4);
  const std::string printed = format_placement(table, layout, kGiB);
  EXPECT_NE(printed.find("tiers: vram 2048.0, ram 1024.0, disk 1024.0 MiB"), std::string::npos)
      << printed;
  EXPECT_NE(printed.find("tiers: vram 0.0, ram 3072.0, disk 1024.0 MiB"), std::string::npos)
      << printed;
}

TEST(HeatPlacement, RefusesWhatItCannotPlace) {
  const ModelConfig config = model(4);
  const Layout layout = cpu_layout(3);
  const auto error = [&](PlacementPolicy policy, int replicas, const RoutingStats* stats) {
    try {
      make_placement(config, layout, policy, kGiB, stats, replicas);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(
      error(PlacementPolicy::kBalanced, 1, nullptr).find("--replicas 1 needs --placement heat"),
      std::string::npos);
  // Two owners: at most one more copy of each of 4 experts.
  EXPECT_EQ(error(PlacementPolicy::kHeat, 4, nullptr), "");
  EXPECT_NE(error(PlacementPolicy::kHeat, 5, nullptr).find("--replicas 5: between 0 and 4"),
            std::string::npos);
  RoutingStats other;
  other.reset(3, 8);
  other.tokens = 1;
  EXPECT_NE(error(PlacementPolicy::kHeat, 0, &other).find("routing statistics of 3 layers x 8"),
            std::string::npos);
}

// A replicated expert's rows go to the copy with the fewest pairs so far: four rows of expert 0
// held by ranks 1 and 2 alternate; every pair is sent once.
TEST(HeatPlacement, DispatchSendsEachRowOfAReplicatedExpertToTheLeastLoadedCopy) {
  PlacementTable table;
  table.num_layers = 1;
  table.num_experts = 2;
  table.policy = "heat";
  table.owner = {1, 2};
  table.replicas = {{2}, {}};
  Routing routing;
  routing.top_k = 1;
  routing.expert = {0, 0, 0, 0};
  routing.weight = {1, 1, 1, 1};
  DispatchPlan plan;
  plan.build(table, 0, routing, 4);
  ASSERT_EQ(plan.owners.size(), 2u);
  EXPECT_EQ(plan.owners[0].rank, 1);
  EXPECT_EQ(plan.owners[1].rank, 2);
  EXPECT_EQ(plan.owners[0].rows.size(), 2u);
  EXPECT_EQ(plan.owners[1].rows.size(), 2u);
  EXPECT_EQ(plan.owners[0].rows[1] - plan.owners[0].rows[0], 2);  // every other row
  EXPECT_EQ(plan.pairs(), 4u);
  // One row a plan (decode steps): the turn moves on, the copies alternate.
  routing.expert = {0};
  int on_one = 0;
  for (int step = 0; step < 6; ++step) {
    plan.build(table, 0, routing, 1);
    ASSERT_EQ(plan.owners.size(), 1u);
    on_one += plan.owners[0].rank == 1;
  }
  EXPECT_EQ(on_one, 3);
  // Expert 1 (rank 2 only) beside expert 0 in both rows: expert 0 goes where the load is least.
  routing.top_k = 2;
  routing.expert = {0, 1, 0, 1};
  routing.weight = {0.5f, 0.5f, 0.5f, 0.5f};
  plan.build(table, 0, routing, 2);
  ASSERT_EQ(plan.owners.size(), 2u);
  EXPECT_EQ(plan.pairs(), 4u);
  EXPECT_GE(plan.owners[0].pairs.size(), 1u);  // rank 1 takes some of expert 0's rows
  for (const RoutedPair& p : plan.owners[0].pairs) EXPECT_EQ(p.expert, 0u);
  EXPECT_TRUE(table.holds(0, 0, 2));
  EXPECT_FALSE(table.holds(0, 1, 1));
}

// Two tables of one shape: what differs, who gains and loses what, the wire form and its
// refusals, and the change applied giving the new table.
TEST(PlacementChange, DiffApplyAndWireForm) {
  const ModelConfig config = model(16);
  const Layout layout = cpu_layout(4);
  const RoutingStats stats = zipf(config);
  const PlacementTable from = make_placement(config, layout, PlacementPolicy::kHeat, kGiB);
  const PlacementTable to = make_placement(config, layout, PlacementPolicy::kHeat, kGiB, &stats, 2);
  const std::vector<HolderChange> changes = placement_diff(from, to);
  ASSERT_FALSE(changes.empty());
  for (const HolderChange& c : changes) EXPECT_NE(c.layer, 0) << "dense layer 0 has no experts";
  int gained = 0, lost = 0;
  for (int rank = 0; rank < 4; ++rank) {
    for (const auto& [l, e] : experts_gained(from, changes, rank)) {
      EXPECT_FALSE(from.holds(l, e, rank));
      EXPECT_TRUE(to.holds(l, e, rank));
      ++gained;
    }
    for (const auto& [l, e] : experts_lost(from, changes, rank)) {
      EXPECT_TRUE(from.holds(l, e, rank));
      EXPECT_FALSE(to.holds(l, e, rank));
      ++lost;
    }
  }
  EXPECT_EQ(gained, lost + 4);  // the 4 replicas are held in addition

  std::vector<HolderChange> back;
  const std::vector<uint32_t> words = encode_holder_changes(changes);
  ASSERT_EQ(decode_holder_changes(words, 3, 16, 4, back), "");
  PlacementTable applied = from;
  apply_placement_change(applied, back);
  EXPECT_EQ(applied.owner, to.owner);
  for (int l = 0; l < 3; ++l)
    for (int e = 0; e < 16; ++e) EXPECT_EQ(applied.replicas_of(l, e), to.replicas_of(l, e));
  EXPECT_TRUE(placement_diff(applied, to).empty());

  std::vector<uint32_t> bad = words;
  bad[0] = 3;  // layer out of range
  EXPECT_NE(decode_holder_changes(bad, 3, 16, 4, back).find("out of range"), std::string::npos);
  bad = words;
  bad[3] = 4;  // rank out of range
  EXPECT_NE(decode_holder_changes(bad, 3, 16, 4, back).find("holder 4"), std::string::npos);
  bad = words;
  bad[2] = 0;  // no holder
  EXPECT_NE(decode_holder_changes(bad, 3, 16, 4, back).find("0 holders"), std::string::npos);
  bad.assign(words.begin(), words.begin() + 2);
  EXPECT_NE(decode_holder_changes(bad, 3, 16, 4, back).find("cut short"), std::string::npos);
}

// The running job's placement is replaced whole, only by a newer table of its shape; a table taken
// before stays as it was.
TEST(PlacementChange, ALivePlacementTakesOnlyNewerTablesOfItsShape) {
  const ModelConfig config = model(16);
  LivePlacement live(make_placement(config, cpu_layout(4), PlacementPolicy::kBalanced, kGiB));
  const std::shared_ptr<const PlacementTable> before = live.share();
  PlacementChange change;
  change.epoch = 1;
  const int was = before->owner_of(1, 0), now = was == 3 ? 2 : 3;
  change.changes = {{1, 0, {now}}};
  live.replace(live.next(change));
  EXPECT_EQ(live.current().epoch, 1u);
  EXPECT_EQ(live.current().owner_of(1, 0), now);
  EXPECT_EQ(before->epoch, 0u);
  EXPECT_EQ(before->owner_of(1, 0), was);
  EXPECT_THROW(live.replace(live.next(change)), Error) << "the same epoch again";
  PlacementTable other = make_placement(model(8), cpu_layout(4), PlacementPolicy::kBalanced, kGiB);
  other.epoch = 5;
  EXPECT_THROW(live.replace(other), Error) << "another shape";
}

}  // namespace
}  // namespace colibri
