// `colibri-node plan`: the plan of a layout on a hardware description (plan/plan.h), printed as
// a table or JSON. Needs no MPI and reads no weight data (the checkpoint's headers at most).
#include "plan/plan_main.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "common/output_file.h"
#include "model/checkpoint.h"
#include "model/container.h"
#include "moe/routing_stats.h"
#include "node/handshake.h"
#include "plan/calibrate.h"
#include "plan/plan.h"

namespace colibri {
namespace {

std::string read_text(const std::filesystem::path& path, const char* what) {
  std::ifstream in(path);
  if (!in) fail("{} {}: cannot be read", what, path.string());
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The format `name` is stored (and kept) in: a container's int8/int4 (NVFP4 as int4), FP8, BF16 or
// F32; `fallback` when the checkpoint has no such tensor. `elements` tells int4 from int8.
std::string stored_format(const Checkpoint& checkpoint, const std::string& name, uint64_t elements,
                          const std::string& fallback) {
  const TensorView* w = checkpoint.find(name);
  if (!w) return fallback;
  if (w->dtype == Dtype::U8 && checkpoint.find(name + kQuantScaleSuffix))
    return uint64_t(w->nbytes) * 2 <= elements ? "int4" : "int8";
  // NVFP4 is planned as int4 g64: the same 4.5 bits a weight (its kernels are not calibrated).
  if (checkpoint.is_nvfp4(name)) return "int4";
  if (w->dtype == Dtype::F8_E4M3) return "fp8";
  if (w->dtype == Dtype::F32) return "fp32";
  return "bf16";
}

// The routed experts' format as stored in `checkpoint`.
std::string stored_expert_format(const ModelConfig& config, const Checkpoint& checkpoint) {
  int layer = 0;
  while (layer < config.num_layers && !config.layer_is_moe[size_t(layer)]) ++layer;
  return stored_format(checkpoint,
                       fmt::format("model.layers.{}.mlp.experts.0.gate_proj.weight", layer),
                       uint64_t(config.moe_intermediate_size) * uint64_t(config.hidden_size),
                       config.fp8_block ? "fp8" : "bf16");
}

// The coordinator's dense weights as stored (its attention's kv_a projection stands for them).
std::string stored_dense_format(const ModelConfig& config, const Checkpoint& checkpoint) {
  return stored_format(
      checkpoint, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
      uint64_t(config.kv_lora_rank + config.qk_rope_head_dim) * uint64_t(config.hidden_size), "");
}

std::string format_search(const std::vector<SearchCandidate>& found) {
  std::string out = fmt::format("{:>3}  {:<62} {:>5}", "#", "layout", "ranks");
  for (const BatchPlan& b : found.front().plan.batches)
    out += fmt::format(" {:>11}", fmt::format("{} rows", b.rows));
  out += "  (predicted decode tok/s)\n";
  for (size_t i = 0; i < found.size(); ++i) {
    const SearchCandidate& c = found[i];
    out += fmt::format("{:>3}  {:<62} {:>5}", i + 1, c.summary, c.layout.ranks.size());
    for (const BatchPlan& b : c.plan.batches) out += fmt::format(" {:>11.2f}", b.decode_tok_s);
    if (!c.refused.empty()) out += "  does not fit: " + c.refused;
    out += "\n";
  }
  return out;
}

std::string search_json(const std::vector<SearchCandidate>& found, const std::string& layout) {
  nlohmann::json doc;
  for (const SearchCandidate& c : found) {
    nlohmann::json entry = {{"summary", c.summary}, {"ranks", c.layout.ranks.size()}};
    for (const BatchPlan& b : c.plan.batches)
      entry["decode_tok_s"][std::to_string(b.rows)] = b.decode_tok_s;
    if (!c.refused.empty()) entry["refused"] = c.refused;
    doc["candidates"].push_back(entry);
  }
  doc["best"] = nlohmann::json::parse(plan_json(found.front().plan));
  doc["layout"] = layout;
  return doc.dump(2) + "\n";
}

// What `plan`'s flags set.
struct PlanArgs {
  std::string model, layout_file, hardware_file, placement_name = "balanced", routing_stats,
                                                 weights, wire = "f32";
  int np = 0, replicas = 0, prompt_tokens = 1024, context = 1024;
  std::vector<int> batches = {1, 4, 16, 64};
  bool as_json = false, search = false;
  std::string search_out;
  double ram_gb = 0;
  std::vector<std::string> search_budgets = {"ram", "vram"};
};

void add_plan_flags(CLI::App& app, PlanArgs& a) {
  app.add_option("--model", a.model, "model directory (config.json; the checkpoint if present)")
      ->required();
  app.add_option("--hardware", a.hardware_file,
                 fmt::format("hardware description (JSON, docs/PLAN.md); default: this machine's "
                             "calibration, {}",
                             default_hardware_path()));
  app.add_option("--np", a.np, "ranks of the plain `mpirun -np N colibri-node` on the first host");
  app.add_option("--layout", a.layout_file, "layout file (docs/LAUNCH.md), instead of --np");
  app.add_option("--placement", a.placement_name, "placement policy, as a run's --placement");
  app.add_option("--replicas", a.replicas, "extra copies per MoE layer (--placement heat)");
  app.add_option("--routing-stats", a.routing_stats, "routing statistics for --placement heat");
  app.add_option("--weights", a.weights,
                 "routed experts' format: bf16, fp8, int8, int4 (default: as stored, else bf16 "
                 "or the config's fp8)");
  app.add_option("--wire", a.wire, "exchange activations: f32 or bf16");
  app.add_option("--ram-gb", a.ram_gb,
                 "as a run's --ram-gb: GiB of RAM for the routed experts of every expert rank "
                 "whose layout row sets no budget");
  app.add_option("--batches", a.batches, "decode rows per step to predict")->delimiter(',');
  app.add_option("--prompt-tokens", a.prompt_tokens, "prompt length for the time to first token");
  app.add_option("--context", a.context, "tokens each decode row attends to");
  app.add_flag("--json", a.as_json, "print JSON instead of the table");
  app.add_flag(
      "--search", a.search,
      "instead of --np/--layout: plan every layout of the hardware (coordinator on the CPU "
      "or a GPU, a gpu-expert per GPU, 0-2 cpu-expert ranks a socket, budgets from the "
      "hosts' memory) and show the best by decode tok/s at the first of --batches");
  app.add_option("--search-out", a.search_out, "--search: write the best layout to this file");
  app.add_option("--search-budgets", a.search_budgets,
                 "--search: the budget columns the layouts set (ram, vram; none: neither, so a "
                 "run's --ram-gb / --vram-gb decide)")
      ->delimiter(',')
      ->check(CLI::IsMember({"ram", "vram", "none"}));
}

// The hardware description: --hardware, else this machine's calibration.
Hardware load_hardware(PlanArgs& a) {
  if (a.hardware_file.empty()) {
    a.hardware_file = default_hardware_path();
    if (!std::filesystem::exists(a.hardware_file))
      fail(
          "plan: no --hardware and no calibration of this machine at {}: run `colibri-node "
          "calibrate` (launch/calibrate.sh also measures the exchange) or give --hardware FILE",
          a.hardware_file);
  }
  return parse_hardware(read_text(a.hardware_file, "--hardware"), a.hardware_file);
}

// The flags' combinations and numbers.
void check_plan_flags(const PlanArgs& a) {
  if (a.search) {
    if (a.np > 0 || !a.layout_file.empty())
      fail("plan: --search plans its own layouts: no --np or --layout");
  } else {
    if (!a.search_out.empty()) fail("plan: --search-out needs --search");
    if ((a.np > 0) == !a.layout_file.empty()) fail("plan: give --np N, --layout FILE or --search");
  }
  if (!a.search_out.empty()) check_output_path(a.search_out, "--search-out");
  if (a.wire != "f32" && a.wire != "bf16") fail("--wire '{}': expected f32 or bf16", a.wire);
  if (a.prompt_tokens < 1 || a.context < 0) fail("--prompt-tokens must be >= 1, --context >= 0");
  if (a.ram_gb < 0 || !std::isfinite(a.ram_gb)) fail("--ram-gb must be a number >= 0");
  for (int b : a.batches)
    if (b < 1) fail("--batches: {} rows is not a batch", b);
}

// --routing-stats, checked against the checkpoint; empty without the flag.
RoutingStats routing_stats_of(const PlanArgs& a, const ModelConfig& config,
                              const Checkpoint* checkpoint) {
  RoutingStats stats;
  if (a.routing_stats.empty()) return stats;
  if (!checkpoint)
    fail("--routing-stats: {} has no checkpoint to check the statistics against", a.model);
  return read_routing_stats(a.routing_stats, config.num_layers, config.n_routed_experts,
                            {model_hash(a.model, *checkpoint), weights_fingerprint(*checkpoint)});
}

// --search: every layout of the hardware planned; prints them and the best, and writes the best
// to --search-out.
int run_search(const PlanArgs& a, const ModelConfig& config, const ModelBytes& bytes,
               const Hardware& hardware, const RoutingStats& stats, const PlanOptions& options) {
  SearchOptions search_options;
  search_options.plan = options;
  search_options.policy = parse_placement_policy(a.placement_name);
  search_options.stats = a.routing_stats.empty() ? nullptr : &stats;
  search_options.replicas = a.replicas;
  const auto wants = [&](const char* column) {
    return std::find(a.search_budgets.begin(), a.search_budgets.end(), column) !=
           a.search_budgets.end();
  };
  search_options.ram_budgets = wants("ram");
  search_options.vram_budgets = wants("vram");
  const std::vector<SearchCandidate> found =
      search_layouts(config, bytes, hardware, search_options);
  if (!found.empty() && !found.front().refused.empty())
    std::fputs(format_search(found).c_str(), stdout);
  if (found.empty() || !found.front().refused.empty())
    fail("plan --search: no layout of {} fits ({})", a.hardware_file,
         found.empty() ? "no expert rank possible" : found.front().refused);
  const SearchCandidate& best = found.front();
  const std::string layout = layout_text(
      best.layout,
      fmt::format("colibri-node plan --search: {} ({} routed experts of {}), "
                  "predicted {:.2f} tok/s at {} rows on {}",
                  best.summary, a.weights, a.model, best.plan.batches.front().decode_tok_s,
                  best.plan.batches.front().rows, a.hardware_file));
  if (!a.search_out.empty())
    write_file_atomically(a.search_out, [&](std::FILE* f) { std::fputs(layout.c_str(), f); });
  std::fputs(a.as_json ? search_json(found, layout).c_str()
                       : (format_search(found) + "\nthe best layout:\n" + layout + "\n" +
                          format_plan(best.plan))
                             .c_str(),
             stdout);
  return 0;
}

// The layout to plan: --layout's file, or the plain `mpirun -np N` one; --ram-gb for the expert
// ranks whose row sets no budget.
Layout layout_of(const PlanArgs& a, const Hardware& hardware) {
  Layout layout;
  if (!a.layout_file.empty()) {
    // Its rows (comments and blank lines left out) are the job's ranks.
    const std::string text = read_text(a.layout_file, "--layout");
    std::istringstream lines(text);
    int rows = 0;
    for (std::string line; std::getline(lines, line);)
      if (line.substr(0, line.find('#')).find_first_not_of(" \t\r") != std::string::npos) ++rows;
    layout = parse_layout(text, a.layout_file, std::max(rows, 1));
  } else {
    const int np = a.np;
    std::vector<int> local(static_cast<size_t>(np)), host_index(static_cast<size_t>(np), 0);
    for (int i = 0; i < np; ++i) local[size_t(i)] = i;
    const std::vector<int> gpus(static_cast<size_t>(np), int(hardware.hosts.front().gpus.size()));
    layout = default_layout(np, local, gpus, host_index);
  }
  if (a.ram_gb > 0)
    for (RankSpec& r : layout.ranks)
      if (r.role != Role::kCoordinator && r.ram_gb == 0) r.ram_gb = a.ram_gb;
  return layout;
}

}  // namespace

int plan_main(int argc, char** argv) {
  CLI::App app{
      "colibri-node plan: what a layout will do on a machine, before it runs: per rank its role, "
      "tiers and bytes; predicted decode tok/s, time to first token, and which rank and resource "
      "is the slowest, with every constant and its source."};
  PlanArgs a;
  add_plan_flags(app, a);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    const ModelConfig config = load_model_config(a.model);
    std::unique_ptr<Checkpoint> checkpoint;
    if (std::filesystem::exists(std::filesystem::path(a.model) / "model.safetensors") ||
        std::filesystem::exists(std::filesystem::path(a.model) / "model.safetensors.index.json"))
      checkpoint = std::make_unique<Checkpoint>(a.model, config.fp8_block, config.int4_group_size);
    if (a.weights.empty())
      a.weights = checkpoint ? stored_expert_format(config, *checkpoint)
                             : (config.fp8_block ? "fp8" : "bf16");
    const Hardware hardware = load_hardware(a);
    check_plan_flags(a);
    const ModelBytes bytes =
        model_bytes(config, a.weights, checkpoint ? stored_dense_format(config, *checkpoint) : "");
    const RoutingStats stats = routing_stats_of(a, config, checkpoint.get());
    PlanOptions options;
    options.batches = a.batches;
    options.prompt_tokens = a.prompt_tokens;
    options.context_tokens = a.context;
    options.wire_bytes = a.wire == "bf16" ? 2 : 4;
    if (a.search) return run_search(a, config, bytes, hardware, stats, options);
    const Layout layout = layout_of(a, hardware);
    const PlacementTable placement =
        make_placement(config, layout, parse_placement_policy(a.placement_name), bytes.expert,
                       a.routing_stats.empty() ? nullptr : &stats, a.replicas);
    const Plan plan = make_plan(config, bytes, layout, placement, hardware, options);
    std::fputs((a.as_json ? plan_json(plan) : format_plan(plan)).c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri-node plan: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace colibri
