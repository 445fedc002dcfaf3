// colibri-node: run a Mixture-of-Experts model from a Hugging Face directory, alone or as one
// rank of `mpirun -np N colibri-node`.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#ifdef COLIBRI_HAVE_SERVE
#include "coordinator/http_server.h"
#endif
#include "common/error.h"
#include "common/input_file.h"
#include "common/layout.h"
#include "common/npy.h"
#include "common/output_file.h"
#include "coordinator/batch_generate.h"
#include "coordinator/chat.h"
#include "cpu/quant.h"
#include "model/generate.h"
#include "model/score.h"
#include "node/node.h"
#include "tokenizer/tokenizer.h"
#include "transport/mpi_check.h"

namespace {

using colibri::fail;

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

struct Args {
  colibri::NodeOptions node;
  std::string placement = "balanced";
  std::string layout;
  std::string prompt, prompt_ids, score_file, think, logits_out, profile_json, trace;
  bool chat = false, chat_format = false, prompt_given = false;
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
  uint64_t seed = 0;
  bool ignore_eos = false, print_placement = false, quiet = false;
  // --serve
  bool serve = false, no_prefix_cache = false;
  std::string host = "127.0.0.1", api_key;
  int port = 8080, max_batch_tokens = 0, max_queue = 64;
  double max_body_mb = 1;
};

constexpr int kServeDefaultMaxSeqs = 32;

constexpr const char* kDefaultPrompt = "And God said,";

// Prints generated tokens as text as they arrive; special tokens are not printed.
class TextStream {
 public:
  explicit TextStream(const colibri::Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  void operator()(int token) const {
    const int one[] = {token};
    const std::string bytes = tokenizer_.decode_bytes(one, /*skip_special=*/true);
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    colibri::flush_stdout_or_fail();
  }

 private:
  const colibri::Tokenizer& tokenizer_;
};

colibri::Tokenizer load_tokenizer(const std::filesystem::path& model_dir) {
  const auto path = model_dir / "tokenizer.json";
  if (!colibri::path_present(path, "the tokenizer"))
    fail(
        "{}: missing; text prompts, --chat and --score need the model's tokenizer (use "
        "--prompt-ids)",
        path.string());
  return colibri::Tokenizer::load(path);
}

colibri::Thinking parse_thinking(const std::string& think) {
  if (think.empty()) return colibri::Thinking::kUnset;
  if (think == "on") return colibri::Thinking::kOn;
  if (think == "off") return colibri::Thinking::kOff;
  fail("--think '{}' must be on or off", think);
}

// ---- start-up checks: every rank checks its own arguments before any work -----------------

constexpr double kMaxRankTimeoutSeconds = 7 * 24 * 3600.0;

uint64_t parse_seed(const std::string& text) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || text[0] == '-' || text[0] == '+' || ec != std::errc() || ptr != end)
    fail("--seed '{}' must be an integer in [0, 18446744073709551615]", text);
  return value;
}

