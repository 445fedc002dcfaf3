// colibri-node's command line as one table of flags. A row gives a flag's help, its default as the
// README's flag tables show it, the runs it applies to and how the ranks compare it at the
// handshake; the CLI11 options, the handshake's settings, the refusal of a flag given for a run it
// does not apply to, and the README check (tests/unit/flag_table_test.cpp) all come from it.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "node/handshake.h"
#include "node/node.h"

namespace colibri {

// What the flags set. The node's own options are set in place; the rest is the run's.
struct CommandLine {
  NodeOptions node;
  std::string placement = "balanced";
  std::string routing_stats = "auto";  // --routing-stats (NodeOptions::routing_stats, "off" = "")
  std::string layout;
  std::string prompt, prompt_ids, score_file, think, logits_out, profile_json, trace, output;
  bool chat = false, chat_format = false;
  std::string wire = "f32";
  std::string combine = "star";
  std::string shared_memory = "on";
  std::string transport = "auto";
  std::string activations = "int8";
  std::string experts = "cpu";
  bool coordinator_gpu = false;
  bool split_linears = false;
  int ngen = 16;
  int sequences = 1;
  float temperature = 0.0f, top_p = 1.0f;
  std::string seed_text = "0";
  uint64_t seed = 0;  // parsed from seed_text
  bool ignore_eos = false, print_placement = false, quiet = false, summary = false;
  std::string kv_file;  // --kv-file
  // --serve
  bool serve = false, no_prefix_cache = false;
  std::string host = "127.0.0.1", api_key;
  int port = 8080, max_batch_tokens = 0, max_queue = 64;
  double max_itl_ms = 0;  // --max-itl-ms; 0: off
  double max_body_mb = 1;
  int max_connections = 1024, max_client_connections = 256;
  double request_timeout = 30;
  std::string kv_cache_dir;     // --kv-cache-dir
  double kv_cache_dir_gb = 20;  // --kv-cache-dir-gb; 0: no cap
};

constexpr const char* kDefaultPrompt = "And God said,";
constexpr int kServeDefaultMaxSeqs = 32;

// The runs a flag applies to; given for another, it is refused (it would be ignored).
enum class FlagUse {
  kAny,
  kOffline,  // generates from the command line: not with --serve
  kServe,    // with --serve only
  kGpu,      // a run with a GPU: --experts gpu, --coordinator-gpu, or a gpu in --layout
};

// How the ranks compare a flag at the handshake (AgreedSetting's scopes), or not at all.
enum class FlagAgreement {
  kOwn,          // each rank's own (budgets, timeouts, outputs of its own)
  kJob,          // every rank's value must be the same
  kCoordinator,  // the coordinator's: a rank given it must be given the coordinator's value
};

struct FlagRow {
  std::string name;           // "--temp"
  std::string help;           // CLI11's --help text
  std::string shown_default;  // as the README's table shows it: "0", "off", "none", "`auto`"
  FlagUse use = FlagUse::kAny;
  FlagAgreement agreement = FlagAgreement::kOwn;
  bool job_with_split_linears = false;  // kJob instead of `agreement` with --split-linears
  std::function<CLI::Option*(CLI::App&, CommandLine&)> add;  // registers the CLI11 option
  std::function<std::string(const CommandLine&)> value;      // as the handshake compares it
};

// Every flag, in --help order.
const std::vector<FlagRow>& flag_table();

// Registers every flag of the table on `app`, bound to `line`.
void add_flags(CLI::App& app, CommandLine& line);

// This rank's checks of its parsed command line before any work: numbers and flag combinations,
// flags that do not apply to this run, the environment's knobs, the --model directory and, on the
// coordinator, the files it reads and writes. Fills line.node (settings included).
void check_command_line(const CLI::App& app, CommandLine& line, int rank, int world_size);

// The settings the ranks compare at the handshake, from the table.
std::vector<AgreedSetting> agreed_settings(const CLI::App& app, const CommandLine& line);

// Prompt ids "1,2,3", each in [0, 2^30]; an error names the item that is not one.
std::vector<int> parse_ids(const std::string& text);

// Refuses a generation of `ngen` tokens after `prompt_tokens` that needs more positions than the
// model's context (the last sampled token is fed back only when its logits are kept).
void check_context(const ModelConfig& config, size_t prompt_tokens, int ngen, bool keep_logits);

}  // namespace colibri
