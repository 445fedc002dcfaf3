// Layout files: parsing, every error a user can make (each must name file:line and the field),
// the default layout derived from the MPI world, a cereal round trip, and every committed
// hostfiles/*.layout against its hostfile.
#include <gtest/gtest.h>

#include <cereal/archives/binary.hpp>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/layout.h"
#include "moe/placement.h"
#include "transport/transport.h"

namespace colibri {
namespace {

// Parses `text` expecting an Error whose message contains every one of `parts`.
::testing::AssertionResult fails_with(const std::string& text, int world_size,
                                      std::initializer_list<std::string> parts) {
  try {
    parse_layout(text, "t.layout", world_size);
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const std::string& part : parts)
      if (message.find(part) == std::string::npos)
        return ::testing::AssertionFailure()
               << "message \"" << message << "\" lacks \"" << part << "\"";
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "parsed without an error";
}

TEST(Layout, RoleNames) {
  EXPECT_STREQ(role_name(Role::kCoordinator), "coordinator");
  EXPECT_STREQ(role_name(Role::kGpuExpert), "gpu-expert");
  EXPECT_STREQ(role_name(Role::kCpuExpert), "cpu-expert");
}

TEST(Layout, ParsesCommentsDashesAndOmittedColumns) {
  const std::string text =
      "# a layout\n"
      "\n"
      "   # indented comment\n"
      "0 coordinator - 0   # trailing comment\n"
      "1\tgpu-expert\t3\t1\t16.5\t28\r\n"
      "2 cpu-expert - 1 100\n"
      "3 cpu-expert\n"
      "4 gpu-expert 0 - - 7\n";
  const Layout layout = parse_layout(text, "t.layout", 5);
  EXPECT_EQ(layout.source, "t.layout");
  ASSERT_EQ(layout.ranks.size(), 5u);
  for (int r = 0; r < 5; ++r) EXPECT_EQ(layout.ranks[size_t(r)].rank, r);

  const RankSpec& coordinator = layout.ranks[0];
  EXPECT_EQ(coordinator.role, Role::kCoordinator);
  EXPECT_EQ(coordinator.gpu, -1);
  EXPECT_EQ(coordinator.numa, 0);
  EXPECT_EQ(coordinator.ram_gb, 0);
  EXPECT_EQ(coordinator.vram_gb, 0);

  const RankSpec& gpu = layout.ranks[1];
  EXPECT_EQ(gpu.role, Role::kGpuExpert);
  EXPECT_EQ(gpu.gpu, 3);
  EXPECT_EQ(gpu.numa, 1);
  EXPECT_EQ(gpu.ram_gb, 16.5);
  EXPECT_EQ(gpu.vram_gb, 28);

  const RankSpec& cpu = layout.ranks[2];
  EXPECT_EQ(cpu.role, Role::kCpuExpert);
  EXPECT_EQ(cpu.gpu, -1);
  EXPECT_EQ(cpu.numa, 1);
  EXPECT_EQ(cpu.ram_gb, 100);
  EXPECT_EQ(cpu.vram_gb, 0);

  const RankSpec& bare = layout.ranks[3];
  EXPECT_EQ(bare.role, Role::kCpuExpert);
  EXPECT_EQ(bare.gpu, -1);
  EXPECT_EQ(bare.numa, -1);
  EXPECT_EQ(bare.ram_gb, 0);

  const RankSpec& gpu_vram_only = layout.ranks[4];
  EXPECT_EQ(gpu_vram_only.gpu, 0);
  EXPECT_EQ(gpu_vram_only.numa, -1);
  EXPECT_EQ(gpu_vram_only.ram_gb, 0);
  EXPECT_EQ(gpu_vram_only.vram_gb, 7);

  EXPECT_EQ(layout.coordinator(), 0);
  EXPECT_EQ(layout.expert_ranks(), (std::vector<int>{1, 2, 3, 4}));
}

// One rank per GPU and host: the same device on two hosts is fine, twice on one host is not.
TEST(Layout, OneRankPerGpuOnEachHost) {
  const std::string text =
      "0 coordinator - - - - a\n1 gpu-expert 0 - - - a\n2 gpu-expert 0 - - - b\n"
      "3 gpu-expert 1 - - - b\n";
  EXPECT_NO_THROW(check_one_rank_per_gpu(parse_layout(text, "t.layout", 4)));
  Layout shared = parse_layout(text + "4 gpu-expert 1 - - - b\n", "t.layout", 5);
  try {
    check_one_rank_per_gpu(shared);
    ADD_FAILURE() << "two ranks on GPU 1 of host b accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "t.layout: ranks 3 and 4 both use GPU 1 on host b (one rank per GPU)");
  }
}

TEST(Layout, RanksMayComeInAnyOrderAndAnyRankMayCoordinate) {
  const Layout layout =
      parse_layout("2 cpu-expert\n0 gpu-expert 0\n1 coordinator\n", "t.layout", 3);
  EXPECT_EQ(layout.coordinator(), 1);
  EXPECT_EQ(layout.expert_ranks(), (std::vector<int>{0, 2}));
  EXPECT_EQ(layout.ranks[0].role, Role::kGpuExpert);
  EXPECT_EQ(layout.ranks[2].role, Role::kCpuExpert);
}

TEST(Layout, SingleRankWorldIsOneCoordinator) {
  const Layout layout = parse_layout("0 coordinator\n", "t.layout", 1);
  EXPECT_EQ(layout.coordinator(), 0);
  EXPECT_TRUE(layout.expert_ranks().empty());
}

TEST(Layout, UnknownRole) {
  EXPECT_TRUE(fails_with("0 coordinator\n1 gpu 0\n", 2, {"t.layout:2:", "role 'gpu' is unknown"}));
  EXPECT_TRUE(
      fails_with("0 Coordinator\n1 cpu-expert\n", 2, {"t.layout:1:", "role 'Coordinator'"}));
}

TEST(Layout, RankNotAnInteger) {
  EXPECT_TRUE(fails_with("0 coordinator\nx cpu-expert\n", 2,
                         {"t.layout:2:", "rank 'x' is not an integer"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1.5 cpu-expert\n", 2,
                         {"t.layout:2:", "rank '1.5' is not an integer"}));
}

TEST(Layout, RankOutOfRange) {
  EXPECT_TRUE(fails_with("0 coordinator\n7 cpu-expert\n", 7,
                         {"t.layout:2:", "rank 7 is out of range [0, 7)"}));
  EXPECT_TRUE(
      fails_with("# x\n-1 coordinator\n", 1, {"t.layout:2:", "rank -1 is out of range [0, 1)"}));
}

TEST(Layout, DuplicateRank) {
  EXPECT_TRUE(fails_with("0 coordinator\n1 cpu-expert\n1 cpu-expert\n", 3,
                         {"t.layout:3:", "rank 1 is a duplicate", "line 2"}));
}

TEST(Layout, MissingRanks) {
  EXPECT_TRUE(fails_with("0 coordinator\n1 cpu-expert\n", 3, {"t.layout:", "rank 2 missing"}));
  EXPECT_TRUE(
      fails_with("0 coordinator\n3 cpu-expert\n", 5, {"t.layout:", "ranks 1, 2, 4 missing"}));
}

TEST(Layout, ExactlyOneCoordinator) {
  EXPECT_TRUE(fails_with("0 cpu-expert\n1 cpu-expert\n", 2, {"t.layout:", "no coordinator"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1 cpu-expert\n2 coordinator\n", 3,
                         {"t.layout:3:", "rank 2 is a second coordinator", "rank 0 at line 1"}));
}

TEST(Layout, GpuOnlyOnGpuExperts) {
  EXPECT_TRUE(fails_with("0 coordinator\n1 cpu-expert 0\n", 2,
                         {"t.layout:2:", "gpu 0 is set on cpu-expert rank 1"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1 gpu-expert\n", 2,
                         {"t.layout:2:", "gpu is missing on gpu-expert rank 1"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1 gpu-expert -\n", 2,
                         {"t.layout:2:", "gpu is missing on gpu-expert rank 1"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1 cpu-expert - - 10 8\n", 2,
                         {"t.layout:2:", "vram_gb is set on cpu-expert rank 1"}));
}

TEST(Layout, BadNumbers) {
  EXPECT_TRUE(fails_with("0 coordinator\n1 cpu-expert - 0 -5\n", 2,
                         {"t.layout:2:", "ram_gb -5 is negative"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1 gpu-expert 0 0 1 -0.5\n", 2,
                         {"t.layout:2:", "vram_gb -0.5 is negative"}));
  EXPECT_TRUE(
      fails_with("0 coordinator\n1 gpu-expert -2\n", 2, {"t.layout:2:", "gpu -2 is negative"}));
  EXPECT_TRUE(
      fails_with("0 coordinator\n1 cpu-expert - -1\n", 2, {"t.layout:2:", "numa -1 is negative"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1 cpu-expert - 0 lots\n", 2,
                         {"t.layout:2:", "ram_gb 'lots' is not a number"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1 cpu-expert - 0 inf\n", 2,
                         {"t.layout:2:", "ram_gb 'inf' is not a number"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1 gpu-expert one\n", 2,
                         {"t.layout:2:", "gpu 'one' is not an integer"}));
}

TEST(Layout, TooManyOrTooFewColumns) {
  EXPECT_TRUE(fails_with("0 coordinator - - - - node-a extra\n", 1,
                         {"t.layout:1:", "8 columns, expected at most 7"}));
  EXPECT_TRUE(fails_with("0 coordinator\n1\n", 2, {"t.layout:2:", "role is missing"}));
}

TEST(Layout, NeedsAnExpertRank) {
  EXPECT_TRUE(fails_with("0 coordinator\n", 2, {"t.layout:", "no expert rank"}));
  EXPECT_TRUE(fails_with("", 1, {"t.layout:", "no coordinator"}));
}

TEST(Layout, LoadsFilesAndNamesMissingOnes) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "layout_test";
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / "two.layout";
  std::ofstream(path) << "0 coordinator\n1 gpu-expert 0 0 8 24\n";
  const Layout layout = load_layout(path, 2);
  EXPECT_EQ(layout.source, path.string());
  EXPECT_EQ(layout.ranks[1].vram_gb, 24);

  std::ofstream(path, std::ios::app) << "2 gpu-expert\n";
  try {
    load_layout(path, 3);
    ADD_FAILURE() << "parsed without an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(path.string() + ":3: gpu is missing"),
              std::string::npos)
        << error.what();
  }
  try {
    load_layout(dir / "absent.layout", 2);
    ADD_FAILURE() << "loaded a missing file";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("absent.layout: cannot open"), std::string::npos)
        << error.what();
  }
}

// `value` written to a cereal binary archive and read back, as the handshake broadcasts it.
template <class T>
T cereal_round_trip(const T& value) {
  std::stringstream stream;
  {
    cereal::BinaryOutputArchive out(stream);
    out(value);
  }
  T back;
  {
    cereal::BinaryInputArchive in(stream);
    in(back);
  }
  return back;
}

TEST(Layout, CerealBinaryRoundTrip) {
  const Layout layout = parse_layout(
      "0 coordinator - 1\n1 gpu-expert 5 0 16.25 27.5 node-b\n2 cpu-expert - 1 99.75 -\n",
      "rt.layout", 3);
  const Layout back = cereal_round_trip(layout);
  EXPECT_EQ(back.source, "rt.layout");
  ASSERT_EQ(back.ranks.size(), layout.ranks.size());
  for (size_t r = 0; r < layout.ranks.size(); ++r) {
    SCOPED_TRACE(r);
    EXPECT_EQ(back.ranks[r].rank, layout.ranks[r].rank);
    EXPECT_EQ(back.ranks[r].role, layout.ranks[r].role);
    EXPECT_EQ(back.ranks[r].gpu, layout.ranks[r].gpu);
    EXPECT_EQ(back.ranks[r].numa, layout.ranks[r].numa);
    EXPECT_EQ(back.ranks[r].ram_gb, layout.ranks[r].ram_gb);
    EXPECT_EQ(back.ranks[r].vram_gb, layout.ranks[r].vram_gb);
    EXPECT_EQ(back.ranks[r].host, layout.ranks[r].host);
  }
  EXPECT_EQ(back.ranks[1].host, "node-b");
  EXPECT_EQ(back.ranks[2].host, "");
  EXPECT_EQ(back.ranks[1].gpu, 5);  // not all defaults
  EXPECT_EQ(back.ranks[2].ram_gb, 99.75);
}

// ---- placement by host -----------------------------------------------------------------------

// A DeepSeek-V3-shaped MoE (256 experts in 8 groups, top-4 groups) over 4 hosts of 1, 2, 2 and 1
// expert ranks; the coordinator shares host a.
TEST(PlacementHosts, WholeGroupsPerHostInProportionToBudgets) {
  ModelConfig config;
  config.num_layers = 3;
  config.layer_is_moe = {false, true, true};
  config.n_routed_experts = 256;
  config.n_group = 8;
  config.topk_group = 4;
  const Layout layout = parse_layout(
      "0 coordinator - - - - a\n1 cpu-expert - - - - a\n2 cpu-expert - - - - b\n"
      "3 cpu-expert - - - - b\n4 cpu-expert - - - - c\n5 cpu-expert - - - - c\n"
      "6 cpu-expert - - - - d\n",
      "hosts.layout", 7);
  const PlacementTable table = make_placement(config, layout, PlacementPolicy::kHosts, 1000);
  EXPECT_EQ(table.policy, "hosts");
  const auto host_of = [&](int rank) { return layout.ranks[size_t(rank)].host; };
  for (int l = 1; l < 3; ++l) {
    std::map<std::string, int> experts_on;
    for (int g = 0; g < 8; ++g) {
      std::set<std::string> hosts;
      for (int e = g * 32; e < (g + 1) * 32; ++e) {
        hosts.insert(host_of(table.owner_of(l, e)));
        ++experts_on[host_of(table.owner_of(l, e))];
      }
      EXPECT_EQ(hosts.size(), 1u) << "layer " << l << " group " << g << " spans hosts";
    }
    // Budgets 1:2:2:1 (equal per rank): groups 1, 3, 3 and 1.
    EXPECT_EQ(experts_on["a"], 32);
    EXPECT_EQ(experts_on["b"], 96);
    EXPECT_EQ(experts_on["c"], 96);
    EXPECT_EQ(experts_on["d"], 32);
  }
  // Within a host, balanced over its ranks.
  EXPECT_EQ(table.count_owned(2), 96);
  EXPECT_EQ(table.count_owned(3), 96);
  EXPECT_EQ(table.count_owned(0), 0);
  const std::string printed = format_placement(table, layout, 1 << 20);
  EXPECT_NE(printed.find("host b                  2 ranks    192 experts      192.0 MiB"),
            std::string::npos)
      << printed;
}

// Budgets move the boundaries; fewer groups than hosts: blocks of single experts.
TEST(PlacementHosts, BudgetsAndUngroupedExperts) {
  ModelConfig config;
  config.num_layers = 1;
  config.layer_is_moe = {true};
  config.n_routed_experts = 12;
  config.n_group = 1;
  const Layout layout = parse_layout(
      "0 coordinator - - - - a\n1 cpu-expert - - 30 - b\n2 cpu-expert - - 10 - c\n"
      "3 cpu-expert - - 20 - c\n",
      "budgets.layout", 4);
  const PlacementTable table = make_placement(config, layout, PlacementPolicy::kHosts, 1);
  // Host b holds 30 of 60 GB: experts 0-5; host c the rest.
  for (int e = 0; e < 12; ++e) {
    SCOPED_TRACE(e);
    if (e < 6)
      EXPECT_EQ(table.owner_of(0, e), 1);
    else
      EXPECT_NE(table.owner_of(0, e), 1);
  }
  EXPECT_EQ(table.count_owned(2) + table.count_owned(3), 6);
  EXPECT_GT(table.count_owned(3), table.count_owned(2));
}

// A ram_gb budget on the coordinator's row makes it an owner, placed like an expert rank in
// proportion to its budget; without one it owns nothing.
TEST(Placement, CoordinatorWithABudgetOwnsItsShare) {
  ModelConfig config;
  config.num_layers = 2;
  config.layer_is_moe = {false, true};
  config.n_routed_experts = 16;
  const Layout owning =
      parse_layout("0 coordinator - - 1\n1 cpu-expert - - 3\n", "owning.layout", 2);
  EXPECT_TRUE(owning.coordinator_owns_experts());
  EXPECT_EQ(owning.owner_ranks(), (std::vector<int>{0, 1}));
  EXPECT_EQ(owning.expert_ranks(), (std::vector<int>{1}));
  const PlacementTable table = make_placement(config, owning, PlacementPolicy::kBalanced, 1);
  EXPECT_EQ(table.count_owned(0), 4);
  EXPECT_EQ(table.count_owned(1), 12);

  const Layout plain = parse_layout("0 coordinator\n1 cpu-expert - - 3\n", "plain.layout", 2);
  EXPECT_FALSE(plain.coordinator_owns_experts());
  EXPECT_EQ(plain.owner_ranks(), (std::vector<int>{1}));
  EXPECT_EQ(make_placement(config, plain, PlacementPolicy::kBalanced, 1).count_owned(0), 0);
  EXPECT_TRUE(parse_layout("0 coordinator\n", "alone.layout", 1).coordinator_owns_experts());
}

// sliced: every owner holds every routed expert, a slice of its intermediate rows in proportion to
// its budget; the dispatch sends every pair to every owner; the table survives the broadcast.
TEST(Placement, SlicedGivesEveryOwnerASliceOfEveryExpert) {
  ModelConfig config;
  config.num_layers = 2;
  config.layer_is_moe = {false, true};
  config.n_routed_experts = 16;
  config.moe_intermediate_size = 2048;
  const Layout layout =
      parse_layout("0 coordinator - - 6\n1 cpu-expert - - 10\n", "sliced.layout", 2);
  const PlacementTable table = make_placement(config, layout, PlacementPolicy::kSliced, 1);
  EXPECT_EQ(table.policy, "sliced");
  EXPECT_EQ(table.slice_ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(table.slice_bounds, (std::vector<int64_t>{0, 768, 2048}));
  EXPECT_EQ(table.slice_of(0).begin, 0);
  EXPECT_EQ(table.slice_of(0).end, 768);
  EXPECT_EQ(table.slice_of(1).begin, 768);
  EXPECT_EQ(table.slice_of(1).end, 2048);
  EXPECT_TRUE(table.slice_of(2).whole());
  for (int e = 0; e < 16; ++e) {
    EXPECT_FALSE(table.holds(0, e, 0) || table.holds(0, e, 1)) << "dense layer 0";
    EXPECT_TRUE(table.holds(1, e, 0) && table.holds(1, e, 1)) << e;
  }
  EXPECT_EQ(table.count_owned(0), 16);
  EXPECT_EQ(table.experts_of(1, 1).size(), 16u);

  Routing routing;
  routing.top_k = 2;
  routing.expert = {3, 9, 0, 15};
  routing.weight = {0.25f, 0.75f, 0.5f, 0.5f};
  DispatchPlan plan;
  plan.build(table, 1, routing, 2);
  ASSERT_EQ(plan.owners.size(), 2u);
  for (const OwnerShare& share : plan.owners) {
    EXPECT_EQ(share.rows, (std::vector<int>{0, 1}));
    ASSERT_EQ(share.pairs.size(), 4u);
    EXPECT_EQ(share.pairs[1].expert, 9u);
    EXPECT_EQ(share.pairs[1].weight, 0.75f);
  }
  EXPECT_EQ(plan.owners[0].rank, 0);
  EXPECT_EQ(plan.owners[1].rank, 1);

  const PlacementTable back = cereal_round_trip(table);
  EXPECT_EQ(back.slice_ranks, table.slice_ranks);
  EXPECT_EQ(back.slice_bounds, table.slice_bounds);
  EXPECT_EQ(back.owner, table.owner);

  // One owner holds its experts whole; a GPU rank cannot hold slices.
  const Layout alone = parse_layout("0 coordinator\n1 cpu-expert\n", "one.layout", 2);
  const PlacementTable whole = make_placement(config, alone, PlacementPolicy::kSliced, 1);
  EXPECT_TRUE(whole.slice_ranks.empty());
  EXPECT_EQ(whole.owner_of(1, 5), 1);
  const Layout gpu = parse_layout("0 coordinator\n1 gpu-expert 0\n2 cpu-expert\n", "g.layout", 3);
  try {
    make_placement(config, gpu, PlacementPolicy::kSliced, 1);
    ADD_FAILURE() << "a gpu-expert rank was given slices";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 is a gpu-expert rank"), std::string::npos)
        << e.what();
  }
}

TEST(Layout, CoordinatorExpertsRunOnItsCpu) {
  EXPECT_TRUE(fails_with("0 coordinator 0 - 4 8\n1 cpu-expert\n", 2,
                         {"t.layout:1:", "vram_gb is set on the coordinator"}));
}

// ---- default_layout ------------------------------------------------------------------------

std::vector<Role> roles(const Layout& layout) {
  std::vector<Role> out;
  for (const RankSpec& spec : layout.ranks) out.push_back(spec.role);
  return out;
}
std::vector<int> gpus(const Layout& layout) {
  std::vector<int> out;
  for (const RankSpec& spec : layout.ranks) out.push_back(spec.gpu);
  return out;
}

constexpr Role C = Role::kCoordinator, G = Role::kGpuExpert, X = Role::kCpuExpert;

TEST(DefaultLayout, WorldOfOneIsASingleCoordinator) {
  const Layout layout = default_layout(1, {0}, {0}, {0});
  EXPECT_EQ(layout.source, "default");
  EXPECT_EQ(roles(layout), (std::vector<Role>{C}));
  EXPECT_EQ(layout.coordinator(), 0);
  EXPECT_TRUE(layout.expert_ranks().empty());
  // A GPU on the host does not make the lone coordinator an expert.
  EXPECT_EQ(roles(default_layout(1, {0}, {4}, {0})), (std::vector<Role>{C}));
}

TEST(DefaultLayout, SevenRanksWithoutGpus) {
  const Layout layout =
      default_layout(7, {0, 1, 2, 3, 4, 5, 6}, std::vector<int>(7, 0), std::vector<int>(7, 0));
  EXPECT_EQ(roles(layout), (std::vector<Role>{C, X, X, X, X, X, X}));
  EXPECT_EQ(gpus(layout), std::vector<int>(7, -1));
  EXPECT_EQ(layout.expert_ranks(), (std::vector<int>{1, 2, 3, 4, 5, 6}));
  for (int r = 0; r < 7; ++r) EXPECT_EQ(layout.ranks[size_t(r)].rank, r);
}

TEST(DefaultLayout, SevenRanksOnSixGpus) {
  const Layout layout =
      default_layout(7, {0, 1, 2, 3, 4, 5, 6}, std::vector<int>(7, 6), std::vector<int>(7, 0));
  EXPECT_EQ(roles(layout), (std::vector<Role>{C, G, G, G, G, G, G}));
  EXPECT_EQ(gpus(layout), (std::vector<int>{-1, 0, 1, 2, 3, 4, 5}));
}

TEST(DefaultLayout, MoreExpertRanksThanGpusShareThem) {
  const Layout layout =
      default_layout(7, {0, 1, 2, 3, 4, 5, 6}, std::vector<int>(7, 2), std::vector<int>(7, 0));
  EXPECT_EQ(gpus(layout), (std::vector<int>{-1, 0, 1, 0, 1, 0, 1}));
}

TEST(DefaultLayout, TwoHosts) {
  // Ranks 0-4 on host 0 and 5-9 on host 1, 4 GPUs each: the coordinator's host counts GPUs
  // from local rank 1, the other host from local rank 0.
  const std::vector<int> local = {0, 1, 2, 3, 4, 0, 1, 2, 3, 4};
  const std::vector<int> host = {0, 0, 0, 0, 0, 1, 1, 1, 1, 1};
  const Layout layout = default_layout(10, local, std::vector<int>(10, 4), host);
  EXPECT_EQ(roles(layout), (std::vector<Role>{C, G, G, G, G, G, G, G, G, G}));
  EXPECT_EQ(gpus(layout), (std::vector<int>{-1, 0, 1, 2, 3, 0, 1, 2, 3, 0}));

  // A second host without GPUs serves CPU experts.
  const Layout mixed = default_layout(10, local, {2, 2, 2, 2, 2, 0, 0, 0, 0, 0}, host);
  EXPECT_EQ(roles(mixed), (std::vector<Role>{C, G, G, G, G, X, X, X, X, X}));
  EXPECT_EQ(gpus(mixed), (std::vector<int>{-1, 0, 1, 0, 1, -1, -1, -1, -1, -1}));
}

TEST(DefaultLayout, RejectsMismatchedSizes) {
  EXPECT_THROW(default_layout(3, {0, 1}, {0, 0, 0}, {0, 0, 0}), std::invalid_argument);
  EXPECT_THROW(default_layout(0, {}, {}, {}), std::invalid_argument);
}

// ---- committed layouts ---------------------------------------------------------------------

const std::filesystem::path kHostfiles = COLIBRI_HOSTFILES_DIR;

// The ranks a layout file lists: every line that is not blank or a comment.
int count_ranks(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  int ranks = 0;
  while (std::getline(in, line)) {
    line = line.substr(0, line.find('#'));
    if (line.find_first_not_of(" \t\r") != std::string::npos) ++ranks;
  }
  return ranks;
}

// Total slots of an Open MPI hostfile ("host slots=N"; 1 when slots is not given).
int count_slots(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  int slots = 0;
  while (std::getline(in, line)) {
    std::istringstream words(line.substr(0, line.find('#')));
    std::string host, word;
    if (!(words >> host)) continue;
    int host_slots = 1;
    while (words >> word)
      if (word.rfind("slots=", 0) == 0) host_slots = std::stoi(word.substr(6));
    slots += host_slots;
  }
  return slots;
}

TEST(CommittedLayouts, ParseAndMatchTheirHostfiles) {
  std::vector<std::filesystem::path> layouts;
  for (const auto& entry : std::filesystem::directory_iterator(kHostfiles))
    if (entry.path().extension() == ".layout") layouts.push_back(entry.path());
  ASSERT_GE(layouts.size(), 4u) << "expected localhost, seed and two-host layouts in "
                                << kHostfiles;
  for (const std::filesystem::path& path : layouts) {
    SCOPED_TRACE(path.string());
    const int world_size = count_ranks(path);
    Layout layout;
    ASSERT_NO_THROW(layout = load_layout(path, world_size));
    EXPECT_GE(layout.coordinator(), 0);
    EXPECT_EQ(int(layout.expert_ranks().size()), world_size - 1);

    std::filesystem::path hostfile = path;
    hostfile.replace_extension();
    ASSERT_TRUE(std::filesystem::exists(hostfile)) << "no hostfile " << hostfile;
    EXPECT_EQ(count_slots(hostfile), world_size) << hostfile;
  }
}

TEST(CommittedLayouts, SeedMachine) {
  const Layout gpus_only = load_layout(kHostfiles / "seed-6x5090.layout", 7);
  std::set<int> devices;
  for (int r : gpus_only.expert_ranks()) {
    const RankSpec& spec = gpus_only.ranks[size_t(r)];
    EXPECT_EQ(spec.role, Role::kGpuExpert) << r;
    EXPECT_LE(spec.vram_gb, 32) << r;
    devices.insert(spec.gpu);
  }
  EXPECT_EQ(devices, (std::set<int>{0, 1, 2, 3, 4, 5}));

  const Layout numa = load_layout(kHostfiles / "seed-6x5090-numa.layout", 9);
  EXPECT_EQ(numa.ranks[7].role, Role::kCpuExpert);
  EXPECT_EQ(numa.ranks[8].role, Role::kCpuExpert);
  EXPECT_EQ(std::set<int>({numa.ranks[7].numa, numa.ranks[8].numa}), (std::set<int>{0, 1}));
  double ram_gb = 0;
  for (const RankSpec& spec : numa.ranks) ram_gb += spec.ram_gb;
  EXPECT_LT(ram_gb, 251) << "budgets exceed the machine's RAM";

  // NCCL: the coordinator on GPU 0, gpu-expert ranks on GPUs 1-5, one CPU expert rank; one rank
  // per GPU (NCCL refuses two).
  Layout nccl = load_layout(kHostfiles / "seed-6x5090-nccl.layout", 7);
  EXPECT_EQ(nccl.coordinator(), 0);
  EXPECT_EQ(nccl.ranks[0].gpu, 0);
  std::set<int> nccl_devices{nccl.ranks[0].gpu};
  for (int r = 1; r <= 5; ++r) {
    EXPECT_EQ(nccl.ranks[size_t(r)].role, Role::kGpuExpert) << r;
    EXPECT_LE(nccl.ranks[size_t(r)].vram_gb, 32) << r;
    nccl_devices.insert(nccl.ranks[size_t(r)].gpu);
  }
  EXPECT_EQ(nccl_devices, (std::set<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(nccl.ranks[6].role, Role::kCpuExpert);
  for (RankSpec& spec : nccl.ranks) spec.host = "seed";
  EXPECT_NO_THROW(check_one_rank_per_gpu(nccl));
  ram_gb = 0;
  for (const RankSpec& spec : nccl.ranks) ram_gb += spec.ram_gb;
  EXPECT_LT(ram_gb, 251) << "budgets exceed the machine's RAM";
}

}  // namespace
}  // namespace colibri
