// This rank's checks of its command line (node/command_line.h): numbers, flag combinations, flags
// given for a run they do not apply to, the environment's knobs and the files the coordinator
// reads and writes; then the node's options from the flags.
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <utility>

#include "common/error.h"
#include "common/input_file.h"
#include "common/layout.h"
#include "common/output_file.h"
#include "cpu/quant.h"
#include "model/config.h"
#include "moe/placement.h"
#include "node/command_line.h"
#include "transport/transport_choice.h"

namespace colibri {

namespace {

using Use = FlagUse;

constexpr double kMaxRankTimeoutSeconds = 7 * 24 * 3600.0;

uint64_t parse_seed(const std::string& text) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || text[0] == '-' || text[0] == '+' || ec != std::errc() || ptr != end)
    fail("--seed '{}' must be an integer in [0, 18446744073709551615]", text);
  return value;
}

bool given(const CLI::App& app, const std::string& name) {
  return app.count(name) > 0;
}

// Numbers that CLI11 does not check, refused rather than wrapped or clamped.
void check_numbers(CommandLine& line) {
  const NodeOptions& node = line.node;
  for (const auto& [name, seconds] : {std::pair{"--rank-timeout", node.rank_timeout_s},
                                      {"--startup-timeout", node.startup_timeout_s}})
    if (!std::isfinite(seconds) || seconds <= 0 || seconds > kMaxRankTimeoutSeconds)
      fail("{} {} must be a number of seconds in (0, {}]", name, seconds, kMaxRankTimeoutSeconds);
  for (const auto& [name, gib] :
       {std::pair{"--ram-gb", node.ram_gb}, {"--pin-gb", node.pin_gb}, {"--vram-gb", node.vram_gb}})
    if (!std::isfinite(gib) || gib < 0 || gib > kMaxBudgetGib)
      fail("{} {} must be a number of GiB in [0, {}]", name, gib, kMaxBudgetGib);
  for (const auto& [name, gbps] :
       {std::pair{"--pcie-gbps", node.pcie_gbps}, {"--cpu-expert-gbps", node.cpu_expert_gbps}})
    if (!std::isfinite(gbps) || gbps <= 0 || gbps > 1e4)
      fail("{} {} must be a rate in GB/s in (0, 10000]", name, gbps);
  if (node.pin_gb > 0 && node.ram_gb > 0 && node.pin_gb > node.ram_gb)
    fail("--pin-gb {} is larger than --ram-gb {}: pinned experts are part of the RAM budget",
         node.pin_gb, node.ram_gb);
  if (node.pin_gb > 0 && node.ram_gb == 0 && line.layout.empty())
    fail("--pin-gb {} needs --ram-gb (without a RAM budget every owned expert is resident)",
         node.pin_gb);
  if (!std::isfinite(line.temperature) || line.temperature < 0)
    fail("--temp {} must be a finite number >= 0", line.temperature);
  if (!(line.top_p > 0 && line.top_p <= 1)) fail("--top-p {} must be in (0, 1]", line.top_p);
  line.seed = parse_seed(line.seed_text);
  if (line.serve) {
    if (line.port < 0 || line.port > 65535) fail("--port {} must be in [0, 65535]", line.port);
    if (line.max_queue < 1) fail("--max-queue {} must be at least 1", line.max_queue);
    if (!std::isfinite(line.max_body_mb) || line.max_body_mb <= 0 || line.max_body_mb > 1024)
      fail("--max-body-mb {} must be in (0, 1024]", line.max_body_mb);
    if (!std::isfinite(line.request_timeout) || line.request_timeout <= 0 ||
        line.request_timeout > 3600)
      fail("--request-timeout {} must be in (0, 3600] seconds", line.request_timeout);
  }
}

// Values and flag combinations that would be silently ignored or replaced by a default.
void check_combinations(const CLI::App& app, const CommandLine& line) {
  if (given(app, "--prompt") && line.prompt.empty())
    fail("--prompt is empty (leave it out for the default prompt \"{}\")", kDefaultPrompt);
  if (given(app, "--api-key") && line.api_key.empty())
    fail(
        "--api-key is empty: every route would be served without a key (leave it out to serve "
        "without one)");
  // Any other value given empty would be ignored or stand for the default.
  for (const FlagRow& row : flag_table()) {
    const CLI::Option* o = app.get_option(row.name);
    if (o->get_expected_min() == 0 || o->count() == 0) continue;
    for (const std::string& value : o->results())
      if (value.empty()) fail("{} is given an empty value", row.name);
  }
  if (!line.kv_file.empty() && !line.chat) fail("--kv-file {} needs --chat", line.kv_file);
  if (!line.kv_file.empty() && (line.split_linears || line.coordinator_gpu))
    fail("--kv-file keeps the coordinator's CPU KV cache; it cannot be used with {}",
         line.split_linears ? "--split-linears" : "--coordinator-gpu");
  if (!line.kv_cache_dir.empty() && (line.split_linears || line.coordinator_gpu))
    fail("--kv-cache-dir keeps the coordinator's CPU KV cache; it cannot be used with {}",
         line.split_linears ? "--split-linears" : "--coordinator-gpu");
  if (given(app, "--kv-cache-dir-gb") && line.kv_cache_dir.empty())
    fail("--kv-cache-dir-gb caps --kv-cache-dir; give the directory too");
  if (!line.think.empty() && !line.chat && !line.chat_format && !line.serve)
    fail("--think {} needs --chat, --chat-format or --serve", line.think);
  if (line.chat_format && given(app, "--prompt-ids"))
    fail("--chat-format wraps a text prompt; it cannot be used with --prompt-ids");
  if (line.chat_format && given(app, "--score")) fail("--chat-format cannot be used with --score");
  if (!line.logits_out.empty() && (line.chat || !line.score_file.empty()))
    fail("--logits-out is written for one generation; it cannot be used with {}",
         line.chat ? "--chat" : "--score");
  if (!line.output.empty() && line.chat)
    fail("--output collects a run's output for one file; --chat talks on the terminal");
  if (line.sequences > 1 && !line.logits_out.empty())
    fail("--logits-out keeps the logits of one sequence; it cannot be used with --sequences");
}

