// colibri-node: run a Mixture-of-Experts model from a Hugging Face directory, alone or as one
// rank of `mpirun -np N colibri-node`.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
#include "coordinator/kv_file.h"
#include "cpu/quant.h"
#include "model/generate.h"
#include "model/score.h"
#include "node/command_line.h"
#include "node/job_signals.h"
#include "node/node.h"
#include "node/run_summary.h"
#include "plan/calibrate.h"
#include "plan/plan_main.h"
#include "plan/tune.h"
#include "tokenizer/tokenizer.h"
#include "transport/liveness.h"
#include "transport/mpi_check.h"
#include "transport/watchdog.h"

namespace {

using colibri::check_context;
using colibri::fail;
using colibri::kDefaultPrompt;
using colibri::parse_ids;

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

// One line of stdin; false at its end. A read interrupted by a signal (mpirun's SIGCONT at the
// start of its teardown) is not the end of input: the read goes on.
bool read_line(std::string& line) {
  for (;;) {
    errno = 0;
    if (std::getline(std::cin, line)) return true;
    if (errno != EINTR || std::feof(stdin)) return false;
    std::cin.clear();
    std::clearerr(stdin);
  }
}

// Interactive chat on stdin/stdout; the KV cache keeps the whole conversation.
void run_chat(colibri::Node& node, const colibri::CommandLine& args,
              const colibri::Tokenizer& tokenizer, colibri::GenerateRequest request) {
  const colibri::ChatFormat format = colibri::chat_format_for(node.config());
  request.stop_ids = colibri::chat_stop_ids(format, node.config(), tokenizer);
  colibri::Engine& engine = node.engine();
  const int seq = engine.open_sequence();
  const colibri::ForwardFn forward = colibri::sequence_forward(engine, seq);
  std::vector<colibri::ChatMessage> messages;
  // --kv-file: the conversation so far comes back without a prefill; each turn is appended.
  std::optional<colibri::KvFile> kv_file;
  if (!args.kv_file.empty()) {
    kv_file.emplace(args.kv_file, node.config(), node.model_identity());
    std::vector<std::string> notes;
    const std::vector<int> ids = kv_file->restore(engine.kv(), seq, notes);
    for (const std::string& note : notes) std::fprintf(stderr, "(%s)\n", note.c_str());
    if (!ids.empty()) {
      std::fprintf(stderr, "(continuing the conversation in %s: %zu tokens, no prefill)\n",
                   args.kv_file.c_str(), ids.size());
      messages.push_back({"history", ""});  // rendered already: new turns follow it
    }
  }
  const auto new_conversation = [&] {
    engine.clear_sequence(seq);
    if (kv_file) kv_file->reset();
  };
  const TextStream stream(tokenizer);
  std::string line;
  for (;;) {
    std::fputs("> ", stderr);
    std::fflush(stderr);
    if (!read_line(line) || line == "/exit") break;
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
      new_conversation();
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
    const int before = engine.length(seq);
    const colibri::GenerateResult result =
        colibri::generate(forward, node.config().vocab_size, request, stream, engine.profiler());
    std::fputs("\n", stdout);
    colibri::flush_stdout_or_fail();
    std::vector<int> reply = result.tokens;
    if (!reply.empty() &&
        std::count(request.stop_ids.begin(), request.stop_ids.end(), reply.back()))
      reply.pop_back();
    if (kv_file) {
      // The positions the turn added: its prompt and the reply, but the last token when it was
      // not fed (a final stop token, or the last of --ngen).
      std::vector<int> turn = request.prompt;
      turn.insert(turn.end(), result.tokens.begin(), result.tokens.end());
      const int grew = engine.length(seq) - before;
      if (grew > int(turn.size()) || grew + 1 < int(turn.size()))
        fail("--kv-file: the turn holds {} tokens but the sequence grew by {}", turn.size(), grew);
      turn.resize(size_t(grew));
      kv_file->append(engine.kv(), seq, before, turn);
    }
    messages.push_back({"assistant", tokenizer.decode(reply, true)});
    if (engine.length(seq) + request.max_new_tokens + 64 > node.config().max_position_embeddings) {
      std::fputs("(context is full; starting a new conversation)\n", stderr);
      new_conversation();
      messages.clear();
    }
  }
}

void run_score(colibri::Node& node, const colibri::CommandLine& args,
               const colibri::Tokenizer& tokenizer) {
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
  // Timing, as the run line of a generation (`colibri-node tune` reads it).
  std::vector<double> calls = score.call_seconds;
  double total = 0;
  for (double s : calls) total += s;
  std::sort(calls.begin(), calls.end());
  const auto at = [&](double q) {
    return calls[std::min(calls.size() - 1, size_t(q * calls.size()))];
  };
  std::fprintf(stderr,
               "score %zu tok in %zu forward calls, %.3f s (%.2f tok/s) | call p50 %.3f ms p99 "
               "%.3f ms\n",
               score.nll.size(), calls.size(), total, double(score.nll.size()) / total,
               1e3 * at(0.5), 1e3 * at(0.99));
}

// --output: stdout goes to an unnamed temporary file until the run ends, then its bytes are written
// to the target atomically (common/output_file.h). On an error the target is left as it was.
class StdoutToFile {
 public:
  explicit StdoutToFile(std::filesystem::path target) : target_(std::move(target)) {
    std::fflush(stdout);
    temp_ = std::tmpfile();
    saved_ = ::dup(STDOUT_FILENO);
    if (!temp_ || saved_ < 0 || ::dup2(::fileno(temp_), STDOUT_FILENO) < 0)
      fail("--output {}: cannot hold the output in a temporary file: {}", target_.string(),
           std::strerror(errno));
  }
  ~StdoutToFile() {
    restore();
    if (temp_) std::fclose(temp_);
  }
  StdoutToFile(const StdoutToFile&) = delete;
  StdoutToFile& operator=(const StdoutToFile&) = delete;

