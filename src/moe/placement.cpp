#include "moe/placement.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"

namespace colibri {

PlacementPolicy parse_placement_policy(const std::string& name) {
  if (name == "balanced") return PlacementPolicy::kBalanced;
  if (name == "round-robin") return PlacementPolicy::kRoundRobin;
  if (name == "contiguous") return PlacementPolicy::kContiguous;
  if (name == "hosts") return PlacementPolicy::kHosts;
  if (name == "sliced") return PlacementPolicy::kSliced;
  if (name == "heat") return PlacementPolicy::kHeat;
  fail("--placement '{}' is unknown (balanced, round-robin, contiguous, hosts, sliced, heat)",
       name);
}

const char* placement_policy_name(PlacementPolicy policy) {
  switch (policy) {
    case PlacementPolicy::kBalanced:
      return "balanced";
    case PlacementPolicy::kRoundRobin:
      return "round-robin";
    case PlacementPolicy::kContiguous:
      return "contiguous";
    case PlacementPolicy::kHosts:
      return "hosts";
    case PlacementPolicy::kSliced:
      return "sliced";
    case PlacementPolicy::kHeat:
      return "heat";
  }
  return "?";
}

bool PlacementTable::holds(int layer, int expert, int rank) const {
  const int o = owner_of(layer, expert);
  if (o == rank) return true;
  if (o == kSliced)
    return std::find(slice_ranks.begin(), slice_ranks.end(), rank) != slice_ranks.end();
  const std::vector<int>& more = replicas_of(layer, expert);
  return std::find(more.begin(), more.end(), rank) != more.end();
}

int PlacementTable::replica_count() const {
  int count = 0;
  for (const std::vector<int>& more : replicas) count += int(more.size());
  return count;
}

ExpertSlice PlacementTable::slice_of(int rank) const {
  const auto it = std::find(slice_ranks.begin(), slice_ranks.end(), rank);
  if (it == slice_ranks.end()) return {};
  const auto i = size_t(it - slice_ranks.begin());
  return {slice_bounds[i], slice_bounds[i + 1]};
}

double PlacementTable::held_fraction(int rank) const {
  const ExpertSlice slice = slice_of(rank);
  return slice.whole() ? 1.0 : double(slice.end - slice.begin) / double(slice_bounds.back());
}

std::vector<int> PlacementTable::experts_of(int rank, int layer) const {
  std::vector<int> out;
  for (int e = 0; e < num_experts; ++e)
    if (holds(layer, e, rank)) out.push_back(e);
  return out;
}

int PlacementTable::count_owned(int rank) const {
  int count = 0;
  for (int l = 0; l < num_layers; ++l)
    for (int e = 0; e < num_experts; ++e) count += holds(l, e, rank);
  return count;
}

PlacementTable make_placement(const ModelConfig& config, const Layout& layout,
                              PlacementPolicy policy, uint64_t bytes_per_expert,
                              const RoutingStats* stats, int replicas) {
  if (replicas > 0 && policy != PlacementPolicy::kHeat)
    fail("--replicas {} needs --placement heat (replicas go to the hottest experts)", replicas);
  if (policy == PlacementPolicy::kHeat)
    return place_by_heat(config, layout, bytes_per_expert, stats, replicas);
  PlacementTable table;
  table.num_layers = config.num_layers;
  table.num_experts = config.n_routed_experts;
  table.policy = placement_policy_name(policy);
  table.owner.assign(size_t(table.num_layers) * table.num_experts, -1);
  std::vector<int> ranks = layout.owner_ranks();
  if (ranks.empty()) ranks.push_back(layout.coordinator());
  const int r = int(ranks.size()), experts = table.num_experts;

  std::vector<double> capacity(size_t(r), 1.0);
  for (int i = 0; i < r; ++i) {
    const RankSpec& spec = layout.ranks[size_t(ranks[size_t(i)])];
    if (spec.ram_gb + spec.vram_gb > 0) capacity[size_t(i)] = spec.ram_gb + spec.vram_gb;
  }
  std::vector<double> assigned(size_t(r), 0.0);
  // hosts: the host of each expert rank (index into host_ranks), and each expert id's host.
  std::vector<int> host_of_rank(size_t(r), 0), host_of_expert(size_t(experts), 0);
  std::vector<std::vector<int>> host_ranks;
  if (policy == PlacementPolicy::kHosts) {
    std::vector<std::string> names;
    std::vector<double> host_capacity;
    for (int i = 0; i < r; ++i) {
      const std::string& name = layout.ranks[size_t(ranks[size_t(i)])].host;
      auto it = std::find(names.begin(), names.end(), name);
      if (it == names.end()) {
        it = names.insert(names.end(), name);
        host_ranks.emplace_back();
        host_capacity.push_back(0);
      }
      const auto h = size_t(it - names.begin());
      host_of_rank[size_t(i)] = int(h);
      host_ranks[h].push_back(i);
      host_capacity[h] += capacity[size_t(i)];
    }
    // Units of whole expert groups when every host can get one, else single experts; unit u
    // goes to the host whose share of the summed capacity holds its middle.
    const int groups = config.n_group;
    const int unit = groups > 1 && experts % groups == 0 && size_t(groups) >= names.size()
                         ? experts / groups
                         : 1;
    const int units = experts / unit;
    double total = 0;
    for (double c : host_capacity) total += c;
    for (int u = 0; u < units; ++u) {
      const double middle = (double(u) + 0.5) * total / double(units);
      size_t h = 0;
      double end = host_capacity[0];
      while (h + 1 < host_capacity.size() && end <= middle) end += host_capacity[++h];
      for (int e = u * unit; e < (u + 1) * unit; ++e) host_of_expert[size_t(e)] = int(h);
    }
  }
  if (policy == PlacementPolicy::kSliced && r > 1) {
    for (int rank : ranks)
      if (layout.ranks[size_t(rank)].role == Role::kGpuExpert)
        fail("--placement sliced: rank {} is a gpu-expert rank; sliced experts run on CPU ranks",
             rank);
    table.slice_ranks = ranks;
    table.slice_bounds = expert_slice_bounds(config.moe_intermediate_size, capacity);
    for (int l = 0; l < table.num_layers; ++l)
      if (config.layer_is_moe[size_t(l)])
        std::fill_n(table.owner.begin() + int64_t(l) * experts, experts, PlacementTable::kSliced);
    return table;
  }
  int moe_index = 0;
  for (int l = 0; l < table.num_layers; ++l) {
    if (!config.layer_is_moe[size_t(l)]) continue;
    for (int e = 0; e < experts; ++e) {
      int pick = 0;
      switch (policy) {
        case PlacementPolicy::kHeat:    // place_by_heat
        case PlacementPolicy::kSliced:  // one owner: it holds them whole
        case PlacementPolicy::kRoundRobin:
          pick = int((int64_t(moe_index) * experts + e) % r);
          break;
        case PlacementPolicy::kContiguous:
          pick = int(int64_t(e) * r / experts);
          break;
        case PlacementPolicy::kBalanced: {
          double best = 0;
          for (int j = 0; j < r; ++j) {
            const int candidate = (j + moe_index) % r;
            const double fill = (assigned[size_t(candidate)] + double(bytes_per_expert)) /
                                capacity[size_t(candidate)];
            if (j == 0 || fill < best) {
              best = fill;
              pick = candidate;
            }
          }
          break;
        }
        case PlacementPolicy::kHosts: {  // balanced within the expert's host
          const std::vector<int>& local = host_ranks[size_t(host_of_expert[size_t(e)])];
          const int n_local = int(local.size());
          double best = 0;
          for (int j = 0; j < n_local; ++j) {
            const int candidate = local[size_t((j + moe_index + e) % n_local)];
            const double fill = (assigned[size_t(candidate)] + double(bytes_per_expert)) /
                                capacity[size_t(candidate)];
            if (j == 0 || fill < best) {
              best = fill;
              pick = candidate;
            }
          }
          break;
        }
      }
      assigned[size_t(pick)] += double(bytes_per_expert);
      table.owner[size_t(l) * experts + e] = ranks[size_t(pick)];
    }
    ++moe_index;
  }
  return table;
}

std::string format_placement(const PlacementTable& table, const Layout& layout,
                             uint64_t bytes_per_expert) {
  std::string out = fmt::format("placement ({}): {} layers x {} routed experts", table.policy,
                                table.num_layers, table.num_experts);
  if (!table.replicas.empty()) out += fmt::format(", {} replicas", table.replica_count());
  out += '\n';
  // Expected routes: from the routing statistics under heat, else as if routing were uniform.
  const ExpectedLoad load = expected_load(table, layout);
  for (const RankSpec& spec : layout.ranks) {
    const int owned = table.count_owned(spec.rank);
    out += fmt::format(
        "  rank {:>3} {:<12} {:>6} experts {:>10.1f} MiB  routes {:>5.1f} %  numa {:<2} {}",
        spec.rank, role_name(spec.role), owned,
        double(owned) * double(bytes_per_expert) * table.held_fraction(spec.rank) / (1 << 20),
        100 * load.share[size_t(spec.rank)], spec.numa >= 0 ? std::to_string(spec.numa) : "-",
        spec.host);
    const ExpertSlice slice = table.slice_of(spec.rank);
    if (!slice.whole()) out += fmt::format("  intermediate rows {}..{}", slice.begin, slice.end);
    // Its bytes per tier by its budgets: VRAM (a gpu-expert's vram_gb), RAM (ram_gb), the rest
    // read from disk; an unset budget holds everything given to it.
    const double held =
        double(owned) * double(bytes_per_expert) * table.held_fraction(spec.rank) / (1 << 20);
    if (owned > 0 && spec.ram_gb + spec.vram_gb > 0) {
      const double vram = spec.role == Role::kGpuExpert ? std::min(held, spec.vram_gb * 1024) : 0.0;
      const double ram = spec.ram_gb > 0 ? std::min(held - vram, spec.ram_gb * 1024) : held - vram;
      out += fmt::format("  tiers: vram {:.1f}, ram {:.1f}, disk {:.1f} MiB", vram, ram,
                         held - vram - ram);
    }
    out += '\n';
  }
  out += fmt::format("  expected routes of the busiest owner / the mean, worst layer: {:.2f}{}\n",
                     load.max_over_mean, table.heat.empty() ? " (uniform routing)" : "");
  // Per host (the layout's host column): its ranks, experts and bytes.
  std::vector<std::string> hosts;
  for (const RankSpec& spec : layout.ranks)
    if (std::find(hosts.begin(), hosts.end(), spec.host) == hosts.end()) hosts.push_back(spec.host);
  for (const std::string& host : hosts) {
    int n_ranks = 0, owned = 0;
    double bytes = 0;
    for (const RankSpec& spec : layout.ranks)
      if (spec.host == host) {
        ++n_ranks;
        owned += table.count_owned(spec.rank);
        bytes += double(table.count_owned(spec.rank)) * double(bytes_per_expert) *
                 table.held_fraction(spec.rank);
      }
    out += fmt::format("  host {:<16} {:>3} ranks {:>6} experts {:>10.1f} MiB\n",
                       host.empty() ? "(unnamed)" : host, n_ranks, owned, bytes / (1 << 20));
  }
  for (int l = 0; l < table.num_layers; ++l) {
    if (table.num_experts == 0 || table.owner_of(l, 0) < 0) continue;
    out += fmt::format("  layer {:>3}:", l);
    for (int e = 0; e < table.num_experts; ++e) {
      out += fmt::format(" {}", table.owner_of(l, e));
      for (int rank : table.replicas_of(l, e)) out += fmt::format("+{}", rank);
    }
    out += '\n';
  }
  return out;
}

}  // namespace colibri
