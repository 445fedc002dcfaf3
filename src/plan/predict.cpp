// make_plan (plan/plan.h): each rank's rates from the hardware description, each owner's experts
// in their tiers, then steps of `rows` rows, their routing sampled from the placement's heat
// (uniform without one).
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <random>

#include "common/error.h"
#include "plan/plan.h"

namespace colibri {
namespace {

constexpr double kGB = 1e9;
constexpr double kGiB = 1073741824.0;  // the unit of a layout's budgets, as a run reads them
constexpr double kVramUsable = 0.9;    // of a GPU's memory, when its layout row gives no budget

// A rank's sockets summed (the one it is bound to, else all of its host's): read and compute
// rates for the format it computes in, and the fixed costs, the largest of them.
struct SocketRates {
  double mem = 0, core = 0, gflops = 0, kernel = 0, call_us = 0, linear_us = 0, dense = 0;
  double call_us_one = -1, linear_us_one = -1;  // on one thread, where measured
  int cores = 0;
};

// The expert kernel's rates for `format` where the description has them (calibrate), else the
// socket's read and compute; its fixed costs where measured, else none.
SocketRates socket_rates(const HostSpec& host, int numa, const std::string& format) {
  const auto rate = [&](const std::map<std::string, double>& m, double fallback) {
    const auto it = m.find(format);
    return it == m.end() ? fallback : it->second;
  };
  SocketRates r;
  for (size_t s = 0; s < host.sockets.size(); ++s) {
    if (numa < 0 || int(s) == numa) {
      const SocketSpec& socket = host.sockets[s];
      r.mem += socket.mem_gbps;
      r.gflops += rate(socket.expert_gflops, socket.gflops);
      r.kernel += rate(socket.expert_gbps, socket.mem_gbps);
      r.dense += rate(socket.linear_gbps, socket.mem_gbps);
      r.cores += socket.cores;
      r.core = socket.core_gbps;
      r.call_us = std::max(r.call_us, rate(socket.expert_us, 0));
      r.linear_us = std::max(r.linear_us, socket.linear_us);
      r.linear_us_one = std::max(r.linear_us_one, socket.linear_us_one_thread);
      r.call_us_one = std::max(r.call_us_one, rate(socket.expert_us_one_thread, -1));
    }
  }
  return r;
}

// make_plan in steps: each rank's host, device and rates; each owner's experts in their tiers;
// then steps of `rows` rows, their routing sampled with a fixed seed (the same plan every time).
class Planner {
 public:
  Planner(const ModelConfig& config, const ModelBytes& bytes, const Layout& layout,
          const PlacementTable& placement, const Hardware& hw, const PlanOptions& options)
      : config_(config),
        bytes_(bytes),
        layout_(layout),
        placement_(placement),
        hw_(hw),
        options_(options),
        ranks_(int(layout.ranks.size())),
        coordinator_(layout.coordinator()),
        experts_(config.n_routed_experts),
        slowest_count_(size_t(ranks_), 0),
        slowest_by_(static_cast<size_t>(ranks_)) {}

  Plan run();

 private:
  const HostSpec& host_of(const RankSpec& spec) const;
  void rank_rates();
  void rank_rate(const RankSpec& spec, double share, bool oversubscribed, int on_host);
  void assign_tiers();
  void coordinator_bytes();
  // One step of `rows` rows attending to `context` tokens: the coordinator's part plus the
  // slowest owners', each MoE layer's averaged over `samples` routings.
  BatchPlan step(int rows, int context, int samples, bool record);
  // One sampled routing of a MoE layer: the time of its slowest holder (recorded with `record`).
  double sample_layer(int layer, int rows, std::discrete_distribution<int>& pick, bool record);
  void slowest_shares();
  void time_to_first_token();