  // Everything printed so far goes to the target, and stdout is the terminal's again.
  void commit() {
    colibri::flush_stdout_or_fail();
    std::string bytes;
    std::rewind(temp_);
    char buffer[1 << 16];
    for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, temp_)) > 0;) bytes.append(buffer, n);
    if (std::ferror(temp_))
      fail("--output {}: cannot read back the temporary file", target_.string());
    restore();
    colibri::write_file_atomically(
        target_, [&](std::FILE* file) { std::fwrite(bytes.data(), 1, bytes.size(), file); });
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stdout);
    ::dup2(saved_, STDOUT_FILENO);
    ::close(saved_);
    saved_ = -1;
  }

  std::filesystem::path target_;
  std::FILE* temp_ = nullptr;
  int saved_ = -1;
};

// One line on how well --prefetch-ahead predicted, one on what live re-placement did
// (--repin-every).
void print_repin(colibri::Node& node, bool quiet) {
  if (quiet) return;
  if (node.options().prefetch_ahead && node.is_coordinator()) {
    const colibri::PrefetchStats& p = node.engine().prefetch_stats();
    std::string layers;
    for (size_t l = 0; l < p.pairs.size(); ++l)
      if (p.pairs[l] > 0)
        layers += fmt::format(
            " {}:{:.2f}/{:.2f}", l, double(p.pair_hits[l]) / double(p.pairs[l]),
            p.set_predicted[l] ? double(p.set_hits[l]) / double(p.set_predicted[l]) : 0.0);
    const colibri::PrefetchStats::Totals t = p.totals();
    if (t.pairs > 0)
      std::fprintf(stderr,
                   "prefetch ahead: recall %.3f of routed pairs, precision %.3f of hinted experts "
                   "(per layer recall/precision:%s)\n",
                   double(t.pair_hits) / double(t.pairs),
                   t.set_predicted ? double(t.set_hits) / double(t.set_predicted) : 0.0,
                   layers.c_str());
  }
  if (const colibri::RepinStats* r = node.repin_stats())
    std::fprintf(stderr,
                 "re-placement: %llu rounds, %llu of them moved experts (%llu (layer, expert) "
                 "holder changes), placement epoch %u, %.1f ms on the coordinator\n",
                 static_cast<unsigned long long>(r->rounds),
                 static_cast<unsigned long long>(r->changes),
                 static_cast<unsigned long long>(r->moves), node.placement().epoch,
                 double(r->coordinator_us) / 1e3);
}

