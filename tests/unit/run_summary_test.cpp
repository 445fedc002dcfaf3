// --summary's lines (node/run_summary.h) for a hand-made cluster: two hosts, a coordinator and
// three cpu-expert ranks holding different numbers of experts per layer.
#include "node/run_summary.h"

#include <gtest/gtest.h>

namespace colibri {
namespace {

Layout two_host_layout() {
  Layout layout;
  const Role roles[] = {Role::kCoordinator, Role::kCpuExpert, Role::kCpuExpert, Role::kCpuExpert};
  for (int r = 0; r < 4; ++r) {
    RankSpec spec;
    spec.rank = r;
    spec.role = roles[r];
    layout.ranks.push_back(spec);
  }
  return layout;
}

std::vector<RankReport> reports_on(const std::vector<std::string>& hosts) {
  std::vector<RankReport> reports;
  for (size_t r = 0; r < hosts.size(); ++r) {
    RankReport report;
    report.rank = int(r);
    report.host = hosts[r];
    reports.push_back(report);
  }
  return reports;
}

// Layer 0 dense, layers 1 and 2 with 6 experts: rank 1 holds 2 and 3 (2.5 a layer), rank 2
// holds 2 and 2, rank 3 holds 2 and 1 (1.5 a layer).
PlacementTable uneven_table() {
  PlacementTable table;
  table.num_layers = 3;
  table.num_experts = 6;
  table.policy = "balanced";
  table.owner = {-1, -1, -1, -1, -1, -1, 1, 1, 2, 2, 3, 3, 1, 1, 1, 2, 2, 3};
  return table;
}

TEST(RunSummary, NamesRanksHostsExpertsSpeedAndSampling) {
  const RunSummary run{.prefill_tokens = 4,
                       .prefill_seconds = 0.02,
                       .decode_tokens = 10,
                       .decode_seconds = 0.5,
                       .ttft_seconds = 0.021};
  SamplingParams sampling;
  sampling.temperature = 0.7f;
  sampling.top_p = 0.9f;
  sampling.seed = 3;
  const std::string text = format_run_summary(uneven_table(), two_host_layout(),
                                              reports_on({"a", "a", "b", "b"}), run, sampling);
  EXPECT_EQ(text,
            "cluster: 4 ranks on 2 hosts (a, b): coordinator rank 0, cpu-expert ranks 1-3\n"
            "experts: 6 routed x 2 MoE layers, placement balanced; per layer 1.5 on rank 3, 2 on "
            "rank 2, 2.5 on rank 1\n"
            "speed: prefill 4 tokens in 0.020 s (first token after 0.021 s), decode 10 tokens in "
            "0.500 s = 20.0 tok/s\n"
            "sampling: temperature 0.7, top-p 0.9, seed 3 (--temp 0: greedy)\n");
}

TEST(RunSummary, OneProcessOwnsEverythingAndSamplesGreedily) {
  PlacementTable table = uneven_table();
  for (int& owner : table.owner)
    if (owner > 0) owner = 0;
  Layout alone;
  alone.ranks.emplace_back();
  alone.ranks[0].role = Role::kCoordinator;
  const std::string text =
      format_run_summary(table, alone, reports_on({"h"}), RunSummary{}, SamplingParams{});
  EXPECT_EQ(text,
            "cluster: 1 rank on 1 host (h): coordinator rank 0\n"
            "experts: 6 routed x 2 MoE layers, placement balanced; per layer 6 on rank 0\n"
            "speed: prefill 0 tokens in 0.000 s (first token after 0.000 s), decode 0 tokens in "
            "0.000 s = 0.0 tok/s\n"
            "sampling: greedy\n");
}

}  // namespace
}  // namespace colibri
