#include "plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "common/error.h"
#include "coordinator/kv_manager.h"

namespace colibri {
namespace {

using json = nlohmann::json;

constexpr double kGB = 1e9;
constexpr double kGiB = 1073741824.0;  // the unit of a layout's budgets, as a run reads them

// Defaults for what a description may leave out, each printed as "default".
constexpr double kShmUs = 20, kShmGbps = 10, kLinkUs = 60, kLinkGbps = 3;
constexpr double kVramUsable = 0.9;  // of a GPU's memory, when its layout row gives no budget

double number(const json& object, const char* key, const std::string& where, bool required,
              double fallback = 0) {
  if (!object.contains(key)) {
    if (required) fail("{}: missing \"{}\"", where, key);
    return fallback;
  }
  const json& v = object.at(key);
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
    fail("{}: \"{}\" must be a finite number >= 0", where, key);
  return v.get<double>();
}

// Bytes per weight and the scale bytes per output row / per group of one matrix.
uint64_t matrix_bytes(uint64_t rows, uint64_t cols, const std::string& format) {
  const uint64_t n = rows * cols;
  if (format == "fp32") return 4 * n;
  if (format == "bf16") return 2 * n;
  if (format == "fp8") return n + 4 * ((rows + 127) / 128) * ((cols + 127) / 128);
  if (format == "int8") return n + 4 * rows;
  if (format == "int4") return n / 2 + 4 * rows * ((cols + 63) / 64);
  fail("--weights '{}': expected bf16, fp8, int8 or int4", format);
}

}  // namespace

Hardware parse_hardware(const std::string& json_text, const std::string& source) {
  const json doc = json::parse(json_text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) fail("{}: not a JSON object", source);
  if (!doc.contains("hosts") || !doc["hosts"].is_array() || doc["hosts"].empty())
    fail("{}: \"hosts\" must be a non-empty array", source);
  Hardware hw;
  std::string from = source;
  if (doc.contains("calibration")) {
    const json& calibration = doc["calibration"];
    if (!calibration.is_object() || !calibration.contains("version") ||
        !calibration["version"].is_number_integer())
      fail("{}: \"calibration\" must be an object with an integer \"version\"", source);
    if (calibration["version"].get<int>() != kCalibrationVersion)
      fail(
          "{}: calibration version {} is not this build's ({}): run `colibri-node calibrate` "
          "again",
          source, calibration["version"].get<int>(), kCalibrationVersion);
    from = fmt::format("calibration {} ({})", source, calibration.value("date", "undated"));
  }
  // A value from the description itself is named by `from` (the calibration, where it is one).
  const auto constant = [&](const std::string& name, double value, const char* unit,
                            const std::string& origin) {
    hw.constants.push_back({name, value, unit, origin == source ? from : origin});
  };
  for (size_t h = 0; h < doc["hosts"].size(); ++h) {
    const json& host = doc["hosts"][h];
    const std::string where = fmt::format("{}: hosts[{}]", source, h);
    if (!host.is_object()) fail("{}: not an object", where);
    HostSpec spec;
    spec.name = host.value("name", std::string());
    if (spec.name.empty()) fail("{}: missing \"name\"", where);
    if (!host.contains("sockets") || !host["sockets"].is_array() || host["sockets"].empty())
      fail("{}: \"sockets\" must be a non-empty array", where);
    for (size_t s = 0; s < host["sockets"].size(); ++s) {
      const std::string at = fmt::format("{}.sockets[{}]", where, s);
      const json& socket = host["sockets"][s];
      SocketSpec sock;
      sock.cores = int(number(socket, "cores", at, true));
      sock.mem_gbps = number(socket, "mem_gbps", at, true);
      sock.core_gbps = number(socket, "core_gbps", at, false, sock.mem_gbps);
      sock.gflops = number(socket, "gflops", at, true);
      sock.linear_us = number(socket, "linear_us", at, false);
      sock.linear_us_one_thread = number(socket, "linear_us_one_thread", at, false, -1);
      if (sock.cores < 1 || sock.mem_gbps <= 0 || sock.gflops <= 0)
        fail("{}: cores, mem_gbps and gflops must be positive", at);
      const std::string name = fmt::format("{} socket {}", spec.name, s);
      constant(name + " read", sock.mem_gbps, "GB/s", source);
      constant(name + " read per core", sock.core_gbps, "GB/s",
               socket.contains("core_gbps") ? source : "default (the socket's)");
      constant(name + " compute", sock.gflops, "GFLOP/s", source);
      constant(name + " matrix product call", sock.linear_us, "us",
               socket.contains("linear_us") ? source : "default (none)");
      const auto per_format = [&](const char* key, std::map<std::string, double>& out,
                                  const char* what, const char* unit, bool positive) {
        if (!socket.contains(key)) return;
        const json& table = socket.at(key);
        if (!table.is_object()) fail("{}: \"{}\" must be an object of formats", at, key);
        for (const auto& [format, value] : table.items()) {
          if (format != "bf16" && format != "fp8" && format != "int8" && format != "int4")
            fail("{}.{}: \"{}\" is not a weight format (bf16, fp8, int8, int4)", at, key, format);
          out[format] = number(table, format.c_str(), at + "." + key, true);
          if (positive && out[format] <= 0) fail("{}.{}: \"{}\" must be positive", at, key, format);
          constant(fmt::format("{} {} {}", name, what, format), out[format], unit, source);
        }
      };
      per_format("linear_gbps", sock.linear_gbps, "matrix product read", "GB/s", true);
      per_format("expert_us", sock.expert_us, "expert call", "us", false);
      per_format("expert_us_one_thread", sock.expert_us_one_thread, "expert call on one thread",
                 "us", false);
      if (sock.linear_us_one_thread >= 0)
        constant(name + " matrix product call on one thread", sock.linear_us_one_thread, "us",
                 source);
      per_format("expert_gbps", sock.expert_gbps, "expert kernel read", "GB/s", true);
      per_format("expert_gflops", sock.expert_gflops, "expert kernel compute", "GFLOP/s", true);
      spec.sockets.push_back(sock);
    }
    if (host.contains("gpus")) {
      if (!host["gpus"].is_array()) fail("{}: \"gpus\" must be an array", where);
      for (size_t g = 0; g < host["gpus"].size(); ++g) {
        const std::string at = fmt::format("{}.gpus[{}]", where, g);
        const json& gpu = host["gpus"][g];
        GpuSpec spec_gpu;
        spec_gpu.name = gpu.value("name", std::string("GPU"));
        spec_gpu.vram_gb = number(gpu, "vram_gb", at, true);
        spec_gpu.hbm_gbps = number(gpu, "hbm_gbps", at, true);
        spec_gpu.pcie_gbps = number(gpu, "pcie_gbps", at, true);
        spec_gpu.tflops = number(gpu, "tflops", at, true);
        if (spec_gpu.hbm_gbps <= 0 || spec_gpu.pcie_gbps <= 0 || spec_gpu.tflops <= 0)
          fail("{}: hbm_gbps, pcie_gbps and tflops must be positive", at);
        spec.gpus.push_back(spec_gpu);
        const std::string name = fmt::format("{} GPU {} ({})", spec.name, g, spec_gpu.name);
        constant(name + " memory read", spec_gpu.hbm_gbps, "GB/s", source);
        constant(name + " PCIe upload", spec_gpu.pcie_gbps, "GB/s", source);
        constant(name + " compute", spec_gpu.tflops, "TFLOP/s", source);
      }
    }
    spec.disk_gbps = number(host, "disk_gbps", where, true);
    spec.ram_gb = number(host, "ram_gb", where, false);
    if (spec.ram_gb > 0) constant(spec.name + " memory", spec.ram_gb, "GB", source);
    if (spec.disk_gbps <= 0) fail("{}: disk_gbps must be positive", where);
    constant(spec.name + " disk read", spec.disk_gbps, "GB/s", source);
    hw.hosts.push_back(std::move(spec));
  }
  const json links = doc.value("links", json::object());
  if (!links.is_object()) fail("{}: \"links\" must be an object", source);
  const auto link = [&](const char* key, double fallback, const char* unit, double& out) {
    out = number(links, key, source + ": links", false, fallback);
    constant(std::string("exchange ") + key, out, unit, links.contains(key) ? source : "default");
  };
  link("shm_us", kShmUs, "us", hw.shm_us);
  link("shm_gbps", kShmGbps, "GB/s", hw.shm_gbps);
  link("link_us", kLinkUs, "us", hw.link_us);
  link("link_gbps", kLinkGbps, "GB/s", hw.link_gbps);
  if (hw.shm_gbps <= 0 || hw.link_gbps <= 0) fail("{}: links: bandwidths must be positive", source);
  return hw;
}

ModelBytes model_bytes(const ModelConfig& c, const std::string& format,
                       const std::string& dense_format) {
  ModelBytes b;
  b.format = format;
  const std::string dense = !dense_format.empty() ? dense_format : format == "fp8" ? "fp8" : "bf16";
  b.dense = dense;
  const uint64_t h = uint64_t(c.hidden_size), mi = uint64_t(c.moe_intermediate_size);
  b.expert = 2 * matrix_bytes(mi, h, format) + matrix_bytes(h, mi, format);
  b.expert_params = 3 * h * mi;
  const uint64_t heads = uint64_t(c.num_heads), qk = uint64_t(c.qk_head_dim());
  const uint64_t kv_a = uint64_t(c.kv_lora_rank) + uint64_t(c.qk_rope_head_dim);
  // MLA: q (through its LoRA when there is one), kv_a, kv_b, o; the DSA indexer's projections.
  std::vector<std::pair<uint64_t, uint64_t>> attention;
  if (c.q_lora_rank > 0) {
    attention.push_back({uint64_t(c.q_lora_rank), h});
    attention.push_back({heads * qk, uint64_t(c.q_lora_rank)});
  } else {
    attention.push_back({heads * qk, h});
  }
  attention.push_back({kv_a, h});
  attention.push_back(
      {heads * (uint64_t(c.qk_nope_head_dim) + uint64_t(c.v_head_dim)), uint64_t(c.kv_lora_rank)});
  attention.push_back({h, heads * uint64_t(c.v_head_dim)});
  if (c.has_indexer()) {
    const uint64_t q_in = c.q_lora_rank > 0 ? uint64_t(c.q_lora_rank) : h;
    attention.push_back({uint64_t(c.index_n_heads) * uint64_t(c.index_head_dim), q_in});
    attention.push_back({uint64_t(c.index_head_dim), h});
    attention.push_back({uint64_t(c.index_n_heads), h});
  }
  for (int layer = 0; layer < c.num_layers; ++layer) {
    uint64_t bytes = 0, params = 0;
    for (const auto& [rows, cols] : attention) {
      bytes += matrix_bytes(rows, cols, dense);
      params += rows * cols;
    }
    const bool moe = size_t(layer) < c.layer_is_moe.size() && c.layer_is_moe[size_t(layer)];
    const uint64_t mlp_inter =
        moe ? uint64_t(c.n_shared_experts) * mi : uint64_t(c.intermediate_size);
    bytes += 2 * matrix_bytes(mlp_inter, h, dense) + matrix_bytes(h, mlp_inter, dense);
    params += 3 * h * mlp_inter;
    if (moe) bytes += 4 * uint64_t(c.n_routed_experts) * h;  // the router, fp32
    b.dense_layer.push_back(bytes);
    b.dense_layer_params.push_back(params);
    b.dense_layer_calls.push_back(int(attention.size()) + 3 + (moe ? 1 : 0));
  }
  b.head = matrix_bytes(uint64_t(c.vocab_size), h, dense) + 2 * h;
  b.head_params = uint64_t(c.vocab_size) * h;
  b.kv_per_token = KvManager::pool_bytes(c, 1024) / 1024;
  return b;
}

Plan make_plan(const ModelConfig& config, const ModelBytes& bytes, const Layout& layout,
               const PlacementTable& placement, const Hardware& hw, const PlanOptions& options) {
  if (!placement.slice_ranks.empty())
    fail(
        "plan: --placement sliced is not modelled yet (every owner holds a slice of every "
        "expert); plan the whole-expert policies");
  Plan plan;
  plan.constants = hw.constants;
  const int ranks = int(layout.ranks.size());
  const int coordinator = layout.coordinator();
  const int E = config.n_routed_experts, k = config.num_experts_per_tok;

  // ---- each rank's host, device and rates ----
  const auto host_of = [&](const RankSpec& spec) -> const HostSpec& {
    if (spec.host.empty()) return hw.hosts.front();
    for (const HostSpec& host : hw.hosts)
      if (host.name == spec.host) return host;
    fail("rank {}: host '{}' is not in the hardware description", spec.rank, spec.host);
  };
  // Expert ranks reading from one socket (or, unbound, from their host's sockets) share it.
  std::map<std::pair<std::string, int>, int> sharing;  // (host, numa or -1) -> expert ranks
  std::map<std::string, int> on_host;                  // host -> expert ranks (its disk)
  std::map<std::string, int> all_on_host;              // host -> ranks, the coordinator too
  for (const RankSpec& spec : layout.ranks) {
    ++all_on_host[host_of(spec).name];
    if (spec.rank != coordinator) {
      ++sharing[{host_of(spec).name, spec.numa}];
      ++on_host[host_of(spec).name];
    }
  }
  plan.ranks.resize(size_t(ranks));
  for (const RankSpec& spec : layout.ranks) {
    const HostSpec& host = host_of(spec);
    RankPlan& r = plan.ranks[size_t(spec.rank)];
    r.rank = spec.rank;
    r.role = spec.role;
    r.host = host.name;
    if (spec.numa >= int(host.sockets.size()))
      fail("rank {}: NUMA node {} is not a socket of host '{}' ({} sockets)", spec.rank, spec.numa,
           host.name, host.sockets.size());
    // The expert kernel's rates for this format where the description has them (calibrate),
    // else the socket's read and compute; its fixed costs where measured, else none.
    // The coordinator computes in the dense weights' format (BF16, or FP8 with FP8 experts).
    const std::string format = spec.rank == coordinator ? bytes.dense : bytes.format;
    const auto rate = [&](const std::map<std::string, double>& m, double fallback) {
      const auto it = m.find(format);
      return it == m.end() ? fallback : it->second;
    };
    double mem = 0, core = 0, gflops = 0, kernel = 0, call_us = 0, linear_us = 0, dense = 0;
    double call_us_one = -1, linear_us_one = -1;  // on one thread, where measured
    int cores = 0, host_cores = 0;
    for (size_t s = 0; s < host.sockets.size(); ++s) {
      host_cores += host.sockets[s].cores;
      if (spec.numa < 0 || int(s) == spec.numa) {
        const SocketSpec& socket = host.sockets[s];
        mem += socket.mem_gbps;
        gflops += rate(socket.expert_gflops, socket.gflops);
        kernel += rate(socket.expert_gbps, socket.mem_gbps);
        dense += rate(socket.linear_gbps, socket.mem_gbps);
        cores += socket.cores;
        core = socket.core_gbps;
        call_us = std::max(call_us, rate(socket.expert_us, 0));
        linear_us = std::max(linear_us, socket.linear_us);
        linear_us_one = std::max(linear_us_one, socket.linear_us_one_thread);
        call_us_one = std::max(call_us_one, rate(socket.expert_us_one_thread, -1));
      }
    }
    // More ranks on a host than cores: the launcher runs one OpenMP thread a rank (docs/LAUNCH.md),
    // so each rank computes and reads as one core. Else an expert rank has its share of its
    // socket's cores and the coordinator all of them.
    const bool oversubscribed = all_on_host[host.name] > host_cores;
    const int share = spec.rank == coordinator ? 1 : sharing[{host.name, spec.numa}];
    const double threads = oversubscribed ? 1.0 : std::max(1.0, double(cores) / share);
    r.threads = threads;
    r.ram_gbps = std::min(mem / share, threads * core);
    r.expert_ram_gbps = std::min(kernel / share, threads * core * kernel / mem);
    r.dense_gbps = std::min(dense / share, threads * core * dense / mem);
    r.gflops = gflops * threads / cores;
    // The fixed cost of a call was measured with every core of the socket, the experts of a
    // layer spread over them: with `threads` of them it takes cores / threads times as long.
    // On one thread, the one-thread figures where calibrate measured them (a tiny call on one
    // thread pays no fork and join).
    r.expert_call_s =
        (threads == 1 && call_us_one >= 0 ? call_us_one : call_us * cores / threads) * 1e-6;
    r.linear_call_s = (threads == 1 && linear_us_one >= 0 ? linear_us_one : linear_us) * 1e-6;
    r.disk_gbps = host.disk_gbps / std::max(1, on_host[host.name]);
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
  // Per holder (owner or replica) of each (layer, expert): 0 VRAM, 1 RAM, 2 disk.
  std::vector<std::vector<int>> tier(size_t(ranks),
                                     std::vector<int>(size_t(config.num_layers) * size_t(E), 1));
  for (const RankSpec& spec : layout.ranks) {
    std::vector<std::pair<int, int>> owned;
    for (int layer = 0; layer < config.num_layers; ++layer)
      for (int e : placement.experts_of(spec.rank, layer)) owned.push_back({layer, e});
    std::stable_sort(owned.begin(), owned.end(), [&](const auto& a, const auto& b) {
      return placement.heat_of(a.first, a.second) > placement.heat_of(b.first, b.second);
    });
    RankPlan& r = plan.ranks[size_t(spec.rank)];
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
      int& t = tier[size_t(spec.rank)][size_t(layer) * size_t(E) + size_t(e)];
      if (vram_left >= bytes.expert) {
        vram_left -= bytes.expert;
        r.vram_bytes += bytes.expert;
        t = 0;
      } else if (ram_left >= bytes.expert) {
        ram_left -= bytes.expert;
        r.ram_bytes += bytes.expert;
        t = 1;
      } else {
        r.disk_bytes += bytes.expert;
        t = 2;
      }
    }
  }
  RankPlan& coord = plan.ranks[size_t(coordinator)];
  for (uint64_t b : bytes.dense_layer) coord.dense_bytes += b;
  coord.dense_bytes += bytes.head;
  coord.kv_bytes = bytes.kv_per_token * uint64_t(options.context_tokens);
  const double coord_gbps = coord.vram_gbps > 0 ? coord.vram_gbps : coord.ram_gbps;
  const double dense_gbps = coord.vram_gbps > 0 ? coord.vram_gbps : coord.dense_gbps;
  const double coord_gflops = coord.gflops;

  // ---- one step of `rows` rows: the coordinator's part plus the slowest owner's ----
  std::mt19937_64 rng(0x9E3779B97F4A7C15ull);
  std::vector<int> slowest_count(size_t(ranks), 0);
  std::vector<std::map<std::string, double>> slowest_by(static_cast<size_t>(ranks));
  const auto step = [&](int rows, int context, int samples, bool record) {
    BatchPlan out;
    out.rows = rows;
    for (int layer = 0; layer < config.num_layers; ++layer) {
      const double params = double(bytes.dense_layer_params[size_t(layer)]);
      const double dense_s = bytes.dense_layer_calls[size_t(layer)] * coord.linear_call_s +
                             std::max(double(bytes.dense_layer[size_t(layer)]) / (dense_gbps * kGB),
                                      2 * params * rows / (coord_gflops * 1e9));
      const double kv_s =
          double(bytes.kv_per_token) / config.num_layers * context * rows / (coord_gbps * kGB);
      out.coordinator_s += dense_s + kv_s;
      if (!config.layer_is_moe[size_t(layer)]) continue;
      std::vector<double> weights(size_t(E), 1.0);
      for (int e = 0; e < E; ++e)
        if (!placement.heat.empty())
          weights[size_t(e)] = std::max(1e-9, placement.heat_of(layer, e));
      std::discrete_distribution<int> pick(weights.begin(), weights.end());
      double layer_s = 0;
      for (int sample = 0; sample < samples; ++sample) {
        std::vector<int> rows_of(size_t(E), 0);
        for (int row = 0; row < rows; ++row) {
          std::vector<int> chosen;
          while (int(chosen.size()) < std::min(k, E)) {
            const int e = pick(rng);
            if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
          }
          for (int e : chosen) ++rows_of[size_t(e)];
        }
        std::vector<std::map<std::string, double>> parts(static_cast<size_t>(ranks));
        std::vector<int> routed_rows(size_t(ranks), 0);
        for (int e = 0; e < E; ++e) {
          if (rows_of[size_t(e)] == 0) continue;
          // A replicated expert's rows are split evenly over its copies, each in its holder's tier.
          std::vector<int> holders = {placement.owner_of(layer, e)};
          for (int rep : placement.replicas_of(layer, e)) holders.push_back(rep);
          for (size_t i = 0; i < holders.size(); ++i) {
            const int r = holders[i];
            const int n = rows_of[size_t(e)] / int(holders.size()) +
                          (int(i) < rows_of[size_t(e)] % int(holders.size()) ? 1 : 0);
            if (n == 0) continue;
            const RankPlan& rp = plan.ranks[size_t(r)];
            const int t = tier[size_t(r)][size_t(layer) * size_t(E) + size_t(e)];
            const double gbps = t == 0 ? rp.vram_gbps : t == 1 ? rp.expert_ram_gbps : rp.disk_gbps;
            const double read_s = rp.expert_call_s + double(bytes.expert) / (gbps * kGB);
            const double compute_s =
                rp.expert_call_s + 2.0 * double(bytes.expert_params) * n / (rp.gflops * 1e9);
            parts[size_t(r)][compute_s > read_s ? "compute"
                             : t == 0           ? "vram"
                             : t == 1           ? "ram"
                                                : "disk"] += std::max(read_s, compute_s);
            routed_rows[size_t(r)] += n;
          }
        }
        int slowest = -1;
        double slowest_s = 0;
        for (int r = 0; r < ranks; ++r) {
          if (parts[size_t(r)].empty()) continue;
          if (r != coordinator) {
            const bool same_host = plan.ranks[size_t(r)].host == coord.host;
            const double payload = double(routed_rows[size_t(r)]) * config.hidden_size *
                                   options.wire_bytes * 2;  // rows out, partials back
            parts[size_t(r)]["link"] = (same_host ? hw.shm_us : hw.link_us) * 1e-6 +
                                       payload / ((same_host ? hw.shm_gbps : hw.link_gbps) * kGB);
          }
          double total = 0;
          for (const auto& [what, s] : parts[size_t(r)]) total += s;
          if (total > slowest_s) {
            slowest_s = total;
            slowest = r;
          }
        }
        layer_s += slowest_s;
        if (record && slowest >= 0) {
          ++slowest_count[size_t(slowest)];
          for (const auto& [what, s] : parts[size_t(slowest)])
            slowest_by[size_t(slowest)][what] += s;
        }
      }
      out.experts_s += layer_s / samples;
    }
    out.coordinator_s += coord.linear_call_s +
                         std::max(double(bytes.head) / (dense_gbps * kGB),
                                  2.0 * double(bytes.head_params) * rows / (coord_gflops * 1e9));
    out.step_s = out.coordinator_s + out.experts_s;
    out.decode_tok_s = rows / out.step_s;
    return out;
  };

  for (int rows : options.batches)
    plan.batches.push_back(step(rows, options.context_tokens, options.samples, rows == 1));
  const int moe_layers = std::max(1, config.num_moe_layers());
  for (int r = 0; r < ranks; ++r) {
    plan.ranks[size_t(r)].slowest_share =
        double(slowest_count[size_t(r)]) / (double(options.samples) * moe_layers);
    double most = 0;
    for (const auto& [what, s] : slowest_by[size_t(r)])
      if (s > most) {
        most = s;
        plan.ranks[size_t(r)].slowest_by = what;
      }
  }
  // TTFT: the prompt in chunks of max_rows, each attending to the tokens before it.
  plan.prompt_tokens = options.prompt_tokens;
  for (int done = 0; done < options.prompt_tokens;) {
    const int rows = std::min(options.max_rows, options.prompt_tokens - done);
    plan.ttft_s += step(rows, done + rows / 2, std::max(4, options.samples / 16), false).step_s;
    done += rows;
  }
  plan.constants.push_back(
      {"VRAM usable without a layout budget", kVramUsable, "of the GPU", "default"});
  plan.constants.push_back({"exchange bytes per value", options.wire_bytes, "B", "--wire"});
  return plan;
}

std::string format_plan(const Plan& plan) {
  std::string out = fmt::format(
      "{:>4}  {:<11} {:<14} {:<18} {:>7} {:>7} {:>9} {:>9} {:>9} {:>8}  {}\n", "rank", "role",
      "host", "device", "threads", "experts", "VRAM GB", "RAM GB", "disk GB", "slowest", "by");
  for (const RankPlan& r : plan.ranks)
    out += fmt::format(
        "{:>4}  {:<11} {:<14} {:<18} {:>7.3g} {:>7} {:>9.3f} {:>9.3f} {:>9.3f} {:>7.0f}%  {}\n",
        r.rank, role_name(r.role), r.host, r.device, r.threads, r.experts, r.vram_bytes / kGB,
        r.ram_bytes / kGB, r.disk_bytes / kGB, 100 * r.slowest_share, r.slowest_by);
  for (const RankPlan& r : plan.ranks)
    if (r.dense_bytes > 0)
      out += fmt::format("coordinator rank {}: dense weights {:.3f} GB, KV {:.3f} GB\n", r.rank,
                         r.dense_bytes / kGB, r.kv_bytes / kGB);
  out += "predicted decode (rows: tok/s, step ms = coordinator + slowest owners):\n";
  for (const BatchPlan& b : plan.batches)
    out += fmt::format("  {:>4}: {:>9.2f} tok/s  {:>9.3f} ms = {:.3f} + {:.3f}\n", b.rows,
                       b.decode_tok_s, b.step_s * 1e3, b.coordinator_s * 1e3, b.experts_s * 1e3);
  out += fmt::format("predicted time to first token, {} prompt tokens: {:.3f} s\n",
                     plan.prompt_tokens, plan.ttft_s);
  out += "constants:\n";
  for (const PlanConstant& c : plan.constants)
    out += fmt::format("  {} = {:g} {} ({})\n", c.name, c.value, c.unit, c.source);
  return out;
}

std::string plan_json(const Plan& plan) {
  json doc;
  doc["decode_tok_s"] = json::object();
  for (const BatchPlan& b : plan.batches) {
    doc["decode_tok_s"][std::to_string(b.rows)] = b.decode_tok_s;
    doc["step_s"][std::to_string(b.rows)] = {{"coordinator", b.coordinator_s},
                                             {"experts", b.experts_s}};
  }
  doc["ttft_s"] = plan.ttft_s;
  doc["prompt_tokens"] = plan.prompt_tokens;
  for (const RankPlan& r : plan.ranks)
    doc["ranks"].push_back({{"rank", r.rank},
                            {"role", role_name(r.role)},
                            {"host", r.host},
                            {"device", r.device},
                            {"experts", r.experts},
                            {"vram_bytes", r.vram_bytes},
                            {"ram_bytes", r.ram_bytes},
                            {"disk_bytes", r.disk_bytes},
                            {"dense_bytes", r.dense_bytes},
                            {"threads", r.threads},
                            {"kv_bytes", r.kv_bytes}});
  for (const RankPlan& r : plan.ranks)
    doc["critical_path"].push_back(
        {{"rank", r.rank}, {"slowest_share", r.slowest_share}, {"by", r.slowest_by}});
  for (const PlanConstant& c : plan.constants)
    doc["constants"].push_back(
        {{"name", c.name}, {"value", c.value}, {"unit", c.unit}, {"source", c.source}});
  return doc.dump(2) + "\n";
}

}  // namespace colibri