// The --layout file when it can be read for `world_size` ranks (one that cannot is refused at
// the handshake, with the layout's own error).
std::optional<Layout> readable_layout(const CommandLine& line, int world_size) {
  if (line.layout.empty()) return std::nullopt;
  try {
    return load_layout(line.layout, world_size);
  } catch (const Error&) {
    return std::nullopt;
  }
}

// Whether this run has a GPU: a single process's --experts gpu or --coordinator-gpu, or a gpu in
// the layout. Under mpirun without a readable layout the handshake decides (hosts with GPUs give
// gpu-expert ranks), so the GPU flags are not refused there.
bool may_use_gpu(const CommandLine& line, const std::optional<Layout>& layout, int world_size) {
  if (line.experts == "gpu" || line.coordinator_gpu) return true;
  if (world_size == 1) return false;
  if (!layout) return true;
  for (const RankSpec& spec : layout->ranks)
    if (spec.gpu >= 0 || spec.role == Role::kGpuExpert) return true;
  return false;
}

// A flag given for a run it does not apply to would be ignored: refused, naming it.
void refuse_unused_flags(const CLI::App& app, const CommandLine& line,
                         const std::optional<Layout>& layout, int world_size) {
  const bool gpu = may_use_gpu(line, layout, world_size);
  for (const FlagRow& row : flag_table()) {
    if (!given(app, row.name)) continue;
    if (row.use == Use::kOffline && line.serve)
      fail(
          "{} does not apply to --serve, which takes prompts and sampling settings from each "
          "request",
          row.name);
    if (row.use == Use::kServe && !line.serve)
      fail("{} is a --serve flag; without --serve it would be ignored", row.name);
    if (row.use == Use::kGpu && !gpu)
      fail(
          "{} applies to a run with a GPU (--experts gpu, --coordinator-gpu, or a gpu in "
          "--layout); this one has none",
          row.name);
  }
  if (line.transport == "nccl" && world_size == 1)
    fail("--transport nccl reaches gpu-expert ranks of an MPI job; a single process has none");
}

// The environment's knobs, resolved before any work (else the first kernel call would fail).
void check_environment() {
  try {
    kernels::quant_isa_selected();
  } catch (const std::invalid_argument& e) {
    fail("{}", e.what());
  }
  for (const char* name : {"COLIBRI_VNNI", "COLIBRI_AMX", "COLIBRI_TILES", "COLIBRI_BF16_PAIRS",
                           "COLIBRI_SPLIT_HEADS", "COLIBRI_BLOCKED_ATTENTION", "COLIBRI_FP4_MMA"}) {
    const char* value = std::getenv(name);
    if (value && std::strcmp(value, "0") != 0 && std::strcmp(value, "1") != 0)
      fail("{}='{}' must be 0 (off) or 1 (on)", name, value);
  }
}

// Checked on the coordinator, the rank that reads and writes these files, before any work:
// output paths (never a device, directory or FIFO; two flags never name one file) and --score.
void check_coordinator_files(const CommandLine& line) {
  std::vector<std::pair<const char*, std::filesystem::path>> outputs;
  for (const auto& [name, path] : {std::pair{"--output", &line.output},
                                   {"--logits-out", &line.logits_out},
                                   {"--profile-json", &line.profile_json},
                                   {"--trace", &line.trace}}) {
    if (path->empty()) continue;
    check_output_path(*path, name);
    std::error_code ec;
    const std::filesystem::path resolved = std::filesystem::weakly_canonical(*path, ec);
    for (const auto& [other_name, other] : outputs)
      if (!ec && resolved == other) fail("{} {}: the same file as {}", name, *path, other_name);
    outputs.emplace_back(name, resolved);
  }
  if (!line.score_file.empty()) check_regular_file(line.score_file, "the --score file");
}