// Numbers and flag combinations that CLI11 does not check, refused rather than wrapped, clamped
// or silently ignored.
void validate_args(Args& args) {
  const colibri::NodeOptions& node = args.node;
  for (const auto& [flag, seconds] : {std::pair{"--rank-timeout", node.rank_timeout_s},
                                      {"--startup-timeout", node.startup_timeout_s}})
    if (!std::isfinite(seconds) || seconds <= 0 || seconds > kMaxRankTimeoutSeconds)
      fail("{} {} must be a number of seconds in (0, {}]", flag, seconds, kMaxRankTimeoutSeconds);
  for (const auto& [flag, gib] :
       {std::pair{"--ram-gb", node.ram_gb}, {"--pin-gb", node.pin_gb}, {"--vram-gb", node.vram_gb}})
    if (!std::isfinite(gib) || gib < 0 || gib > colibri::kMaxBudgetGib)
      fail("{} {} must be a number of GiB in [0, {}]", flag, gib, colibri::kMaxBudgetGib);
  for (const auto& [flag, gbps] :
       {std::pair{"--pcie-gbps", node.pcie_gbps}, {"--cpu-expert-gbps", node.cpu_expert_gbps}})
    if (!std::isfinite(gbps) || gbps <= 0 || gbps > 1e4)
      fail("{} {} must be a rate in GB/s in (0, 10000]", flag, gbps);
  if (node.pin_gb > 0 && node.ram_gb > 0 && node.pin_gb > node.ram_gb)
    fail("--pin-gb {} is larger than --ram-gb {}: pinned experts are part of the RAM budget",
         node.pin_gb, node.ram_gb);
  if (node.pin_gb > 0 && node.ram_gb == 0 && args.layout.empty())
    fail("--pin-gb {} needs --ram-gb (without a RAM budget every owned expert is resident)",
         node.pin_gb);
  if (!std::isfinite(args.temperature) || args.temperature < 0)
    fail("--temp {} must be a finite number >= 0", args.temperature);
  if (!(args.top_p > 0 && args.top_p <= 1)) fail("--top-p {} must be in (0, 1]", args.top_p);
  args.seed = parse_seed(args.seed_text);
  if (args.prompt_given && args.prompt.empty())
    fail("--prompt is empty (leave it out for the default prompt \"{}\")", kDefaultPrompt);
  if (!args.think.empty() && !args.chat && !args.chat_format)
    fail("--think {} needs --chat or --chat-format", args.think);
  if (args.chat_format && !args.prompt_ids.empty())
    fail("--chat-format wraps a text prompt; it cannot be used with --prompt-ids");
  if (args.chat_format && !args.score_file.empty())
    fail("--chat-format cannot be used with --score");
  if (args.serve) {
    if (args.prompt_given || !args.prompt_ids.empty() || args.chat || args.chat_format ||
        !args.score_file.empty() || !args.logits_out.empty() || args.sequences != 1)
      fail(
          "--serve takes its prompts from HTTP requests: it cannot be used with --prompt, "
          "--prompt-ids, --chat, --chat-format, --score, --logits-out or --sequences");
    if (args.port < 0 || args.port > 65535) fail("--port {} must be in [0, 65535]", args.port);
    if (args.max_queue < 1) fail("--max-queue {} must be at least 1", args.max_queue);
    if (!std::isfinite(args.max_body_mb) || args.max_body_mb <= 0 || args.max_body_mb > 1024)
      fail("--max-body-mb {} must be in (0, 1024]", args.max_body_mb);
    if (args.api_key.empty())
      if (const char* key = std::getenv("COLIBRI_API_KEY")) args.api_key = key;
  }
  if (!args.logits_out.empty() && (args.chat || !args.score_file.empty()))
    fail("--logits-out is written for one generation; it cannot be used with {}",
         args.chat ? "--chat" : "--score");
}

// The rank that will coordinate: rank 0, unless a readable layout names another (a layout that
// cannot be read is refused later, at the handshake).
int expected_coordinator(const Args& args, int world_size) {
  if (args.layout.empty()) return 0;
  try {
    return colibri::load_layout(args.layout, world_size).coordinator();
  } catch (const colibri::Error&) {
    return 0;
  }
}

// Checked on the coordinator, the rank that reads and writes these files, before any work:
// output paths (never a device, directory or FIFO; two flags never name one file) and --score.
void check_coordinator_files(const Args& args) {
  std::vector<std::pair<const char*, std::filesystem::path>> outputs;
  for (const auto& [flag, path] : {std::pair{"--logits-out", &args.logits_out},
                                   {"--profile-json", &args.profile_json},
                                   {"--trace", &args.trace}}) {
    if (path->empty()) continue;
    colibri::check_output_path(*path, flag);
    std::error_code ec;
    const std::filesystem::path resolved = std::filesystem::weakly_canonical(*path, ec);
    for (const auto& [other_flag, other] : outputs)
      if (!ec && resolved == other) fail("{} {}: the same file as {}", flag, *path, other_flag);
    outputs.emplace_back(flag, resolved);
  }
  if (!args.score_file.empty()) colibri::check_regular_file(args.score_file, "the --score file");
}

