#include "plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "coordinator/kv_manager.h"

namespace colibri {
namespace {

using json = nlohmann::json;

constexpr double kGB = 1e9;

// Defaults for what a description may leave out, each printed as "default".
constexpr double kShmUs = 20, kShmGbps = 10, kLinkUs = 60, kLinkGbps = 3;

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

// Records the constants a description gives, each with where it came from: a value from the
// description itself is named by `from` (the calibration, where it is one).
struct ConstantLog {
  std::vector<PlanConstant>& constants;
  std::string source, from;
  void operator()(const std::string& name, double value, const char* unit,
                  const std::string& origin) const {
    constants.push_back({name, value, unit, origin == source ? from : origin});
  }
};

// Where the description's own values come from: the file, or its calibration (of this build's
// version only).
std::string origin_of(const json& doc, const std::string& source) {
  if (!doc.contains("calibration")) return source;
  const json& calibration = doc["calibration"];
  if (!calibration.is_object() || !calibration.contains("version") ||
      !calibration["version"].is_number_integer())
    fail("{}: \"calibration\" must be an object with an integer \"version\"", source);
  if (calibration["version"].get<int>() != kCalibrationVersion)
    fail(
        "{}: calibration version {} is not this build's ({}): run `colibri-node calibrate` "
        "again",
        source, calibration["version"].get<int>(), kCalibrationVersion);
  return fmt::format("calibration {} ({})", source, calibration.value("date", "undated"));
}

// One socket, `at` in the description, named `name` in the constants.
SocketSpec parse_socket(const json& socket, const std::string& at, const std::string& name,
                        const ConstantLog& constant) {
  const std::string& source = constant.source;
  SocketSpec sock;
  sock.cores = int(number(socket, "cores", at, true));
  sock.mem_gbps = number(socket, "mem_gbps", at, true);
  sock.core_gbps = number(socket, "core_gbps", at, false, sock.mem_gbps);
  sock.gflops = number(socket, "gflops", at, true);
  sock.linear_us = number(socket, "linear_us", at, false);
  sock.linear_us_one_thread = number(socket, "linear_us_one_thread", at, false, -1);
  if (sock.cores < 1 || sock.mem_gbps <= 0 || sock.gflops <= 0)
    fail("{}: cores, mem_gbps and gflops must be positive", at);
  constant(name + " read", sock.mem_gbps, "GB/s", source);
  constant(name + " read per core", sock.core_gbps, "GB/s",
           socket.contains("core_gbps") ? source : "default (the socket's)");
  constant(name + " compute", sock.gflops, "GFLOP/s", source);
  constant(name + " matrix product call", sock.linear_us, "us",
           socket.contains("linear_us") ? source : "default (none)");
  const auto per_format = [&](const char* key, std::map<std::string, double>& out, const char* what,
                              const char* unit, bool positive) {
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
  per_format("expert_us_one_thread", sock.expert_us_one_thread, "expert call on one thread", "us",
             false);
  if (sock.linear_us_one_thread >= 0)
    constant(name + " matrix product call on one thread", sock.linear_us_one_thread, "us", source);
  per_format("expert_gbps", sock.expert_gbps, "expert kernel read", "GB/s", true);
  per_format("expert_gflops", sock.expert_gflops, "expert kernel compute", "GFLOP/s", true);
  return sock;
}

// A host's GPUs, where it lists any.
void parse_gpus(const json& host, const std::string& where, HostSpec& spec,
                const ConstantLog& constant) {
  if (!host.contains("gpus")) return;
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
    constant(name + " memory read", spec_gpu.hbm_gbps, "GB/s", constant.source);
    constant(name + " PCIe upload", spec_gpu.pcie_gbps, "GB/s", constant.source);
    constant(name + " compute", spec_gpu.tflops, "TFLOP/s", constant.source);
  }
}

// One host, `where` in the description: its sockets, GPUs, disk and memory.
HostSpec parse_host(const json& host, const std::string& where, const ConstantLog& constant) {
  if (!host.is_object()) fail("{}: not an object", where);
  HostSpec spec;
  spec.name = host.value("name", std::string());
  if (spec.name.empty()) fail("{}: missing \"name\"", where);
  if (!host.contains("sockets") || !host["sockets"].is_array() || host["sockets"].empty())
    fail("{}: \"sockets\" must be a non-empty array", where);
  for (size_t s = 0; s < host["sockets"].size(); ++s)
    spec.sockets.push_back(parse_socket(host["sockets"][s], fmt::format("{}.sockets[{}]", where, s),
                                        fmt::format("{} socket {}", spec.name, s), constant));
  parse_gpus(host, where, spec, constant);
  spec.disk_gbps = number(host, "disk_gbps", where, true);
  spec.ram_gb = number(host, "ram_gb", where, false);
  if (spec.ram_gb > 0) constant(spec.name + " memory", spec.ram_gb, "GB", constant.source);
  if (spec.disk_gbps <= 0) fail("{}: disk_gbps must be positive", where);
  constant(spec.name + " disk read", spec.disk_gbps, "GB/s", constant.source);
  return spec;
}

}  // namespace

Hardware parse_hardware(const std::string& json_text, const std::string& source) {
  const json doc = json::parse(json_text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) fail("{}: not a JSON object", source);
  if (!doc.contains("hosts") || !doc["hosts"].is_array() || doc["hosts"].empty())
    fail("{}: \"hosts\" must be a non-empty array", source);
  Hardware hw;
  const ConstantLog constant{hw.constants, source, origin_of(doc, source)};
  for (size_t h = 0; h < doc["hosts"].size(); ++h)
    hw.hosts.push_back(
        parse_host(doc["hosts"][h], fmt::format("{}: hosts[{}]", source, h), constant));
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
