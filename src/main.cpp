// colibri-node: run a Mixture-of-Experts model from a Hugging Face directory, alone or as one
// rank of `mpirun -np N colibri-node`.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/npy.h"
#include "coordinator/batch_generate.h"
#include "coordinator/chat.h"
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
  bool chat = false, chat_format = false;
  std::string wire = "f32";
  int ngen = 16;
  int sequences = 1;
  float temperature = 0.0f, top_p = 1.0f;
  uint64_t seed = 0;
  bool ignore_eos = false, print_placement = false, quiet = false;
};

constexpr const char* kDefaultPrompt = "And God said,";

// Prints generated tokens as text as they arrive; special tokens are not printed.
class TextStream {
 public:
  explicit TextStream(const colibri::Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  void operator()(int token) const {
    const int one[] = {token};
    const std::string bytes = tokenizer_.decode_bytes(one, /*skip_special=*/true);
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    std::fflush(stdout);
  }

 private:
  const colibri::Tokenizer& tokenizer_;
};

colibri::Tokenizer load_tokenizer(const std::filesystem::path& model_dir) {
  const auto path = model_dir / "tokenizer.json";
  if (!std::filesystem::exists(path))
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

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
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
    const colibri::GenerateResult result =
        colibri::generate(forward, node.config().vocab_size, request, stream, engine.profiler());
    std::fputs("\n", stdout);
    std::fflush(stdout);
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
  const std::vector<int> ids = tokenizer.encode(read_file(args.score_file), false);
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
  if (args.print_placement)
    std::fputs(
        colibri::format_placement(node.placement(), node.layout(), node.expert_bytes()).c_str(),
        stderr);

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
    generate_request(
        [](int token) {
          std::fprintf(stdout, "%d ", token);
          std::fflush(stdout);
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
        if (args.sequences == 1) std::fputs(prompt.c_str(), stdout);
      }
      generate_request(TextStream(*tokenizer), [&](const std::vector<int>& tokens) {
        return shown_prompt + tokenizer->decode(tokens, /*skip_special=*/true);
      });
    }
  }
  std::fflush(stdout);
  node.shutdown();

  if (!args.logits_out.empty()) {
    const int64_t shape[] = {int64_t(logits.size()) / config.vocab_size, config.vocab_size};
    colibri::write_npy_f32(args.logits_out, logits, shape);
  }
  const std::vector<colibri::RankReport> reports = node.gather_reports();
  if (!args.quiet) colibri::print_profile(stderr, reports, run);
  if (!args.profile_json.empty()) colibri::write_profile_json(args.profile_json, reports, run);
  if (!args.trace.empty()) colibri::write_trace(args.trace, reports);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  Args args;
  CLI::App app{
      "colibri-node: Mixture-of-Experts inference across GPUs and CPU memory.\n"
      "Run alone or as `mpirun -np N colibri-node ...` (rank 0 coordinates unless --layout says "
      "otherwise)."};
  args.node.model_dir = COLIBRI_DEFAULT_MODEL;
  app.add_option("--model", args.node.model_dir,
                 "Hugging Face model directory (default: the embedded tiny GLM-5 model)")
      ->capture_default_str()
      ->check(CLI::ExistingDirectory);
  auto* prompt =
      app.add_option("--prompt", args.prompt,
                     std::string("text to continue (default: \"") + kDefaultPrompt + "\")");
  auto* prompt_ids = app.add_option("--prompt-ids", args.prompt_ids,
                                    "prompt as comma-separated token ids, e.g. 1,2,3");
  auto* chat = app.add_flag(
      "--chat", args.chat, "interactive chat on the terminal; the KV cache keeps the conversation");
  auto* score =
      app.add_option("--score", args.score_file,
                     "print the per-token negative log-likelihood and perplexity of a text file")
          ->check(CLI::ExistingFile);
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
  app.add_option("--seed", args.seed, "random seed for sampling")->capture_default_str();
  app.add_flag("--ignore-eos", args.ignore_eos, "keep generating after an end-of-sequence token");
  app.add_option("--logits-out", args.logits_out,
                 "write the logits of every position (prompt and generated) as float32 .npy "
                 "[positions, vocab]");
  app.add_option("--layout", args.layout,
                 "layout file: rank -> role, GPU, NUMA node, budgets (default: rank 0 "
                 "coordinates, the others are expert ranks)");
  app.add_option("--placement", args.placement,
                 "expert placement policy: balanced, round-robin, contiguous")
      ->capture_default_str();
  app.add_flag("--print-placement", args.print_placement,
               "print the expert placement table at start-up");
  app.add_option(
         "--rank-timeout", args.node.rank_timeout_s,
         "seconds the coordinator waits for an expert rank within one exchange before aborting")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-rows", args.node.max_rows,
                 "rows per forward call (prefill chunk); sizes the exchange buffers")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--ram-gb", args.node.ram_gb,
                 "GiB of RAM per expert rank for routed experts, the rest read from disk on "
                 "demand; 0 = all "
                 "resident (the layout's ram_gb column overrides it per rank)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--pin-gb", args.node.pin_gb,
                 "GiB of routed experts per expert rank pinned in RAM at start (with --ram-gb)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
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
  app.add_option("--profile-json", args.profile_json, "write the per-rank profile as JSON");
  app.add_option("--trace", args.trace,
                 "write a Chrome/Perfetto trace-event JSON, one process per rank");

  int code = 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (rank == 0)
      code = app.exit(e);
    else
      code = e.get_exit_code();
    MPI_Finalize();
    return code;
  }

  try {
    if (!args.layout.empty()) args.node.layout_file = args.layout;
    args.node.placement = colibri::parse_placement_policy(args.placement);
    args.node.keep_trace = !args.trace.empty();
    args.node.fault = colibri::test_fault_from_env(rank);
    args.node.wire_type = colibri::parse_elem_type(args.wire, "--wire");
    if (app.count("--max-seqs") == 0) args.node.max_seqs = args.sequences;
    if (args.node.max_seqs > args.node.max_rows)
      fail("--max-seqs {} exceeds --max-rows {}: every running sequence needs a row per step",
           args.node.max_seqs, args.node.max_rows);
    if (args.sequences > 1 && !args.logits_out.empty())
      fail("--logits-out keeps the logits of one sequence; it cannot be used with --sequences");
    code = run(args);
  } catch (const colibri::StartupRefused& e) {
    if (rank == 0) std::fprintf(stderr, "colibri-node: error: %s\n", e.what());
    code = 1;
  } catch (const colibri::Error& e) {
    colibri::abort_job(e.what());
  } catch (const std::exception& e) {
    colibri::abort_job(fmt::format("internal error: {}", e.what()));
  }
  MPI_Finalize();
  return code;
}