// Positions a generation of `ngen` tokens after `prompt_tokens` uses: the last sampled token is
// fed back only when its logits are kept.
void check_context(const colibri::ModelConfig& config, size_t prompt_tokens, int ngen,
                   bool keep_logits) {
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

// The settings the ranks compare at the handshake. Job-wide ones size or shape the exchange and
// the placement; the others only the coordinator uses, and a rank given one must be given the
// coordinator's value (else it would be silently ignored).
std::vector<colibri::AgreedSetting> agreed_settings(const CLI::App& app, const Args& args) {
  using Setting = colibri::AgreedSetting;
  std::vector<Setting> settings;
  const auto add = [&](const char* flag, std::string value, Setting::Scope scope) {
    settings.push_back({flag, std::move(value), app.count(flag) > 0, scope});
  };
  const auto on_off = [](bool on) { return std::string(on ? "on" : "off"); };
  std::string layout = "(none)";
  if (!args.layout.empty()) {  // compared by content: paths may differ between hosts
    uint64_t hash = 14695981039346656037ull;
    for (char c : colibri::read_regular_file(args.layout, "the layout file"))
      hash = (hash ^ uint8_t(c)) * 1099511628211ull;
    layout = fmt::format("a file with content hash {:016x}", hash);
  }
  add("--max-rows", std::to_string(args.node.max_rows), Setting::kJob);
  add("--experts", args.experts, Setting::kJob);
  add("--wire", args.wire, Setting::kJob);
  add("--combine", args.combine, Setting::kJob);
  add("--split-linears", on_off(args.split_linears), Setting::kJob);
  add("--shared-memory", args.shared_memory, Setting::kJob);
  add("--transport", args.transport, Setting::kJob);
  add("--activations", args.activations, Setting::kJob);
  add("--placement", args.placement, Setting::kJob);
  add("--layout", layout, Setting::kJob);
  add("--prompt", args.prompt, Setting::kCoordinator);
  add("--prompt-ids", args.prompt_ids, Setting::kCoordinator);
  add("--chat", on_off(args.chat), Setting::kCoordinator);
  add("--chat-format", on_off(args.chat_format), Setting::kCoordinator);
  add("--think", args.think, Setting::kCoordinator);
  add("--score", args.score_file, Setting::kCoordinator);
  add("--ngen", std::to_string(args.ngen), Setting::kCoordinator);
  add("--temp", fmt::format("{}", args.temperature), Setting::kCoordinator);
  add("--top-p", fmt::format("{}", args.top_p), Setting::kCoordinator);
  add("--seed", std::to_string(args.seed), Setting::kCoordinator);
  add("--ignore-eos", on_off(args.ignore_eos), Setting::kCoordinator);
  add("--sequences", std::to_string(args.sequences), Setting::kCoordinator);
  add("--max-seqs", std::to_string(args.node.max_seqs), Setting::kCoordinator);
  // With --split-linears the expert ranks keep a copy of the compressed cache the pool's size.
  add("--kv-tokens",
      args.node.kv_tokens > 0 ? std::to_string(args.node.kv_tokens) : "(the model's context)",
      args.split_linears ? Setting::kJob : Setting::kCoordinator);
  add("--logits-out", args.logits_out, Setting::kCoordinator);
  add("--profile-json", args.profile_json, Setting::kCoordinator);
  add("--trace", args.trace, Setting::kCoordinator);
  return settings;
}

// This rank's own checks before any work: numbers and flag combinations, the --model directory,
// and on the coordinator the files it reads and writes.
void check_own_arguments(const CLI::App& app, Args& args, int rank, int size) {
  validate_args(args);
  colibri::check_readable_directory(args.node.model_dir, "the --model directory");
  if (rank == expected_coordinator(args, size)) {
    check_coordinator_files(args);
    if (!args.prompt_ids.empty())  // before the weights load; text prompts once tokenized
      check_context(colibri::load_model_config(args.node.model_dir),
                    parse_ids(args.prompt_ids).size(), args.ngen, !args.logits_out.empty());
  }
  if (!args.layout.empty()) args.node.layout_file = args.layout;
  args.node.placement = colibri::parse_placement_policy(args.placement);
  args.node.keep_trace = !args.trace.empty();
  args.node.wire_type = colibri::parse_elem_type(args.wire, "--wire");
  args.node.host_combine = args.combine == "host";
  args.node.shared_memory = args.shared_memory == "on";
  args.node.transport = colibri::parse_transport(args.transport, "--transport");
  args.node.gpu_experts = args.experts == "gpu";
  args.node.coordinator_gpu = args.coordinator_gpu;
  args.node.split_linears = args.split_linears;
  if (app.count("--max-seqs") == 0)
    args.node.max_seqs = args.serve ? kServeDefaultMaxSeqs : args.sequences;
  // The flag, else COLIBRI_ACTIVATIONS, else int8: with the int8 kernels reading the weights in
  // tiles, one sequence decodes faster with int8 activations than with fp32 on AVX-512 VNNI too
  // (bench/RESULTS.md: 1.3x at one thread, 1.4-1.6x at two on the peer model), and their cost
  // grows little with the rows.
  try {
    if (app.count("--activations") > 0)
      colibri::kernels::set_quant_activations(
          colibri::kernels::quant_activations_resolve(args.activations.c_str()));
    else
      colibri::kernels::set_quant_activations(
          colibri::kernels::quant_activations_resolve(std::getenv("COLIBRI_ACTIVATIONS")));
    args.activations =
        colibri::kernels::quant_activations_name(colibri::kernels::quant_activations_selected());
  } catch (const std::invalid_argument& e) {
    fail("--activations: {}", e.what());
  }
  if (args.serve) {
#ifndef COLIBRI_HAVE_SERVE
    fail(
        "--serve: this colibri-node was built without cpp-httplib (apt-get install "
        "libcpp-httplib-dev, then reconfigure)");
#endif
    if (args.max_batch_tokens == 0) args.max_batch_tokens = args.node.max_rows;
    if (args.max_batch_tokens > args.node.max_rows)
      fail("--max-batch-tokens {} exceeds --max-rows {}", args.max_batch_tokens,
           args.node.max_rows);
    if (args.max_batch_tokens <= args.node.max_seqs)
      fail(
          "--max-batch-tokens {} must exceed --max-seqs {}: every running sequence takes a "
          "decode row per step and prompts need room too",
          args.max_batch_tokens, args.node.max_seqs);
  }
  if (args.node.max_seqs > args.node.max_rows)
    fail("--max-seqs {} exceeds --max-rows {}: every running sequence needs a row per step",
         args.node.max_seqs, args.node.max_rows);
  if (args.sequences > 1 && !args.logits_out.empty())
    fail("--logits-out keeps the logits of one sequence; it cannot be used with --sequences");
  args.node.settings = agreed_settings(app, args);
}

// Prints why this rank stops: the help text on stdout, or one error line, naming the rank when it
// found the error itself in a job ("[rank r@host] error: ..."), else "colibri-node: error: ...".
void report_stop(const colibri::StartupStatus& status, bool name_rank) {
  if (!status.is_error) {
    std::fputs(status.message.c_str(), stdout);
    std::fflush(stdout);
    return;
  }
  const colibri::RankIdentity& me = colibri::rank_identity();
  const std::string message = colibri::one_line(status.message);
  if (name_rank)
    std::fprintf(stderr, "[rank %d@%s] error: %s\n", me.rank, me.host.c_str(), message.c_str());
  else
    std::fprintf(stderr, "colibri-node: error: %s\n", message.c_str());
  std::fflush(stderr);
}

// Interactive chat on stdin/stdout; the KV cache keeps the whole conversation.
void run_chat(colibri::Node& node, const Args& args, const colibri::Tokenizer& tokenizer,
              colibri::GenerateRequest request) {
  const colibri::ChatFormat format = colibri::chat_format_for(node.config());
  request.stop_ids = colibri::chat_stop_ids(format, node.config(), tokenizer);
  colibri::Engine& engine = node.engine();
  const int seq = engine.open_sequence();
  const colibri::ForwardFn forward = colibri::sequence_forward(engine, seq);
  std::vector<colibri::ChatMessage> messages;
  const TextStream stream(tokenizer);
  std::string line;
  for (;;) {
    std::fputs("> ", stderr);
    std::fflush(stderr);
    if (!std::getline(std::cin, line) || line == "/exit") break;
    if (line.empty()) continue;
    const size_t rendered = messages.size();
    messages.push_back({"user", line});
    const std::string text =
        colibri::render_chat(format, messages, true, parse_thinking(args.think), rendered);
    request.prompt = tokenizer.encode(text);
    // A message that does not fit after the conversation starts a new one; one that does not fit
    // alone is not sent.
    const size_t context = size_t(node.config().max_position_embeddings);
    const auto positions = [&] {
      return size_t(engine.length(seq)) + request.prompt.size() + size_t(request.max_new_tokens);
    };
    if (positions() > context && rendered > 0) {
      std::fputs("(context is full; starting a new conversation)\n", stderr);
      engine.clear_sequence(seq);
      messages.erase(messages.begin(), messages.end() - 1);
      request.prompt = tokenizer.encode(
          colibri::render_chat(format, messages, true, parse_thinking(args.think), 0));
    }
    if (positions() > context) {
      std::fprintf(stderr,
                   "(message of %zu tokens and --ngen %d need %zu positions, more than the "
                   "model's context of %zu; not sent)\n",
                   request.prompt.size(), request.max_new_tokens, positions(), context);
      messages.pop_back();
      continue;
    }
    const colibri::GenerateResult result =
        colibri::generate(forward, node.config().vocab_size, request, stream, engine.profiler());
    std::fputs("\n", stdout);
    colibri::flush_stdout_or_fail();
    std::vector<int> reply = result.tokens;
    if (!reply.empty() &&
        std::count(request.stop_ids.begin(), request.stop_ids.end(), reply.back()))
      reply.pop_back();
    messages.push_back({"assistant", tokenizer.decode(reply, true)});
    if (engine.length(seq) + request.max_new_tokens + 64 > node.config().max_position_embeddings) {
      std::fputs("(context is full; starting a new conversation)\n", stderr);
      engine.clear_sequence(seq);
      messages.clear();
    }
  }
}

void run_score(colibri::Node& node, const Args& args, const colibri::Tokenizer& tokenizer) {
  const std::vector<int> ids =
      tokenizer.encode(colibri::read_regular_file(args.score_file, "the --score file"), false);
  // Token i + 1 is predicted at position i: n tokens use n - 1 positions.
  if (ids.size() > 1 && ids.size() - 1 > size_t(node.config().max_position_embeddings))
    fail(
        "{}: {} tokens need {} positions, more than the model's context of {} "
        "(max_position_embeddings)",
        args.score_file, ids.size(), ids.size() - 1, node.config().max_position_embeddings);
  colibri::Engine& engine = node.engine();
  const int seq = engine.open_sequence();
  const colibri::ScoreResult score = colibri::score_tokens(
      colibri::sequence_forward(engine, seq), node.config().vocab_size, ids, args.node.max_rows);
  engine.close_sequence(seq);
  std::printf("# position\ttoken_id\tnll\ttoken\n");
  for (size_t i = 0; i < score.nll.size(); ++i) {
    const int token[] = {ids[i + 1]};
    std::printf("%zu\t%d\t%.6f\t%s\n", i + 1, ids[i + 1], score.nll[i],
                tokenizer.decode(token).c_str());
  }
  std::printf("perplexity %.4f over %zu tokens (mean nll %.6f) in %s\n", score.perplexity,
              score.nll.size(), score.mean_nll, args.score_file.c_str());
}

int run(const Args& args) {
  colibri::Node node(MPI_COMM_WORLD, args.node);
  if (!node.is_coordinator()) {
    node.serve();
    node.gather_reports();
    return 0;
  }
  const colibri::ModelConfig& config = node.config();
  if (!args.quiet)
    for (const std::string& line : node.memory_report())
      std::fprintf(stderr, "memory: %s\n", line.c_str());
  if (args.print_placement)
    std::fputs(
        colibri::format_placement(node.placement(), node.layout(), node.expert_bytes()).c_str(),
        stderr);

  if (args.serve) {
#ifdef COLIBRI_HAVE_SERVE
    const colibri::Tokenizer tokenizer = load_tokenizer(args.node.model_dir);
    colibri::ServeOptions options;
    options.host = args.host;
    options.port = args.port;
    options.api_key = args.api_key;
    options.max_body_bytes = size_t(args.max_body_mb * 1024 * 1024);
    options.model_name = std::filesystem::weakly_canonical(args.node.model_dir).filename().string();
    options.multi_rank = node.size() > 1;
    options.scheduler.max_batch_tokens = args.max_batch_tokens;
    options.scheduler.max_queue = args.max_queue;
    options.scheduler.prefix_cache = !args.no_prefix_cache;
    const int code = colibri::serve(node.engine(), tokenizer, options);
    node.shutdown();
    const std::vector<colibri::RankReport> reports = node.gather_reports();
    if (!args.quiet) colibri::print_profile(stderr, reports, {});
    if (!args.profile_json.empty()) colibri::write_profile_json(args.profile_json, reports, {});
    if (!args.trace.empty()) colibri::write_trace(args.trace, reports);
    return code;
#endif
  }

  colibri::GenerateRequest request;
  request.max_new_tokens = args.ngen;
  request.sampling = {args.temperature, args.top_p, args.seed};
  if (!args.ignore_eos) request.stop_ids = config.generation.eos_token_ids;
  request.keep_logits = !args.logits_out.empty();
  request.prefill_chunk = args.node.max_rows;

  colibri::Engine& engine = node.engine();
  colibri::RunSummary run;
  std::vector<float> logits;
  // One sequence streams its tokens through `stream`; --sequences N > 1 decodes N copies of the
  // request together (seeds seed, seed + 1, ...) and prints each one's `render`ed tokens at the
  // end.
  const auto generate_request =
      [&](const std::function<void(int)>& stream,
          const std::function<std::string(const std::vector<int>&)>& render) {
        run.prefill_tokens = int(request.prompt.size()) * args.sequences;
        if (args.sequences == 1) {
          const int seq = engine.open_sequence();
          colibri::GenerateResult result =
              colibri::generate(colibri::sequence_forward(engine, seq), config.vocab_size, request,
                                stream, engine.profiler());
          engine.close_sequence(seq);
          run.prefill_seconds = result.prefill_seconds;
          run.decode_tokens = std::max(0, int(result.tokens.size()) - 1);
          run.decode_seconds = result.decode_seconds;
          run.ttft_seconds = result.ttft_seconds;
          logits = std::move(result.logits);
          std::fputs("\n", stdout);
          return;
        }
        std::vector<colibri::GenerateRequest> requests(size_t(args.sequences), request);
        for (size_t i = 0; i < requests.size(); ++i) requests[i].sampling.seed = args.seed + i;
        colibri::BatchGenerateStats stats;
        const std::vector<colibri::GenerateResult> results =
            colibri::generate_batch(engine, requests, {}, &stats);
        for (size_t i = 0; i < results.size(); ++i) {
          std::printf("[sequence %zu] %s\n", i, render(results[i].tokens).c_str());
          run.prefill_seconds = std::max(run.prefill_seconds, results[i].ttft_seconds);
        }
        run.ttft_seconds = results.front().ttft_seconds;
        run.decode_tokens = stats.decode_only_tokens;  // steps of decode rows only
        run.decode_seconds = stats.decode_seconds;
      };

  std::optional<colibri::Tokenizer> tokenizer;
  if (!args.prompt_ids.empty()) {
    request.prompt = parse_ids(args.prompt_ids);
    check_context(config, request.prompt.size(), args.ngen, request.keep_logits);
    generate_request(
        [](int token) {
          std::fprintf(stdout, "%d ", token);
          colibri::flush_stdout_or_fail();
        },
        [](const std::vector<int>& tokens) { return fmt::format("{}", fmt::join(tokens, " ")); });
  } else {
    tokenizer = load_tokenizer(args.node.model_dir);
    if (args.chat) {
      run_chat(node, args, *tokenizer, request);
    } else if (!args.score_file.empty()) {
      run_score(node, args, *tokenizer);
    } else {
      const std::string prompt = args.prompt.empty() ? std::string(kDefaultPrompt) : args.prompt;
      const colibri::ChatFormat format = colibri::chat_format_for(config);
      std::string shown_prompt;
      if (args.chat_format) {
        request.prompt = tokenizer->encode(
            colibri::render_chat(format, {{"user", prompt}}, true, parse_thinking(args.think)));
        if (!args.ignore_eos) request.stop_ids = colibri::chat_stop_ids(format, config, *tokenizer);
      } else {
        request.prompt = tokenizer->encode(prompt);
        shown_prompt = prompt;
      }
      check_context(config, request.prompt.size(), args.ngen, request.keep_logits);
      if (!args.chat_format && args.sequences == 1) std::fputs(prompt.c_str(), stdout);
      generate_request(TextStream(*tokenizer), [&](const std::vector<int>& tokens) {
        return shown_prompt + tokenizer->decode(tokens, /*skip_special=*/true);
      });
    }
  }
  colibri::flush_stdout_or_fail();
  node.shutdown();
  // The expert ranks wait for this with the --rank-timeout deadline: before the outputs.
  const std::vector<colibri::RankReport> reports = node.gather_reports();

  if (!args.logits_out.empty()) {
    const int64_t shape[] = {int64_t(logits.size()) / config.vocab_size, config.vocab_size};
    colibri::write_npy_f32(args.logits_out, logits, shape);
  }
  if (!args.quiet) colibri::print_profile(stderr, reports, run);
  if (!args.profile_json.empty()) colibri::write_profile_json(args.profile_json, reports, run);
  if (!args.trace.empty()) colibri::write_trace(args.trace, reports);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The coordinator's heartbeat to the expert ranks is sent from its own thread.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Named in every error from here on; the other ranks' hosts come with the first start-up step.
  colibri::RankIdentity& me = colibri::rank_identity();
  me.rank = rank;
  MPI_Comm_size(MPI_COMM_WORLD, &me.size);
  char host[MPI_MAX_PROCESSOR_NAME];
  int host_length = 0;
  MPI_Get_processor_name(host, &host_length);
  me.host = std::string(host, size_t(host_length));
  // An exit() before MPI_Finalize (not through abort_job, which ends with MPI_Abort and _Exit):
  // say so with this rank's host, which Open MPI's report of it leaves out.
  std::atexit([] {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized) return;
    const colibri::RankIdentity& self = colibri::rank_identity();
    std::fprintf(stderr, "[rank %d@%s] error: exit() before MPI_Finalize; the job ends\n",
                 self.rank, self.host.c_str());
    std::fflush(stderr);
  });
  colibri::post_early_hosts(MPI_COMM_WORLD);

  Args args;
  CLI::App app{
      "colibri-node: Mixture-of-Experts inference across GPUs and CPU memory.\n"
      "Run alone or as `mpirun -np N colibri-node ...` (rank 0 coordinates unless --layout says "
      "otherwise)."};
  args.node.model_dir = COLIBRI_DEFAULT_MODEL;
  app.add_option("--model", args.node.model_dir,
                 "Hugging Face model directory (default: the embedded tiny GLM-5 model)")
      ->capture_default_str();
  auto* prompt =
      app.add_option("--prompt", args.prompt,
                     std::string("text to continue (default: \"") + kDefaultPrompt + "\")");
  auto* prompt_ids = app.add_option("--prompt-ids", args.prompt_ids,
                                    "prompt as comma-separated token ids, e.g. 1,2,3");
  auto* chat = app.add_flag(
      "--chat", args.chat, "interactive chat on the terminal; the KV cache keeps the conversation");
  auto* score =
      app.add_option("--score", args.score_file,
                     "print the per-token negative log-likelihood and perplexity of a text file");
  prompt->excludes(prompt_ids)->excludes(chat)->excludes(score);
  prompt_ids->excludes(chat)->excludes(score);
  chat->excludes(score);
  app.add_flag("--chat-format", args.chat_format,
               "wrap --prompt as one user turn in the model's chat format");
  app.add_option("--think", args.think,
                 "chat thinking block: on or off (default: the template's choice)");
  app.add_flag("--quiet", args.quiet, "do not print the per-rank profile table");
  app.add_option("--ngen", args.ngen, "number of tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--temp", args.temperature, "sampling temperature; 0 = greedy")
      ->capture_default_str();
  app.add_option("--top-p", args.top_p, "nucleus sampling mass in (0, 1]")->capture_default_str();
  app.add_option("--seed", args.seed_text, "random seed for sampling, in [0, 2^64)")
      ->capture_default_str();
  app.add_flag("--ignore-eos", args.ignore_eos, "keep generating after an end-of-sequence token");
  app.add_option("--logits-out", args.logits_out,
                 "write the logits of every position (prompt and generated) as float32 .npy "
                 "[positions, vocab]");
  app.add_option("--layout", args.layout,
                 "layout file: rank -> role, GPU, NUMA node, budgets (default: rank 0 "
                 "coordinates, the others are expert ranks)");
  app.add_option("--placement", args.placement,
                 "expert placement policy: balanced, round-robin, contiguous, hosts (contiguous "
                 "expert groups per host, in proportion to the hosts' budgets), sliced (every "
                 "owner holds a slice of every expert's intermediate rows, in proportion to its "
                 "budget)")
      ->capture_default_str();
  app.add_flag("--print-placement", args.print_placement,
               "print the expert placement table at start-up");
  app.add_option(
         "--rank-timeout", args.node.rank_timeout_s,
         "seconds the coordinator waits for an expert rank within one exchange before aborting")
      ->capture_default_str();
  app.add_option("--max-rows", args.node.max_rows,
                 "rows per forward call (prefill chunk); sizes the exchange buffers")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--vram-gb", args.node.vram_gb,
                 "GiB of VRAM per gpu-expert rank for its routed experts, a cache over RAM/disk "
                 "when they do not all fit; 0 = the device's free memory (the layout's vram_gb "
                 "column overrides it per rank)")
      ->capture_default_str();
  app.add_option("--pcie-gbps", args.node.pcie_gbps,
                 "host-to-device GB/s the VRAM tier's miss rule assumes (upload a missed expert "
                 "when that is no slower than the CPU; bench/gpu_expert_bench measures it)")
      ->capture_default_str();
  app.add_option("--cpu-expert-gbps", args.node.cpu_expert_gbps,
                 "GB/s of expert weights a GPU rank's CPU threads compute through, for the VRAM "
                 "tier's miss rule")
      ->capture_default_str();
  app.add_option("--experts", args.experts,
                 "where a single process computes its routed experts: cpu, or gpu (CUDA device "
                 "0, experts in VRAM up to --vram-gb; under mpirun use gpu-expert ranks in "
                 "--layout)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "gpu"}));
  app.add_flag("--split-linears", args.split_linears,
               "split the coordinator's attention projections, dense MLPs and lm_head by output "
               "rows, and its attention by heads, across it and the cpu-expert ranks, which "
               "compute theirs while they wait for routed-expert requests (every output keeps the "
               "bits of one process's; each such rank keeps a copy of the compressed KV cache)");
  app.add_flag("--coordinator-gpu", args.coordinator_gpu,
               "a single process runs the coordinator's forward (attention, router, shared "
               "experts, dense layers, lm_head) on CUDA device 0; under mpirun, give the "
               "coordinator's layout row a gpu");
  app.add_option("--ram-gb", args.node.ram_gb,
                 "GiB of RAM per expert rank for routed experts, the rest read from disk on "
                 "demand; 0 = all "
                 "resident (the layout's ram_gb column overrides it per rank)")
      ->capture_default_str();
  app.add_option("--pin-gb", args.node.pin_gb,
                 "GiB of routed experts per expert rank pinned in RAM at start (with --ram-gb)")
      ->capture_default_str();
  app.add_option("--kv-tokens", args.node.kv_tokens,
                 "KV cache pool in tokens, shared by all sequences (default: the model's context, "
                 "at most 32768)")
      ->check(CLI::Range(1, 1 << 30));
  auto* sequences =
      app.add_option("--sequences", args.sequences,
                     "generate this many copies of the prompt at once, decoded together in one "
                     "batch (seeds --seed, --seed + 1, ...); each is printed when done")
          ->capture_default_str()
          ->check(CLI::Range(1, 4096));
  sequences->excludes(chat)->excludes(score);
  app.add_option("--max-seqs", args.node.max_seqs,
                 "sequences holding KV blocks at once (default: --sequences); the rest wait")
      ->check(CLI::Range(1, 4096));
  app.add_option("--wire", args.wire,
                 "element type of rows and partials between ranks: f32 or bf16 (halves the bytes)")
      ->capture_default_str();
  app.add_option("--transport", args.transport,
                 "between the coordinator and the gpu-expert ranks: mpi, nccl (the coordinator "
                 "needs a gpu in --layout; cpu-expert ranks stay on MPI) or auto (nccl when "
                 "built with NCCL and every GPU rank sees a device, else mpi)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "mpi", "nccl"}));
  app.add_option("--combine", args.combine,
                 "star: every expert rank replies to the coordinator; host: the expert ranks of "
                 "each host sum their partials at the lowest of them, which replies once for the "
                 "host (fewer bytes across hosts)")
      ->capture_default_str()
      ->check(CLI::IsMember({"star", "host"}));
  app.add_option("--shared-memory", args.shared_memory,
                 "on: the expert ranks on the coordinator's host that reply to it share a memory "
                 "segment with it, where rows and partials are written (no copy through MPI); "
                 "off: every row goes in MPI messages")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option(
      "--activations", args.activations,
      "activations of the products with int4/int8 weights: int8 (quantized per 64 "
      "inputs, integer dot products), f32, or mixed (int8 for int4 weights, f32 for int8 "
      "weights); default int8");
  auto* serve = app.add_flag("--serve", args.serve,
                             "serve an OpenAI-compatible HTTP API (continuous batching) on the "
                             "coordinator until SIGINT/SIGTERM");
  serve->excludes(prompt)->excludes(prompt_ids)->excludes(chat)->excludes(score);
  app.add_option("--host", args.host, "--serve: address to bind")->capture_default_str();
  app.add_option("--port", args.port, "--serve: TCP port (0: any free port, printed)")
      ->capture_default_str();
  app.add_option("--api-key", args.api_key,
                 "--serve: require 'Authorization: Bearer KEY' on every route but /health "
                 "(default: $COLIBRI_API_KEY)");
  app.add_option("--max-batch-tokens", args.max_batch_tokens,
                 "--serve: rows per forward call, decode rows plus prompt chunks (default: "
                 "--max-rows)")
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--max-queue", args.max_queue,
                 "--serve: waiting requests; more are answered 429 with Retry-After")
      ->capture_default_str();
  app.add_option("--max-body-mb", args.max_body_mb, "--serve: largest request body in MiB (413)")
      ->capture_default_str();
  app.add_flag("--no-prefix-cache", args.no_prefix_cache,
               "--serve: do not keep finished sequences' KV blocks for prompts that continue them");
  app.add_option("--profile-json", args.profile_json, "write the per-rank profile as JSON");
  app.add_option("--trace", args.trace,
                 "write a Chrome/Perfetto trace-event JSON, one process per rank");

  app.add_option("--startup-timeout", args.node.startup_timeout_s,
                 "seconds each rank waits for the others at every start-up step (argument "
                 "checks, handshake, weights loaded) before naming the missing rank and aborting")
      ->capture_default_str();

  // Every rank checks its own arguments and files, then all compare the outcome under a
  // deadline: the lowest rank that cannot go on prints why, and every rank ends with its code.
  colibri::StartupStatus status;
  try {
    app.parse(argc, argv);
    args.prompt_given = prompt->count() > 0;
    args.node.fault = colibri::test_fault_from_env(rank);
    check_own_arguments(app, args, rank, me.size);
  } catch (const CLI::ParseError& e) {
    status = {true, e.get_exit_code(), e.get_exit_code() != 0, {}};
    if (status.is_error) {
      status.message = fmt::format("{} (run with --help for more information)", e.what());
    } else {  // --help
      std::ostringstream out, err;
      app.exit(e, out, err);
      status.message = out.str();
    }
  } catch (const colibri::Error& e) {
    status = {true, 1, true, e.what()};
  } catch (const std::exception& e) {
    status = {true, 1, true, fmt::format("internal error: {}", e.what())};
  }
  colibri::raise_test_fault(args.node.fault, colibri::TestFault::kStartup, rank);
  // A timeout that did not parse or validate waits the default.
  const double startup_timeout_s =
      status.stop ? colibri::NodeOptions{}.startup_timeout_s : args.node.startup_timeout_s;
  const colibri::StartupVerdict verdict = colibri::agree_to_start(
      MPI_COMM_WORLD, status,
      {startup_timeout_s, "--startup-timeout", "start-up (argument checks)"});
  colibri::finish_early_hosts();  // every rank passed the first step: their messages arrived
  if (verdict.reporter >= 0) {
    if (verdict.reporter == rank) report_stop(status, me.size > 1);
    MPI_Finalize();
    return verdict.status.exit_code;
  }

  int code = 0;
  try {
    code = run(args);
  } catch (const colibri::StartupRefused& e) {
    if (rank == e.reporter())
      report_stop({true, 1, true, e.what()}, e.names_reporter() && me.size > 1);
    code = 1;
  } catch (const colibri::Error& e) {
    colibri::abort_job(e.what());
  } catch (const std::exception& e) {
    colibri::abort_job(fmt::format("internal error: {}", e.what()));
  }
  MPI_Finalize();
  return code;
}
