#include "node/command_line.h"

#include <fmt/format.h>

#include <filesystem>
#include <type_traits>
#include <utility>

#include "common/error.h"
#include "common/input_file.h"

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

// What a run generates and prints: the model, the prompt or mode, sampling, outputs.
std::vector<FlagRow> generation_rows() {
  // clang-format off
  return {
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
  };
  // clang-format on
}

// Where the experts go and how long ranks wait for each other.
std::vector<FlagRow> placement_rows() {
  // clang-format off
  return {
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
  };
  // clang-format on
}

// Rows, sequences and the KV pool; activations, the exchange, the split linears, GPUs.
std::vector<FlagRow> compute_rows() {
  // clang-format off
  return {
    option("--max-rows", "", Use::kAny, Agree::kJob,
           "rows per forward call (prefill chunk); sizes the exchange buffers",
           [](auto& l) -> auto& { return l.node.max_rows; }, in_range(1, 1 << 16)),
    option("--micro-batches", "", Use::kAny, Agree::kCoordinator,
           "2: a forward call of at least --micro-batch-rows rows runs as two micro-batches in "
           "flight, one's attention and shared expert while the other's routed experts are on "
           "the expert ranks, with the bits of the whole call (MPI and in-process experts; "
           "others run whole); 1: whole",
           [](auto& l) -> auto& { return l.node.micro_batches; }, in_range(1, 2)),
    option("--micro-batch-rows", "", Use::kAny, Agree::kCoordinator,
           "with --micro-batches 2: the fewest rows a call splits at",
           [](auto& l) -> auto& { return l.node.micro_batch_rows; }, in_range(4, 1 << 16)),
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
           "activations of the products with int4/int8/NVFP4 weights: int8 (quantized per 64 "
           "inputs, integer dot products), f32, or mixed (int8 for 4-bit weights, f32 for int8 "
           "weights)",
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
  };
  // clang-format on
}

// The tiers' budgets and the VRAM tier's rule; the profile's files.
std::vector<FlagRow> tier_and_profile_rows() {
  // clang-format off
  return {
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
  };
  // clang-format on
}

// --serve and its server's settings.
std::vector<FlagRow> serve_rows() {
  // clang-format off
  return {
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
    option("--max-itl-ms", "", Use::kServe, Agree::kOwn,
           "--serve: while a sequence decodes, cut each forward call's prompt rows so that its "
           "predicted time (a cost model fitted to the calls timed) stays within this many ms, "
           "at least --max-batch-tokens / 16 rows; with no sequence decoding a prompt takes "
           "every row (0: off)",
           [](auto& l) -> auto& { return l.max_itl_ms; },
           [](CLI::Option& o) { o.check(CLI::Range(0.0, 1e6)); }),
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
    option("--kv-cache-dir", "", Use::kServe, Agree::kCoordinator,
           "--serve: keep finished sequences' KV cache in this directory (a folder per model, a "
           "crash-safe file per new prefix) and load a prompt's longest prefix found there "
           "instead of computing it, across restarts",
           [](auto& l) -> auto& { return l.kv_cache_dir; }),
    option("--kv-cache-dir-gb", "", Use::kServe, Agree::kCoordinator,
           "--serve: GB of --kv-cache-dir's files for this model; the least recently used go "
           "beyond it (0: no cap)",
           [](auto& l) -> auto& { return l.kv_cache_dir_gb; },
           [](CLI::Option& o) { o.check(CLI::Range(0.0, 1e6)); }),
  };
  // clang-format on
}

// Every flag in --help order, each with the default the README shows.
std::vector<FlagRow> make_table() {
  std::vector<FlagRow> rows;
  for (std::vector<FlagRow> (*group)() :
       {generation_rows, placement_rows, compute_rows, tier_and_profile_rows, serve_rows})
    for (FlagRow& row : group()) rows.push_back(std::move(row));
  for (FlagRow& row : rows) {
    if (row.shown_default.empty()) {
      row.shown_default = row.value(CommandLine{});
      if (row.shown_default.empty()) row.shown_default = "none";
    }
  }
  return rows;
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

std::vector<AgreedSetting> agreed_settings(const CLI::App& app, const CommandLine& line) {
  std::vector<AgreedSetting> settings;
  for (const FlagRow& row : flag_table()) {
    Agree agreement = row.agreement;
    if (row.job_with_split_linears && line.split_linears) agreement = Agree::kJob;
    if (agreement == Agree::kOwn) continue;
    settings.push_back(
        {row.name, row.value(line), app.count(row.name) > 0,
         agreement == Agree::kJob ? AgreedSetting::kJob : AgreedSetting::kCoordinator});
  }
  return settings;
}

}  // namespace colibri
