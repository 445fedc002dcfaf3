#include "node/run_summary.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>

namespace colibri {
namespace {

// "1", "1-6", "1-3, 5": ascending ranks as ranges.
std::string ranges(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? fmt::format("{}", ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]);
    i = j + 1;
  }
  return out;
}

std::string cluster_line(const Layout& layout, const std::vector<RankReport>& reports) {
  std::vector<std::string> hosts;
  for (const RankReport& r : reports)
    if (std::find(hosts.begin(), hosts.end(), r.host) == hosts.end()) hosts.push_back(r.host);
  std::map<Role, std::vector<int>> by_role;
  for (const RankSpec& spec : layout.ranks) by_role[spec.role].push_back(spec.rank);
  std::string roles;
  for (const auto& [role, ranks] : by_role)
    roles += fmt::format("{}{} {} {}", roles.empty() ? "" : ", ", role_name(role),
                         ranks.size() == 1 ? "rank" : "ranks", ranges(ranks));
  return fmt::format("cluster: {} {} on {} {} ({}): {}\n", layout.ranks.size(),
                     layout.ranks.size() == 1 ? "rank" : "ranks", hosts.size(),
                     hosts.size() == 1 ? "host" : "hosts", fmt::join(hosts, ", "), roles);
}

std::string experts_line(const PlacementTable& table, const Layout& layout) {
  int moe_layers = 0;
  for (int l = 0; l < table.num_layers; ++l)
    if (table.num_experts > 0 && table.owner_of(l, 0) != -1) ++moe_layers;
  std::string out = fmt::format("experts: {} routed x {} MoE layers, placement {}",
                                table.num_experts, moe_layers, table.policy);
  if (table.replica_count() > 0) out += fmt::format(" with {} replicas", table.replica_count());
  if (moe_layers == 0) return out + "\n";
  if (!table.slice_ranks.empty())
    return out + fmt::format("; every expert sliced over ranks {}\n", ranges(table.slice_ranks));
  // Owner ranks grouped by how many experts they hold per MoE layer (a mean when it varies).
  std::map<int, std::vector<int>> by_owned;  // experts over all MoE layers -> ranks
  for (const RankSpec& spec : layout.ranks)
    if (const int owned = table.count_owned(spec.rank); owned > 0)
      by_owned[owned].push_back(spec.rank);
  std::vector<std::string> parts;
  for (const auto& [owned, ranks] : by_owned)
    parts.push_back(fmt::format("{:.3g} on {} {}", double(owned) / moe_layers,
                                ranks.size() == 1 ? "rank" : "ranks", ranges(ranks)));
  return out + fmt::format("; per layer {}\n", fmt::join(parts, ", "));
}

}  // namespace

std::string format_run_summary(const PlacementTable& table, const Layout& layout,
                               const std::vector<RankReport>& reports, const RunSummary& run,
                               const SamplingParams& sampling) {
  std::string out = cluster_line(layout, reports) + experts_line(table, layout);
  out += fmt::format(
      "speed: prefill {} tokens in {:.3f} s (first token after {:.3f} s), decode {} tokens in "
      "{:.3f} s = {:.1f} tok/s\n",
      run.prefill_tokens, run.prefill_seconds, run.ttft_seconds, run.decode_tokens,
      run.decode_seconds, run.decode_seconds > 0 ? run.decode_tokens / run.decode_seconds : 0.0);
  out += sampling.temperature == 0
             ? std::string("sampling: greedy\n")
             : fmt::format("sampling: temperature {:g}, top-p {:g}, seed {} (--temp 0: greedy)\n",
                           sampling.temperature, sampling.top_p, sampling.seed);
  return out;
}

}  // namespace colibri
