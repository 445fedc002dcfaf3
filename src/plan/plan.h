// `colibri-node plan`: what a layout will do before it runs. From the model's shapes, a hardware
// description, the layout and its placement (the same make_placement a run uses, heat included),
// it puts every owned expert in a tier (VRAM, RAM, disk: hottest first, within the layout's
// budgets) and predicts, as a bandwidth-and-compute model of the decode step:
//   per MoE layer = the coordinator's dense part (weights, KV reads, or its compute)
//                 + the slowest owner's part (its routed experts' bytes from their tiers, or their
//                   compute, plus its exchange), as the expectation over sampled routings;
//   per step      = every layer + the head; decode tok/s = rows / step; TTFT = the prompt's chunks.
// Every constant comes from the hardware description (or a default it names), and is printed with
// where it came from. What the model leaves out: overlap between the coordinator and the experts
// (the step is their sum), caches other than the tiers, and the cost of MPI progress on shared
// cores.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/layout.h"
#include "model/config.h"
#include "moe/placement.h"
#include "moe/routing_stats.h"

namespace colibri {

// A named constant and where it came from ("hardware file", "default").
struct PlanConstant {
  std::string name;
  double value = 0;
  std::string unit, source;
};

struct SocketSpec {
  int cores = 1;
  double mem_gbps = 0;   // read bandwidth of the socket, all cores
  double core_gbps = 0;  // read bandwidth one core reaches
  double gflops = 0;     // quantized matrix products at many rows, all cores
  double linear_us = 0;  // fixed cost of one of the coordinator's matrix products (0: none)
  double linear_us_one_thread = -1;  // the same on one thread (-1: not measured)
  // Per routed-expert format ("bf16", "int8", "int4"), where measured (calibrate): the fixed cost
  // of one expert call at one row (us), the rate the kernel streams experts from memory (GB/s,
  // instead of mem_gbps) and its compute rate at many rows (GFLOP/s, instead of gflops).
  std::map<std::string, double> expert_us, expert_gbps, expert_gflops;
  std::map<std::string, double> expert_us_one_thread;  // expert_us on one thread, where measured
  // Per format: the rate the coordinator's matrix products stream their weights at one row.
  std::map<std::string, double> linear_gbps;
};

struct GpuSpec {
  std::string name;
  double vram_gb = 0, hbm_gbps = 0, pcie_gbps = 0, tflops = 0;
};

struct HostSpec {
  std::string name;
  std::vector<SocketSpec> sockets;
  std::vector<GpuSpec> gpus;
  double disk_gbps = 0;
  double ram_gb = 0;  // memory of the host (0: not described; a search then sets no budgets)
};

struct Hardware {
  std::vector<HostSpec> hosts;
  double shm_us = 0, shm_gbps = 0;      // an exchange between ranks of one host
  double link_us = 0, link_gbps = 0;    // between hosts
  std::vector<PlanConstant> constants;  // each value above with its source
};

// A hardware description (JSON): {"hosts": [{"name", "sockets": [{"cores", "mem_gbps",
// "core_gbps", "gflops", "linear_us", "linear_gbps": {format: GB/s}, "expert_us": {format: us},
// "expert_gbps": {..},
// "expert_gflops": {..}}], "gpus": [{"name", "vram_gb", "hbm_gbps", "pcie_gbps", "tflops"}],
// "disk_gbps", "ram_gb"}], "links": {"shm_us", "shm_gbps", "link_us", "link_gbps"}}. Missing link
// fields take the defaults (named as such), missing per-call costs are 0 and per-format rates fall
// back to the socket's; anything else missing or out of range is an error naming the file and the
// field. A description with a "calibration" block (colibri-node calibrate) names its constants'
// source as "calibration FILE (date)".
// The version of calibrate's output this build reads (an older one is refused: calibrate again).
constexpr int kCalibrationVersion = 1;
Hardware parse_hardware(const std::string& json_text, const std::string& source);

// Bytes the step reads, from the model's shapes and the weights' format.
struct ModelBytes {
  std::string format;   // routed experts: "bf16", "fp8", "int8", "int4"
  std::string dense;    // the coordinator's dense weights, the same names
  uint64_t expert = 0;  // one routed expert (gate, up, down, with scales)
  uint64_t expert_params = 0;
  std::vector<uint64_t> dense_layer;  // [layers] attention, shared experts, router / dense MLP
  std::vector<uint64_t> dense_layer_params;
  std::vector<int> dense_layer_calls;  // [layers] matrix products of the coordinator
  uint64_t head = 0;                   // lm_head (and the embedding row)
  uint64_t head_params = 0;
  uint64_t kv_per_token = 0;  // the KV cache of one token, every layer
};

// `format` as stored: "bf16", "fp8" (block scales), "int8" or "int4" (colibri containers: per-row
// and per-64 fp32 scales). Dense weights (attention, dense and shared MLPs; the head stays BF16
// unless they are FP8) in `dense_format` ("" : BF16, or FP8 when the experts are).
ModelBytes model_bytes(const ModelConfig& config, const std::string& format,
                       const std::string& dense_format = "");

struct PlanOptions {
  std::vector<int> batches = {1, 4, 16, 64};
  int prompt_tokens = 1024;
  int context_tokens = 1024;  // KV read per decode row
  int max_rows = 256;         // prefill chunk
  double wire_bytes = 4;      // per activation value on the exchange (fp32; bf16: 2)
  int samples = 256;          // sampled routings per layer and batch
};

struct RankPlan {
  int rank = 0;
  Role role = Role::kCpuExpert;
  std::string host, device;  // "socket 0", "GPU 2 (RTX 5090)"
  int experts = 0;
  uint64_t vram_bytes = 0, ram_bytes = 0, disk_bytes = 0;
  uint64_t dense_bytes = 0, kv_bytes = 0;  // the coordinator
  double vram_gbps = 0, ram_gbps = 0, disk_gbps = 0, gflops = 0;
  double expert_ram_gbps = 0;  // the expert kernel's rate from RAM (ram_gbps where not measured)
  double expert_call_s = 0;    // fixed cost of one expert call
  double linear_call_s = 0;    // fixed cost of one matrix product (the coordinator)
  double dense_gbps = 0;       // the coordinator's dense weights read by its matrix products
  double threads = 1;          // its compute threads: one a rank when its host is oversubscribed
  double slowest_share = 0;    // of the MoE layers at batch 1, how often it was the slowest owner
  std::string
      slowest_by;  // what it spent most time on then: "vram", "ram", "disk", "compute", "link"
};

struct BatchPlan {
  int rows = 1;
  double step_s = 0, decode_tok_s = 0;
  double coordinator_s = 0, experts_s = 0;  // the step's two parts
};

struct Plan {
  std::vector<RankPlan> ranks;
  std::vector<BatchPlan> batches;
  double ttft_s = 0;
  int prompt_tokens = 0;
  std::vector<PlanConstant> constants;
};

// The plan of `layout` with `placement` on `hardware`. Refused (an Error naming the rank) when a
// rank's host, socket or GPU is not in the hardware description.
Plan make_plan(const ModelConfig& config, const ModelBytes& bytes, const Layout& layout,
               const PlacementTable& placement, const Hardware& hardware,
               const PlanOptions& options);

// The plan as a table, and as JSON (decode_tok_s per batch, ttft_s, per rank, constants).
std::string format_plan(const Plan& plan);
std::string plan_json(const Plan& plan);

// ---- --search: the best layout within the hardware ----

struct SearchOptions {
  PlanOptions plan;  // its batches: the candidates are ranked by the first
  PlacementPolicy policy = PlacementPolicy::kBalanced;
  const RoutingStats* stats = nullptr;  // for the heat policy
  int replicas = 0;
  double ram_headroom = 0.1;  // of a host's memory left to the OS and the processes
  double vram_usable = 0.9;   // of a GPU's memory for experts (the rest: context, activations)
  bool ram_budgets = true, vram_budgets = true;  // false: left unset (a run's flags decide)
};

struct SearchCandidate {
  Layout layout;
  std::string summary;  // "coordinator on GPU 0, 5 gpu-expert, 1 cpu-expert a socket"
  Plan plan;
  std::string refused;  // why it cannot run (does not fit); empty when it can
};

// Every layout of one shape the hardware allows, planned: the coordinator on the CPU of the first
// host or on its GPU 0; a gpu-expert rank on every other GPU of every host; 0, 1 or 2 cpu-expert
// ranks bound to each socket of every host; RAM budgets splitting each host's ram_gb (less the
// headroom, and the coordinator's dense weights and KV on its host) evenly over its expert ranks,
// VRAM budgets vram_usable of each GPU (a layout's budgets are GiB; a description's sizes GB).
// Sorted best first by decode tok/s at the first batch; candidates that do not fit (the
// coordinator's weights and KV over its GPU) last, with the reason.
std::vector<SearchCandidate> search_layouts(const ModelConfig& config, const ModelBytes& bytes,
                                            const Hardware& hardware, const SearchOptions& options);

// A layout as a layout file (docs/LAUNCH.md): a comment `header`, then one row per rank.
std::string layout_text(const Layout& layout, const std::string& header);

}  // namespace colibri