int run(const colibri::CommandLine& args) {
  colibri::Node node(MPI_COMM_WORLD, args.node);
  if (!node.is_coordinator()) {
    if (args.serve) colibri::install_expert_rank_signal_handlers();
    node.serve();
    node.gather_reports();
    return 0;
  }
  const colibri::ModelConfig& config = node.config();
  if (!args.quiet && !args.summary)
    for (const std::string& line : node.memory_report())
      std::fprintf(stderr, "memory: %s\n", line.c_str());
  if (!node.routing_stats_warning().empty())
    std::fprintf(stderr, "colibri-node: warning: %s\n", node.routing_stats_warning().c_str());
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
    options.connections.max_connections = args.max_connections;
    options.connections.max_per_client = args.max_client_connections;
    options.connections.request_timeout_s = args.request_timeout;
    options.model_name = std::filesystem::weakly_canonical(args.node.model_dir).filename().string();
    options.multi_rank = node.size() > 1;
    options.scheduler.max_batch_tokens = args.max_batch_tokens;
    options.scheduler.max_queue = args.max_queue;
    options.scheduler.prefix_cache = !args.no_prefix_cache;
    options.thinking = parse_thinking(args.think);
    const int code = colibri::serve(node.engine(), tokenizer, options);
    node.shutdown();
    const std::vector<colibri::RankReport> reports = node.gather_reports();
    if (!args.quiet)
      colibri::print_profile(stderr, reports, std::nullopt);  // the requests are in /metrics
    print_repin(node, args.quiet);
    if (!args.profile_json.empty()) colibri::write_profile_json(args.profile_json, reports, {});
    if (!args.trace.empty()) colibri::write_trace(args.trace, reports);
    return code;
#endif
  }

  if (node.size() == 1) colibri::install_offline_coordinator_signal_handlers();
  std::optional<StdoutToFile> output;
  if (!args.output.empty()) output.emplace(args.output);
  colibri::GenerateRequest request;
  request.max_new_tokens = args.ngen;
  request.sampling.temperature = args.temperature;
  request.sampling.top_p = args.top_p;
  request.sampling.seed = args.seed;
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
  if (output) output->commit();
  node.shutdown();
  // The expert ranks wait for this with the --rank-timeout deadline: before the outputs.
  const std::vector<colibri::RankReport> reports = node.gather_reports();

  if (!args.logits_out.empty()) {
    const int64_t shape[] = {int64_t(logits.size()) / config.vocab_size, config.vocab_size};
    colibri::write_npy_f32(args.logits_out, logits, shape);
  }
  if (args.summary)
    std::fputs(
        colibri::format_run_summary(node.placement(), node.layout(), reports, run, request.sampling)
            .c_str(),
        stderr);
  else if (!args.quiet)
    colibri::print_profile(stderr, reports, run);
  print_repin(node, args.quiet || args.summary);
  if (!args.profile_json.empty()) colibri::write_profile_json(args.profile_json, reports, run);
  if (!args.trace.empty()) colibri::write_trace(args.trace, reports);
  return 0;
}

// MPI_Finalize waits for every rank too: within `seconds`, quietly (a rank that ends the job
// has said why; one stuck there is ended by mpirun with the rest).
void finalize(double seconds) {
  const colibri::WatchdogScope watchdog(seconds, "");
  MPI_Finalize();
}

// COLIBRI_TEST_FAULT at "init": the rank from the launcher's environment (a malformed value is
// refused after MPI_Init, with the other checks).
void raise_early_test_fault() {
  const int rank = colibri::launcher_rank();
  try {
    colibri::raise_test_fault(colibri::test_fault_from_env(rank), colibri::TestFault::kInit, rank);
  } catch (const colibri::Error&) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Subcommands that need no MPI.
  if (argc > 1 && std::string_view(argv[1]) == "plan")
    return colibri::plan_main(argc - 1, argv + 1);
  // calibrate starts MPI itself, only under mpirun -np 2 (the exchange).
  if (argc > 1 && std::string_view(argv[1]) == "calibrate")
    return colibri::calibrate_main(argc - 1, argv + 1);
  // tune starts its jobs through the launcher.
  if (argc > 1 && std::string_view(argv[1]) == "tune")
    return colibri::tune_main(argc - 1, argv + 1);
  // The coordinator's heartbeat to the expert ranks is sent from its own thread.
  // MPI_Init waits for every rank without a deadline of its own: the watchdog gives it one.
  const double init_timeout_s =
      colibri::startup_timeout_from_argv(argc, argv, colibri::NodeOptions{}.startup_timeout_s);
  raise_early_test_fault();
  int provided = 0;
  {
    const colibri::WatchdogScope watchdog(init_timeout_s, "MPI_Init");
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  }
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
    colibri::liveness_report_error();  // this line says why: the coordinator adds none
    const colibri::RankIdentity& self = colibri::rank_identity();
    std::fprintf(stderr, "[rank %d@%s] error: exit() before MPI_Finalize; the job ends\n",
                 self.rank, self.host.c_str());
    std::fflush(stderr);
  });
  colibri::post_early_hosts(MPI_COMM_WORLD);

  colibri::CommandLine args;
  CLI::App app{
      "colibri-node: Mixture-of-Experts inference across GPUs and CPU memory.\n"
      "Run alone or as `mpirun -np N colibri-node ...` (rank 0 coordinates unless --layout says "
      "otherwise)."};
  args.node.model_dir = COLIBRI_DEFAULT_MODEL;
  colibri::add_flags(app, args);

  // Every rank checks its own arguments and files, then all compare the outcome under a
  // deadline: the lowest rank that cannot go on prints why, and every rank ends with its code.
  colibri::StartupStatus status;
  try {
    app.parse(argc, argv);
    args.node.fault = colibri::test_fault_from_env(rank);
    colibri::check_command_line(app, args, rank, me.size);
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
    finalize(startup_timeout_s);
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
  finalize(args.node.startup_timeout_s);
  return code;
}