  const ModelConfig& config_;
  const ModelBytes& bytes_;
  const Layout& layout_;
  const PlacementTable& placement_;
  const Hardware& hw_;
  const PlanOptions& options_;
  const int ranks_, coordinator_, experts_;
  Plan plan_;
  // Per holder (owner or replica) of each (layer, expert): 0 VRAM, 1 RAM, 2 disk.
  std::vector<std::vector<int>> tier_;
  std::mt19937_64 rng_{0x9E3779B97F4A7C15ull};
  std::vector<int> slowest_count_;
  std::vector<std::map<std::string, double>> slowest_by_;
  double coord_gbps_ = 0, dense_gbps_ = 0, coord_gflops_ = 0;
};

const HostSpec& Planner::host_of(const RankSpec& spec) const {
  if (spec.host.empty()) return hw_.hosts.front();
  for (const HostSpec& host : hw_.hosts)
    if (host.name == spec.host) return host;
  fail("rank {}: host '{}' is not in the hardware description", spec.rank, spec.host);
}

// ---- each rank's host, device and rates ----
void Planner::rank_rates() {
  // Expert ranks reading from one socket (or, unbound, from their host's sockets) share it.
  std::map<std::pair<std::string, int>, int> sharing;  // (host, numa or -1) -> expert ranks
  std::map<std::string, int> on_host;                  // host -> expert ranks (its disk)
  std::map<std::string, int> all_on_host;              // host -> ranks, the coordinator too
  for (const RankSpec& spec : layout_.ranks) {
    ++all_on_host[host_of(spec).name];
    if (spec.rank != coordinator_) {
      ++sharing[{host_of(spec).name, spec.numa}];
      ++on_host[host_of(spec).name];
    }
  }
  plan_.ranks.resize(size_t(ranks_));
  for (const RankSpec& spec : layout_.ranks) {
    const HostSpec& host = host_of(spec);
    if (spec.numa >= int(host.sockets.size()))
      fail("rank {}: NUMA node {} is not a socket of host '{}' ({} sockets)", spec.rank, spec.numa,
           host.name, host.sockets.size());
    int host_cores = 0;
    for (const SocketSpec& socket : host.sockets) host_cores += socket.cores;
    // More ranks on a host than cores: the launcher runs one OpenMP thread a rank (docs/LAUNCH.md),
    // so each rank computes and reads as one core. Else an expert rank has its share of its
    // socket's cores and the coordinator all of them.
    const bool oversubscribed = all_on_host[host.name] > host_cores;
    const int share = spec.rank == coordinator_ ? 1 : sharing[{host.name, spec.numa}];
    rank_rate(spec, share, oversubscribed, on_host[host.name]);
  }
}

// One rank's rates, with `share` ranks reading its socket(s) and `on_host` expert ranks its disk.
void Planner::rank_rate(const RankSpec& spec, double share, bool oversubscribed, int on_host) {
  const HostSpec& host = host_of(spec);
  RankPlan& r = plan_.ranks[size_t(spec.rank)];
  r.rank = spec.rank;
  r.role = spec.role;
  r.host = host.name;
  // The coordinator computes in the dense weights' format (BF16, or FP8 with FP8 experts).
  const SocketRates s =
      socket_rates(host, spec.numa, spec.rank == coordinator_ ? bytes_.dense : bytes_.format);
  const double threads = oversubscribed ? 1.0 : std::max(1.0, double(s.cores) / share);
  r.threads = threads;
  r.ram_gbps = std::min(s.mem / share, threads * s.core);
  r.expert_ram_gbps = std::min(s.kernel / share, threads * s.core * s.kernel / s.mem);
  r.dense_gbps = std::min(s.dense / share, threads * s.core * s.dense / s.mem);
  r.gflops = s.gflops * threads / s.cores;
  // The fixed cost of a call was measured with every core of the socket, the experts of a
  // layer spread over them: with `threads` of them it takes cores / threads times as long.
  // On one thread, the one-thread figures where calibrate measured them (a tiny call on one
  // thread pays no fork and join).
  r.expert_call_s =
      (threads == 1 && s.call_us_one >= 0 ? s.call_us_one : s.call_us * s.cores / threads) * 1e-6;
  r.linear_call_s = (threads == 1 && s.linear_us_one >= 0 ? s.linear_us_one : s.linear_us) * 1e-6;
  r.disk_gbps = host.disk_gbps / std::max(1, on_host);
  r.device = spec.numa >= 0 ? fmt::format("socket {}", spec.numa) : "CPU";
  if (spec.gpu >= 0) {
    if (spec.gpu >= int(host.gpus.size()))
      fail("rank {}: GPU {} is not in host '{}' ({} GPUs)", spec.rank, spec.gpu, host.name,
           host.gpus.size());
    const GpuSpec& gpu = host.gpus[size_t(spec.gpu)];
    r.device = fmt::format("GPU {} ({})", spec.gpu, gpu.name);
    r.vram_gbps = gpu.hbm_gbps;
    r.gflops = gpu.tflops * 1e3;
    // A miss is computed on the CPU or uploaded, whichever is cheaper (the VRAM tier's rule).
    r.ram_gbps = std::max(r.ram_gbps, gpu.pcie_gbps);
    r.expert_ram_gbps = r.ram_gbps;
    r.expert_call_s = 0;  // not measured for GPUs
  }
}

// ---- tiers: each owner's experts, hottest first, VRAM then RAM budgets, the rest on disk ----
void Planner::assign_tiers() {
  const int E = experts_;
  tier_.assign(size_t(ranks_), std::vector<int>(size_t(config_.num_layers) * size_t(E), 1));
  for (const RankSpec& spec : layout_.ranks) {
    std::vector<std::pair<int, int>> owned;
    for (int layer = 0; layer < config_.num_layers; ++layer)
      for (int e : placement_.experts_of(spec.rank, layer)) owned.push_back({layer, e});
    std::stable_sort(owned.begin(), owned.end(), [&](const auto& a, const auto& b) {
      return placement_.heat_of(a.first, a.second) > placement_.heat_of(b.first, b.second);
    });
    RankPlan& r = plan_.ranks[size_t(spec.rank)];
    r.experts = int(owned.size());
    uint64_t vram_left = 0;
    if (spec.gpu >= 0) {
      vram_left = spec.vram_gb > 0
                      ? uint64_t(spec.vram_gb * kGiB)
                      : uint64_t(kVramUsable * host_of(spec).gpus[size_t(spec.gpu)].vram_gb * kGB);
    }
    const bool ram_budget = spec.ram_gb > 0;
    uint64_t ram_left = ram_budget ? uint64_t(spec.ram_gb * kGiB) : UINT64_MAX;
    for (const auto& [layer, e] : owned) {
      int& t = tier_[size_t(spec.rank)][size_t(layer) * size_t(E) + size_t(e)];
      if (vram_left >= bytes_.expert) {
        vram_left -= bytes_.expert;
        r.vram_bytes += bytes_.expert;
        t = 0;
      } else if (ram_left >= bytes_.expert) {
        ram_left -= bytes_.expert;
        r.ram_bytes += bytes_.expert;
        t = 1;
      } else {
        r.disk_bytes += bytes_.expert;
        t = 2;
      }
    }
  }
}

// The coordinator's dense weights and KV cache, and the rates it reads and computes them at.
void Planner::coordinator_bytes() {
  RankPlan& coord = plan_.ranks[size_t(coordinator_)];
  for (uint64_t b : bytes_.dense_layer) coord.dense_bytes += b;
  coord.dense_bytes += bytes_.head;
  coord.kv_bytes = bytes_.kv_per_token * uint64_t(options_.context_tokens);
  coord_gbps_ = coord.vram_gbps > 0 ? coord.vram_gbps : coord.ram_gbps;
  dense_gbps_ = coord.vram_gbps > 0 ? coord.vram_gbps : coord.dense_gbps;
  coord_gflops_ = coord.gflops;
}

// ---- one step of `rows` rows: the coordinator's part plus the slowest owner's ----
BatchPlan Planner::step(int rows, int context, int samples, bool record) {
  const RankPlan& coord = plan_.ranks[size_t(coordinator_)];
  const int E = experts_;
  BatchPlan out;
  out.rows = rows;
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const double params = double(bytes_.dense_layer_params[size_t(layer)]);
    const double dense_s = bytes_.dense_layer_calls[size_t(layer)] * coord.linear_call_s +
                           std::max(double(bytes_.dense_layer[size_t(layer)]) / (dense_gbps_ * kGB),
                                    2 * params * rows / (coord_gflops_ * 1e9));
    const double kv_s =
        double(bytes_.kv_per_token) / config_.num_layers * context * rows / (coord_gbps_ * kGB);
    out.coordinator_s += dense_s + kv_s;
    if (!config_.layer_is_moe[size_t(layer)]) continue;
    std::vector<double> weights(size_t(E), 1.0);
    for (int e = 0; e < E; ++e)
      if (!placement_.heat.empty())
        weights[size_t(e)] = std::max(1e-9, placement_.heat_of(layer, e));
    std::discrete_distribution<int> pick(weights.begin(), weights.end());
    double layer_s = 0;
    for (int sample = 0; sample < samples; ++sample)
      layer_s += sample_layer(layer, rows, pick, record);
    out.experts_s += layer_s / samples;
  }
  out.coordinator_s += coord.linear_call_s +
                       std::max(double(bytes_.head) / (dense_gbps_ * kGB),
                                2.0 * double(bytes_.head_params) * rows / (coord_gflops_ * 1e9));
  out.step_s = out.coordinator_s + out.experts_s;
  out.decode_tok_s = rows / out.step_s;
  return out;
}

double Planner::sample_layer(int layer, int rows, std::discrete_distribution<int>& pick,
                             bool record) {
  const int E = experts_, k = config_.num_experts_per_tok;
  std::vector<int> rows_of(size_t(E), 0);
  for (int row = 0; row < rows; ++row) {
    std::vector<int> chosen;
    while (int(chosen.size()) < std::min(k, E)) {
      const int e = pick(rng_);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int e : chosen) ++rows_of[size_t(e)];
  }
  std::vector<std::map<std::string, double>> parts(static_cast<size_t>(ranks_));
  std::vector<int> routed_rows(size_t(ranks_), 0);
  for (int e = 0; e < E; ++e) {
    if (rows_of[size_t(e)] == 0) continue;
    // A replicated expert's rows are split evenly over its copies, each in its holder's tier.
    std::vector<int> holders = {placement_.owner_of(layer, e)};
    for (int rep : placement_.replicas_of(layer, e)) holders.push_back(rep);
    for (size_t i = 0; i < holders.size(); ++i) {
      const int r = holders[i];
      const int n = rows_of[size_t(e)] / int(holders.size()) +
                    (int(i) < rows_of[size_t(e)] % int(holders.size()) ? 1 : 0);
      if (n == 0) continue;
      const RankPlan& rp = plan_.ranks[size_t(r)];
      const int t = tier_[size_t(r)][size_t(layer) * size_t(E) + size_t(e)];
      const double gbps = t == 0 ? rp.vram_gbps : t == 1 ? rp.expert_ram_gbps : rp.disk_gbps;
      const double read_s = rp.expert_call_s + double(bytes_.expert) / (gbps * kGB);
      const double compute_s =
          rp.expert_call_s + 2.0 * double(bytes_.expert_params) * n / (rp.gflops * 1e9);
      parts[size_t(r)][compute_s > read_s ? "compute"
                       : t == 0           ? "vram"
                       : t == 1           ? "ram"
                                          : "disk"] += std::max(read_s, compute_s);
      routed_rows[size_t(r)] += n;
    }
  }
  const std::string& coord_host = plan_.ranks[size_t(coordinator_)].host;
  int slowest = -1;
  double slowest_s = 0;
  for (int r = 0; r < ranks_; ++r) {
    if (parts[size_t(r)].empty()) continue;
    if (r != coordinator_) {
      const bool same_host = plan_.ranks[size_t(r)].host == coord_host;
      const double payload = double(routed_rows[size_t(r)]) * config_.hidden_size *
                             options_.wire_bytes * 2;  // rows out, partials back
      parts[size_t(r)]["link"] = (same_host ? hw_.shm_us : hw_.link_us) * 1e-6 +
                                 payload / ((same_host ? hw_.shm_gbps : hw_.link_gbps) * kGB);
    }
    double total = 0;
    for (const auto& [what, s] : parts[size_t(r)]) total += s;
    if (total > slowest_s) {
      slowest_s = total;
      slowest = r;
    }
  }
  if (record && slowest >= 0) {
    ++slowest_count_[size_t(slowest)];
    for (const auto& [what, s] : parts[size_t(slowest)]) slowest_by_[size_t(slowest)][what] += s;
  }
  return slowest_s;
}

// How often each rank was the slowest owner at batch 1, and on what it spent most time then.
void Planner::slowest_shares() {
  const int moe_layers = std::max(1, config_.num_moe_layers());
  for (int r = 0; r < ranks_; ++r) {
    plan_.ranks[size_t(r)].slowest_share =
        double(slowest_count_[size_t(r)]) / (double(options_.samples) * moe_layers);
    double most = 0;
    for (const auto& [what, s] : slowest_by_[size_t(r)])
      if (s > most) {
        most = s;
        plan_.ranks[size_t(r)].slowest_by = what;
      }
  }
}

// TTFT: the prompt in chunks of max_rows, each attending to the tokens before it.
void Planner::time_to_first_token() {
  plan_.prompt_tokens = options_.prompt_tokens;
  for (int done = 0; done < options_.prompt_tokens;) {
    const int rows = std::min(options_.max_rows, options_.prompt_tokens - done);
    plan_.ttft_s += step(rows, done + rows / 2, std::max(4, options_.samples / 16), false).step_s;
    done += rows;
  }
}

Plan Planner::run() {
  if (!placement_.slice_ranks.empty())
    fail(
        "plan: --placement sliced is not modelled yet (every owner holds a slice of every "
        "expert); plan the whole-expert policies");
  plan_.constants = hw_.constants;
  rank_rates();
  assign_tiers();
  coordinator_bytes();
  for (int rows : options_.batches)
    plan_.batches.push_back(step(rows, options_.context_tokens, options_.samples, rows == 1));
  slowest_shares();
  time_to_first_token();
  plan_.constants.push_back(
      {"VRAM usable without a layout budget", kVramUsable, "of the GPU", "default"});
  plan_.constants.push_back({"exchange bytes per value", options_.wire_bytes, "B", "--wire"});
  return std::move(plan_);
}

}  // namespace

Plan make_plan(const ModelConfig& config, const ModelBytes& bytes, const Layout& layout,
               const PlacementTable& placement, const Hardware& hw, const PlanOptions& options) {
  return Planner(config, bytes, layout, placement, hw, options).run();
}

}  // namespace colibri
