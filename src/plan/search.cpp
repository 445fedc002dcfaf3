// `colibri-node plan --search` (plan.h): every layout shape of a hardware description, planned
// and ranked, and a layout written as a layout file.
#include <fmt/format.h>

#include <algorithm>
#include <sstream>

#include "common/error.h"
#include "plan/plan.h"

namespace colibri {
namespace {

constexpr double kGB = 1e9;
constexpr double kGiB = 1073741824.0;  // the unit of a layout's budgets, as a run reads them

}  // namespace

std::string layout_text(const Layout& layout, const std::string& header) {
  std::string out;
  std::istringstream lines(header);
  for (std::string line; std::getline(lines, line);) out += "# " + line + "\n";
  out += "# rank  role         gpu  numa  ram_gb  vram_gb  host\n";
  const auto field = [](double v) { return v > 0 ? fmt::format("{:.6g}", v) : std::string("-"); };
  for (const RankSpec& r : layout.ranks)
    out += fmt::format("{:<7} {:<12} {:<4} {:<5} {:<7} {:<8} {}\n", r.rank, role_name(r.role),
                       r.gpu >= 0 ? std::to_string(r.gpu) : "-",
                       r.numa >= 0 ? std::to_string(r.numa) : "-", field(r.ram_gb),
                       field(r.vram_gb), r.host.empty() ? "-" : r.host);
  return out;
}

std::vector<SearchCandidate> search_layouts(const ModelConfig& config, const ModelBytes& bytes,
                                            const Hardware& hw, const SearchOptions& options) {
  if (hw.hosts.empty()) fail("plan --search: the hardware description has no host");
  const HostSpec& first = hw.hosts.front();
  const bool several_hosts = hw.hosts.size() > 1;
  uint64_t coordinator_bytes = bytes.head;
  for (uint64_t b : bytes.dense_layer) coordinator_bytes += b;
  coordinator_bytes += bytes.kv_per_token * uint64_t(options.plan.context_tokens);
  std::vector<SearchCandidate> out;
  for (const bool coordinator_gpu : {false, true}) {
    if (coordinator_gpu && first.gpus.empty()) continue;
    for (int per_socket = 0; per_socket <= 2; ++per_socket) {
      SearchCandidate c;
      Layout& layout = c.layout;
      layout.source = "plan --search";
      const auto add = [&](Role role, int gpu, int numa, const std::string& host) {
        RankSpec spec;
        spec.rank = int(layout.ranks.size());
        spec.role = role;
        spec.gpu = gpu;
        spec.numa = numa;
        spec.host = several_hosts ? host : "";
        layout.ranks.push_back(spec);
        return spec.rank;
      };
      add(Role::kCoordinator, coordinator_gpu ? 0 : -1, -1, first.name);
      for (size_t h = 0; h < hw.hosts.size(); ++h) {
        const HostSpec& host = hw.hosts[h];
        for (size_t g = 0; g < host.gpus.size(); ++g) {
          if (coordinator_gpu && h == 0 && g == 0) continue;
          // A GPU's socket: GPUs spread evenly over the sockets in index order.
          const int numa =
              host.sockets.size() > 1 ? int(g * host.sockets.size() / host.gpus.size()) : -1;
          const int r = add(Role::kGpuExpert, int(g), numa, host.name);
          if (options.vram_budgets)
            layout.ranks[size_t(r)].vram_gb =
                options.vram_usable * host.gpus[g].vram_gb * kGB / kGiB;
        }
        for (size_t socket = 0; socket < host.sockets.size(); ++socket)
          for (int i = 0; i < per_socket; ++i)
            add(Role::kCpuExpert, -1, host.sockets.size() > 1 ? int(socket) : -1, host.name);
      }
      if (layout.ranks.size() < 2) continue;  // no expert rank
      // RAM budgets: each host's memory less the headroom (and, on the coordinator's host, its
      // weights and KV when they are in RAM), evenly over the host's expert ranks.
      for (size_t h = 0; h < hw.hosts.size(); ++h) {
        const HostSpec& host = hw.hosts[h];
        if (host.ram_gb <= 0 || !options.ram_budgets) continue;
        double usable = host.ram_gb * (1 - options.ram_headroom);
        if (h == 0 && !coordinator_gpu) usable -= double(coordinator_bytes) / kGB;
        const auto here = [&](const RankSpec& r) {
          return r.role != Role::kCoordinator && (!several_hosts || r.host == host.name);
        };
        const auto experts_here = std::count_if(layout.ranks.begin(), layout.ranks.end(), here);
        for (RankSpec& r : layout.ranks)
          if (here(r))
            r.ram_gb = std::max(double(bytes.expert),
                                usable * kGB / double(std::max<long>(1, experts_here))) /
                       kGiB;
      }
      int gpu_ranks = 0, cpu_ranks = 0;
      for (const RankSpec& r : layout.ranks) {
        gpu_ranks += r.role == Role::kGpuExpert;
        cpu_ranks += r.role == Role::kCpuExpert;
      }
      c.summary =
          fmt::format("coordinator on {}, {} gpu-expert, {} cpu-expert ({} a socket)",
                      coordinator_gpu ? "GPU 0" : "the CPU", gpu_ranks, cpu_ranks, per_socket);
      if (coordinator_gpu && double(coordinator_bytes) / kGB > first.gpus[0].vram_gb)
        c.refused = fmt::format(
            "the coordinator's dense weights and KV ({:.1f} GB) exceed GPU 0 ({:.0f} GB)",
            double(coordinator_bytes) / kGB, first.gpus[0].vram_gb);
      PlacementTable placement = make_placement(config, layout, options.policy, bytes.expert,
                                                options.stats, options.replicas);
      // Budgets that hold every expert of their rank are left out: the run keeps them all
      // resident, and does not ask for more memory than they take.
      bool all_fit = true;
      for (const RankSpec& r : layout.ranks) {
        if (r.role == Role::kCoordinator) continue;
        uint64_t held = 0;
        for (int layer = 0; layer < config.num_layers; ++layer)
          held += placement.experts_of(r.rank, layer).size() * bytes.expert;
        all_fit = all_fit && r.ram_gb > 0 && double(held) <= (r.ram_gb + r.vram_gb) * kGiB;
      }
      if (all_fit) {
        for (RankSpec& r : layout.ranks) r.ram_gb = 0;
        placement = make_placement(config, layout, options.policy, bytes.expert, options.stats,
                                   options.replicas);
        c.summary += ", every expert resident";
      }
      c.plan = make_plan(config, bytes, layout, placement, hw, options.plan);
      // What stays in RAM must fit each host's memory (less the headroom).
      for (size_t h = 0; h < hw.hosts.size() && c.refused.empty(); ++h) {
        const HostSpec& host = hw.hosts[h];
        if (host.ram_gb <= 0) continue;
        double resident = h == 0 && !coordinator_gpu ? double(coordinator_bytes) : 0;
        for (const RankPlan& r : c.plan.ranks)
          if (!several_hosts || r.host == host.name) resident += double(r.ram_bytes);
        if (resident > host.ram_gb * (1 - options.ram_headroom) * kGB)
          c.refused =
              fmt::format("{:.0f} GB would stay in the RAM of {} ({:.0f} GB less {:.0f} %)",
                          resident / kGB, host.name, host.ram_gb, 100 * options.ram_headroom);
      }
      out.push_back(std::move(c));
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const SearchCandidate& a, const SearchCandidate& b) {
    if (a.refused.empty() != b.refused.empty()) return a.refused.empty();
    return a.plan.batches.front().decode_tok_s > b.plan.batches.front().decode_tok_s;
  });
  return out;
}

}  // namespace colibri
