#include "node/command_line.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "common/error.h"
#include "common/input_file.h"
#include "common/layout.h"
#include "common/output_file.h"
#include "cpu/quant.h"
#include "model/config.h"
#include "moe/placement.h"
#include "transport/transport_choice.h"

namespace colibri {

namespace {

using Use = FlagUse;
using Agree = FlagAgreement;
using Tune = std::function<void(CLI::Option&)>;

template <class T>
std::string text_of(const T& value) {
  if constexpr (std::is_same_v<T, bool>)
    return value ? "on" : "off";
  else if constexpr (std::is_same_v<T, std::filesystem::path>)
    return value.string();
  else if constexpr (std::is_convertible_v<T, std::string>)
    return std::string(value);
  else
    return fmt::format("{}", value);
}

// The parts of a row every kind shares; `get` is a generic lambda returning the bound member, so
// that it serves a const and a mutable CommandLine.
template <class Get>
FlagRow base_row(std::string name, std::string shown, Use use, Agree agreement, std::string help,
                 Get get) {
  FlagRow row;
  row.name = std::move(name);
  row.help = std::move(help);
  row.shown_default = std::move(shown);
  row.use = use;
  row.agreement = agreement;
  row.value = [get](const CommandLine& line) { return text_of(get(line)); };
  return row;
}

// An option taking a value. An empty `shown` default is the bound value's text, "none" for an
// empty string.
template <class Get>
FlagRow option(std::string name, std::string shown, Use use, Agree agreement, std::string help,
               Get get, Tune tune = {}) {
  FlagRow row = base_row(std::move(name), std::move(shown), use, agreement, std::move(help), get);
  row.add = [name = row.name, help = row.help, get, tune](CLI::App& app, CommandLine& line) {
    CLI::Option* o = app.add_option(name, get(line), help)->capture_default_str();
    if (tune) tune(*o);
    return o;
  };
  return row;
}

// A flag without a value: on when given.
template <class Get>
FlagRow flag(std::string name, Use use, Agree agreement, std::string help, Get get) {
  FlagRow row = base_row(std::move(name), "off", use, agreement, std::move(help), get);
  row.add = [name = row.name, help = row.help, get](CLI::App& app, CommandLine& line) {
    return app.add_flag(name, get(line), help);
  };
  return row;
}

// The same row compared job-wide when --split-linears is given.
FlagRow job_with_split_linears(FlagRow row) {
  row.job_with_split_linears = true;
  return row;
}

// The same row with another value compared at the handshake.
FlagRow compared_as(FlagRow row, std::function<std::string(const CommandLine&)> value) {
  row.value = std::move(value);
  return row;
}

Tune in_range(int low, int high) {
  return [low, high](CLI::Option& o) { o.check(CLI::Range(low, high)); };
}

Tune one_of(std::vector<std::string> names) {
  return [names](CLI::Option& o) { o.check(CLI::IsMember(names)); };
}

// A layout is compared by its content: its path may differ between hosts.
std::string layout_identity(const CommandLine& line) {
  if (line.layout.empty()) return "(none)";
  uint64_t hash = 14695981039346656037ull;
  for (char c : read_regular_file(line.layout, "the layout file"))
    hash = (hash ^ uint8_t(c)) * 1099511628211ull;
  return fmt::format("a file with content hash {:016x}", hash);
}

std::vector<FlagRow> make_table() {
  // clang-format off
  std::vector<FlagRow> rows = {
    option("--model", "models/glm5-tiny-kjv", Use::kAny, Agree::kOwn,
           "Hugging Face model directory (default: the embedded tiny GLM-5 model)",
           [](auto& l) -> auto& { return l.node.model_dir; }),
    option("--prompt", kDefaultPrompt, Use::kOffline, Agree::kCoordinator,
           std::string("text to continue (default: \"") + kDefaultPrompt + "\")",
           [](auto& l) -> auto& { return l.prompt; }),
    option("--prompt-ids", "", Use::kOffline, Agree::kCoordinator,
           "prompt as comma-separated token ids, e.g. 1,2,3",
           [](auto& l) -> auto& { return l.prompt_ids; }),
    flag("--chat", Use::kOffline, Agree::kCoordinator,
         "interactive chat on the terminal; the KV cache keeps the conversation",
         [](auto& l) -> auto& { return l.chat; }),
    option("--score", "", Use::kOffline, Agree::kCoordinator,
           "print the per-token negative log-likelihood and perplexity of a text file",
           [](auto& l) -> auto& { return l.score_file; }),
    option("--kv-file", "", Use::kOffline, Agree::kCoordinator,
           "with --chat: the conversation's KV cache, appended after every turn and continued "
           "from when the chat is reopened",
           [](auto& l) -> auto& { return l.kv_file; }),
    flag("--chat-format", Use::kOffline, Agree::kCoordinator,
         "wrap --prompt as one user turn in the model's chat format",
         [](auto& l) -> auto& { return l.chat_format; }),
    option("--think", "template's", Use::kAny, Agree::kCoordinator,
           "chat thinking block: on or off (default: the template's choice); with --serve, "
           "the default of requests that do not choose",
           [](auto& l) -> auto& { return l.think; }),
    flag("--quiet", Use::kAny, Agree::kOwn, "do not print the per-rank profile table",
         [](auto& l) -> auto& { return l.quiet; }),
    flag("--summary", Use::kOffline, Agree::kOwn,
         "print a short summary (cluster, experts per rank, speed, sampling) instead of the "
         "memory lines and the per-rank profile table",
         [](auto& l) -> auto& { return l.summary; }),
    option("--ngen", "", Use::kOffline, Agree::kCoordinator, "number of tokens to generate",
           [](auto& l) -> auto& { return l.ngen; }, in_range(0, 1 << 20)),
    option("--temp", "", Use::kOffline, Agree::kCoordinator, "sampling temperature; 0 = greedy",
           [](auto& l) -> auto& { return l.temperature; }),
    option("--top-p", "", Use::kOffline, Agree::kCoordinator, "nucleus sampling mass in (0, 1]",
           [](auto& l) -> auto& { return l.top_p; }),
    compared_as(option("--seed", "", Use::kOffline, Agree::kCoordinator,
                       "random seed for sampling, in [0, 2^64)",
                       [](auto& l) -> auto& { return l.seed_text; }),
                [](const CommandLine& l) { return std::to_string(l.seed); }),
    flag("--ignore-eos", Use::kOffline, Agree::kCoordinator,
         "keep generating after an end-of-sequence token",
         [](auto& l) -> auto& { return l.ignore_eos; }),
    option("--output", "", Use::kOffline, Agree::kCoordinator,
           "write what the run prints on stdout (the text or ids, --sequences' lines, --score's "
           "table) to this file instead, once the run ends, atomically; a failed write is an "
           "error, where mpirun's forwarding of stdout loses it",
           [](auto& l) -> auto& { return l.output; }),
    option("--logits-out", "", Use::kOffline, Agree::kCoordinator,
           "write the logits of every position (prompt and generated) as float32 .npy "
           "[positions, vocab]",
           [](auto& l) -> auto& { return l.logits_out; }),
    compared_as(option("--layout", "derived", Use::kAny, Agree::kJob,
                       "layout file: rank -> role, GPU, NUMA node, budgets (default: rank 0 "
                       "coordinates, the others are expert ranks)",
                       [](auto& l) -> auto& { return l.layout; }),
                layout_identity),
    option("--placement", "", Use::kAny, Agree::kJob,
           "expert placement policy: balanced, round-robin, contiguous, hosts (contiguous expert "
           "groups per host, in proportion to the hosts' budgets), sliced (every owner holds a "
           "slice of every expert's intermediate rows, in proportion to its budget), heat (the "
           "hottest experts of the routing statistics on the fastest tiers, every layer's "
           "expected routes even across ranks)",
           [](auto& l) -> auto& { return l.placement; }),
    option("--replicas", "", Use::kAny, Agree::kJob,
           "with --placement heat: extra copies of the hottest experts per MoE layer, each on "
           "another rank; the coordinator sends a routed row to the least-loaded copy",
           [](auto& l) -> auto& { return l.node.replicas; }, in_range(0, 1 << 20)),
    option("--repin-every", "", Use::kAny, Agree::kCoordinator,
           "with --placement heat: every this many routed tokens, re-place the MoE layers whose "
           "recent routing drifted from their placement's heat, moving experts between ranks "
           "while the job runs; 0 = never",
           [](auto& l) -> auto& { return l.node.repin_every; }, in_range(0, 1 << 30)),
    option("--repin-max-moves", "", Use::kAny, Agree::kCoordinator,
           "with --repin-every: (layer, expert) holder changes per round at most",
           [](auto& l) -> auto& { return l.node.repin_max_moves; }, in_range(1, 1 << 24)),
    flag("--prefetch-ahead", Use::kAny, Agree::kCoordinator,
         "at each MoE layer, predict the next MoE layer's experts with its router on this "
         "layer's rows and hint their owners, whose disk tiers start reading them a layer early; "
         "never changes a result",
         [](auto& l) -> auto& { return l.node.prefetch_ahead; }),
    option("--routing-stats", "auto", Use::kAny, Agree::kCoordinator,
           "routing statistics file: read at start-up (--placement heat), this run's routes "
           "merged into it at shutdown; auto: colibri-routing.stats in the model directory when "
           "writable, else under $XDG_STATE_HOME/colibri-node; off: none",
           [](auto& l) -> auto& { return l.routing_stats; }),
    flag("--print-placement", Use::kAny, Agree::kOwn,
         "print the expert placement table at start-up",
         [](auto& l) -> auto& { return l.print_placement; }),
    option("--rank-timeout", "", Use::kAny, Agree::kOwn,
           "seconds the coordinator waits for an expert rank within one exchange before aborting",
           [](auto& l) -> auto& { return l.node.rank_timeout_s; }),
    option("--startup-timeout", "", Use::kAny, Agree::kOwn,
           "seconds each rank waits for the others at every start-up step (argument checks, "
           "handshake, weights loaded) before naming the missing rank and aborting",
           [](auto& l) -> auto& { return l.node.startup_timeout_s; }),
    option("--max-rows", "", Use::kAny, Agree::kJob,
           "rows per forward call (prefill chunk); sizes the exchange buffers",
           [](auto& l) -> auto& { return l.node.max_rows; }, in_range(1, 1 << 16)),
    // The expert ranks keep a copy of the compressed cache the pool's size with --split-linears.
    job_with_split_linears(compared_as(
        option("--kv-tokens", "context, at most 32768", Use::kAny, Agree::kCoordinator,
               "KV cache pool in tokens, shared by all sequences (default: the model's context, "
               "at most 32768)",
               [](auto& l) -> auto& { return l.node.kv_tokens; }, in_range(1, 1 << 30)),
        [](const CommandLine& l) {
          return l.node.kv_tokens > 0 ? std::to_string(l.node.kv_tokens)
                                      : std::string("(the model's context)");
        })),
    option("--sequences", "", Use::kOffline, Agree::kCoordinator,
           "generate this many copies of the prompt at once, decoded together in one batch "
           "(seeds --seed, --seed + 1, ...); each is printed when done",
           [](auto& l) -> auto& { return l.sequences; }, in_range(1, 4096)),
    option("--max-seqs", "--sequences; 32 with --serve", Use::kAny, Agree::kCoordinator,
           "sequences holding KV blocks at once (default: --sequences, 32 with --serve); the "
           "rest wait",
           [](auto& l) -> auto& { return l.node.max_seqs; }, in_range(1, 4096)),
    option("--activations", "", Use::kAny, Agree::kJob,
           "activations of the products with int4/int8 weights: int8 (quantized per 64 inputs, "
           "integer dot products), f32, or mixed (int8 for int4 weights, f32 for int8 weights)",
           [](auto& l) -> auto& { return l.activations; }),
    option("--wire", "", Use::kAny, Agree::kJob,
           "element type of rows and partials between ranks: f32 or bf16 (halves the bytes)",
           [](auto& l) -> auto& { return l.wire; }),
    option("--combine", "", Use::kAny, Agree::kJob,
           "star: every expert rank replies to the coordinator; host: the expert ranks of each "
           "host sum their partials at the lowest of them, which replies once for the host "
           "(fewer bytes across hosts)",
           [](auto& l) -> auto& { return l.combine; }, one_of({"star", "host"})),
    flag("--split-linears", Use::kAny, Agree::kJob,
         "split the coordinator's attention projections, dense MLPs and lm_head by output rows, "
         "and its attention by heads, across it and the cpu-expert ranks, which compute theirs "
         "while they wait for routed-expert requests (every output keeps the bits of one "
         "process's; each such rank keeps a copy of the compressed KV cache)",
         [](auto& l) -> auto& { return l.split_linears; }),
    option("--shared-memory", "", Use::kAny, Agree::kJob,
           "on: the expert ranks on the coordinator's host that reply to it share a memory "
           "segment with it, where rows and partials are written (no copy through MPI); off: "
           "every row goes in MPI messages",
           [](auto& l) -> auto& { return l.shared_memory; }, one_of({"on", "off"})),
    option("--transport", "", Use::kAny, Agree::kJob,
           "between the coordinator and the gpu-expert ranks: mpi, nccl (the coordinator needs a "
           "gpu in --layout; cpu-expert ranks stay on MPI) or auto (nccl when built with NCCL "
           "and every GPU rank sees a device, else mpi)",
           [](auto& l) -> auto& { return l.transport; }, one_of({"auto", "mpi", "nccl"})),
    option("--experts", "", Use::kAny, Agree::kJob,
           "where a single process computes its routed experts: cpu, or gpu (CUDA device 0, "
           "experts in VRAM up to --vram-gb; under mpirun use gpu-expert ranks in --layout)",
           [](auto& l) -> auto& { return l.experts; }, one_of({"cpu", "gpu"})),
    flag("--coordinator-gpu", Use::kAny, Agree::kOwn,
         "a single process runs the coordinator's forward (attention, router, shared experts, "
         "dense layers, lm_head) on CUDA device 0; under mpirun, give the coordinator's layout "
         "row a gpu",
         [](auto& l) -> auto& { return l.coordinator_gpu; }),
    option("--ram-gb", "", Use::kAny, Agree::kOwn,
           "GiB of RAM per expert rank for routed experts, the rest read from disk on demand; 0 "
           "= all resident (the layout's ram_gb column overrides it per rank)",
           [](auto& l) -> auto& { return l.node.ram_gb; }),
    option("--pin-gb", "", Use::kAny, Agree::kOwn,
           "GiB of routed experts per expert rank pinned in RAM at start (with --ram-gb)",
           [](auto& l) -> auto& { return l.node.pin_gb; }),
    option("--vram-gb", "", Use::kGpu, Agree::kOwn,
           "GiB of VRAM per gpu-expert rank for its routed experts, a cache over RAM/disk when "
           "they do not all fit; 0 = the device's free memory (the layout's vram_gb column "
           "overrides it per rank)",
           [](auto& l) -> auto& { return l.node.vram_gb; }),
    option("--pcie-gbps", "", Use::kGpu, Agree::kOwn,
           "host-to-device GB/s the VRAM tier's miss rule assumes (upload a missed expert when "
           "that is no slower than the CPU; bench/gpu_expert_bench measures it)",
           [](auto& l) -> auto& { return l.node.pcie_gbps; }),
    option("--cpu-expert-gbps", "", Use::kGpu, Agree::kOwn,
           "GB/s of expert weights a GPU rank's CPU threads compute through, for the VRAM tier's "
           "miss rule",
           [](auto& l) -> auto& { return l.node.cpu_expert_gbps; }),
    option("--profile-json", "", Use::kAny, Agree::kCoordinator,
           "write the per-rank profile as JSON",
           [](auto& l) -> auto& { return l.profile_json; }),
    option("--trace", "", Use::kAny, Agree::kCoordinator,
           "write a Chrome/Perfetto trace-event JSON, one process per rank",
           [](auto& l) -> auto& { return l.trace; }),
    flag("--serve", Use::kAny, Agree::kCoordinator,
         "serve an OpenAI-compatible HTTP API (continuous batching) on the coordinator until "
         "SIGINT/SIGTERM",
         [](auto& l) -> auto& { return l.serve; }),
    option("--host", "", Use::kServe, Agree::kOwn, "--serve: address to bind",
           [](auto& l) -> auto& { return l.host; }),
    option("--port", "", Use::kServe, Agree::kOwn, "--serve: TCP port (0: any free port, printed)",
           [](auto& l) -> auto& { return l.port; }),
    option("--api-key", "$COLIBRI_API_KEY", Use::kServe, Agree::kOwn,
           "--serve: require 'Authorization: Bearer KEY' on every route but /health (default: "
           "$COLIBRI_API_KEY)",
           [](auto& l) -> auto& { return l.api_key; }),
    option("--max-batch-tokens", "--max-rows", Use::kServe, Agree::kOwn,
           "--serve: rows per forward call, decode rows plus prompt chunks (default: --max-rows)",
           [](auto& l) -> auto& { return l.max_batch_tokens; }, in_range(1, 1 << 16)),
    option("--max-queue", "", Use::kServe, Agree::kOwn,
           "--serve: waiting requests; more are answered 429 with Retry-After",
           [](auto& l) -> auto& { return l.max_queue; }),
    option("--max-body-mb", "", Use::kServe, Agree::kOwn,
           "--serve: largest request body in MiB (413)",
           [](auto& l) -> auto& { return l.max_body_mb; }),
    option("--max-connections", "", Use::kServe, Agree::kOwn,
           "--serve: open connections in all; more are answered 503 and closed",
           [](auto& l) -> auto& { return l.max_connections; }, in_range(1, 1 << 16)),
    option("--max-client-connections", "", Use::kServe, Agree::kOwn,
           "--serve: open connections from one client address; more are answered 503 and closed",
           [](auto& l) -> auto& { return l.max_client_connections; }, in_range(1, 1 << 16)),
    option("--request-timeout", "", Use::kServe, Agree::kOwn,
           "--serve: seconds for a request's line, headers and body to arrive whole (408)",
           [](auto& l) -> auto& { return l.request_timeout; }),
    flag("--no-prefix-cache", Use::kServe, Agree::kOwn,
         "--serve: do not keep finished sequences' KV blocks for prompts that continue them",
         [](auto& l) -> auto& { return l.no_prefix_cache; }),
  };
  // clang-format on
  for (FlagRow& row : rows) {
    if (row.shown_default.empty()) {
      row.shown_default = row.value(CommandLine{});
      if (row.shown_default.empty()) row.shown_default = "none";
    }
  }
  return rows;
}

// ---- checks -------------------------------------------------------------------------------------

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
  if (!line.kv_file.empty() && (line.node.split_linears || line.node.coordinator_gpu))
    fail("--kv-file keeps the coordinator's CPU KV cache; it cannot be used with {}",
         line.node.split_linears ? "--split-linears" : "--coordinator-gpu");
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
  for (const char* name :
       {"COLIBRI_VNNI", "COLIBRI_TILES", "COLIBRI_BF16_PAIRS", "COLIBRI_SPLIT_HEADS"}) {
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

const std::vector<FlagRow>& flag_table() {
  static const std::vector<FlagRow> table = make_table();
  return table;
}

void add_flags(CLI::App& app, CommandLine& line) {
  for (const FlagRow& row : flag_table()) row.add(app, line);
  // What a run generates from: at most one of these.
  const char* sources[] = {"--prompt", "--prompt-ids", "--chat", "--score"};
  for (size_t i = 0; i < std::size(sources); ++i)
    for (size_t j = i + 1; j < std::size(sources); ++j)
      app.get_option(sources[i])->excludes(app.get_option(sources[j]));
  for (const char* source : {"--chat", "--score"})
    app.get_option("--sequences")->excludes(app.get_option(source));
}

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

std::vector<AgreedSetting> agreed_settings(const CLI::App& app, const CommandLine& line) {
  std::vector<AgreedSetting> settings;
  for (const FlagRow& row : flag_table()) {
    Agree agreement = row.agreement;
    if (row.job_with_split_linears && line.split_linears) agreement = Agree::kJob;
    if (agreement == Agree::kOwn) continue;
    settings.push_back(
        {row.name, row.value(line), given(app, row.name),
         agreement == Agree::kJob ? AgreedSetting::kJob : AgreedSetting::kCoordinator});
  }
  return settings;
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