// The flag, else COLIBRI_ACTIVATIONS, else int8: with the int8 kernels reading the weights in
// tiles, one sequence decodes faster with int8 activations than with fp32 on AVX-512 VNNI too
// (bench/RESULTS.md: 1.3x at one thread, 1.4-1.6x at two on the peer model), and their cost grows
// little with the rows.
void resolve_activations(const CLI::App& app, CommandLine& line) {
  try {
    kernels::set_quant_activations(kernels::quant_activations_resolve(
        given(app, "--activations") ? line.activations.c_str()
                                    : std::getenv("COLIBRI_ACTIVATIONS")));
    line.activations = kernels::quant_activations_name(kernels::quant_activations_selected());
  } catch (const std::invalid_argument& e) {
    fail("--activations: {}", e.what());
  }
}

void check_serve(CommandLine& line) {
  if (!line.serve) return;
#ifndef COLIBRI_HAVE_SERVE
  fail(
      "--serve: this colibri-node was built without cpp-httplib (apt-get install "
      "libcpp-httplib-dev, then reconfigure)");
#endif
  if (line.api_key.empty())
    if (const char* key = std::getenv("COLIBRI_API_KEY")) {
      if (*key == '\0')
        fail(
            "COLIBRI_API_KEY is set but empty: every route would be served without a key "
            "(unset it to serve without one)");
      line.api_key = key;
    }
  NodeOptions& node = line.node;
  if (!(line.max_itl_ms >= 0 && line.max_itl_ms <= 1e6))
    fail("--max-itl-ms {} must be in [0, 1e6] (0: off)", line.max_itl_ms);
  if (line.max_batch_tokens == 0) line.max_batch_tokens = node.max_rows;
  if (line.max_batch_tokens > node.max_rows)
    fail("--max-batch-tokens {} exceeds --max-rows {}", line.max_batch_tokens, node.max_rows);
  if (line.max_batch_tokens <= node.max_seqs)
    fail(
        "--max-batch-tokens {} must exceed --max-seqs {}: every running sequence takes a decode "
        "row per step and prompts need room too",
        line.max_batch_tokens, node.max_seqs);
}

}  // namespace

std::vector<int> parse_ids(const std::string& text) {
  std::vector<int> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    size_t used = 0;
    long value = -1;
    try {
      value = std::stol(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || value < 0 || value > (1L << 30))
      fail("--prompt-ids: '{}' is not a token id (expected e.g. 1,2,3)", item);
    ids.push_back(int(value));
    pos = comma + 1;
  }
  return ids;
}

void check_context(const ModelConfig& config, size_t prompt_tokens, int ngen, bool keep_logits) {
  const int64_t context = config.max_position_embeddings;
  if (int64_t(prompt_tokens) > context)
    fail("the prompt has {} tokens, more than the model's context of {} (max_position_embeddings)",
         prompt_tokens, context);
  const int64_t positions = int64_t(prompt_tokens) + ngen - (ngen > 0 && !keep_logits ? 1 : 0);
  if (positions > context)
    fail(
        "--ngen {} after a prompt of {} tokens needs {} positions, more than the model's context "
        "of {} (max_position_embeddings); at most --ngen {} fits",
        ngen, prompt_tokens, positions, context,
        context - int64_t(prompt_tokens) + (keep_logits ? 0 : 1));
}

void check_command_line(const CLI::App& app, CommandLine& line, int rank, int world_size) {
  check_numbers(line);
  const std::optional<Layout> layout = readable_layout(line, world_size);
  refuse_unused_flags(app, line, layout, world_size);
  check_combinations(app, line);
  check_environment();
  check_readable_directory(line.node.model_dir, "the --model directory");
  // The rank that will coordinate: rank 0, unless the layout names another.
  if (rank == (layout ? layout->coordinator() : 0)) {
    check_coordinator_files(line);
    if (!line.prompt_ids.empty())  // before the weights load; text prompts once tokenized
      check_context(load_model_config(line.node.model_dir), parse_ids(line.prompt_ids).size(),
                    line.ngen, !line.logits_out.empty());
  }
  NodeOptions& node = line.node;
  if (!line.layout.empty()) node.layout_file = line.layout;
  node.placement = parse_placement_policy(line.placement);
  node.routing_stats = line.routing_stats == "off" ? "" : line.routing_stats;
  node.keep_trace = !line.trace.empty();
  node.wire_type = parse_elem_type(line.wire, "--wire");
  node.host_combine = line.combine == "host";
  node.shared_memory = line.shared_memory == "on";
  node.transport = parse_transport(line.transport, "--transport");
  node.gpu_experts = line.experts == "gpu";
  node.coordinator_gpu = line.coordinator_gpu;
  node.split_linears = line.split_linears;
  if (!given(app, "--max-seqs")) node.max_seqs = line.serve ? kServeDefaultMaxSeqs : line.sequences;
  resolve_activations(app, line);
  check_serve(line);
  if (node.max_seqs > node.max_rows)
    fail("--max-seqs {} exceeds --max-rows {}: every running sequence needs a row per step",
         node.max_seqs, node.max_rows);
  node.settings = agreed_settings(app, line);
}

}  // namespace colibri
