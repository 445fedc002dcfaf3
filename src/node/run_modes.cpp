#include "node/run_modes.h"

#include <fmt/format.h>
#include <mpi.h>

#include <cstdio>
#include <optional>

#include "common/error.h"
#include "common/input_file.h"
#include "common/npy.h"
#include "common/output_file.h"
#include "node/job_signals.h"
#include "node/run_summary.h"
#include "node/stdout_to_file.h"

namespace colibri {
namespace {

// The coordinator's lines before the run: each rank's memory, a warning about the routing
// statistics, and the placement with --print-placement.
void print_start(Node& node, const CommandLine& args) {
  if (!args.quiet && !args.summary)
    for (const std::string& line : node.memory_report())
      std::fprintf(stderr, "memory: %s\n", line.c_str());
  if (!node.routing_stats_warning().empty())
    std::fprintf(stderr, "colibri-node: warning: %s\n", node.routing_stats_warning().c_str());
  if (args.print_placement)
    std::fputs(format_placement(node.placement(), node.layout(), node.expert_bytes()).c_str(),
               stderr);
}

// After an offline run, every rank's report gathered: the logits, the summary or the profile, and
// the files the flags ask for.
void finish_offline(Node& node, const CommandLine& args, const std::vector<RankReport>& reports,
                    const GenerateOutcome& outcome, const SamplingParams& sampling) {
  const ModelConfig& config = node.config();
  if (!args.logits_out.empty()) {
    const int64_t shape[] = {int64_t(outcome.logits.size()) / config.vocab_size, config.vocab_size};
    write_npy_f32(args.logits_out, outcome.logits, shape);
  }
  if (args.summary)
    std::fputs(
        format_run_summary(node.placement(), node.layout(), reports, outcome.run, sampling).c_str(),
        stderr);
  else if (!args.quiet)
    print_profile(stderr, reports, outcome.run);
  print_repin(node, args.quiet || args.summary);
  if (!args.profile_json.empty()) write_profile_json(args.profile_json, reports, outcome.run);
  if (!args.trace.empty()) write_trace(args.trace, reports);
}

// The coordinator of a run from the command line: one mode, its output (to --output's file when
// given), then the expert ranks ended and the reports.
int run_offline(Node& node, const CommandLine& args) {
  if (node.size() == 1) install_offline_coordinator_signal_handlers();
  std::optional<StdoutToFile> output;
  if (!args.output.empty()) output.emplace(args.output);
  const GenerateRequest request = generate_request_of(node.config(), args);
  GenerateOutcome outcome;
  std::optional<Tokenizer> tokenizer;
  if (!args.prompt_ids.empty()) {
    outcome = run_generate_ids(node, args, request);
  } else {
    tokenizer = load_tokenizer(args.node.model_dir);
    if (args.chat)
      run_chat(node, args, *tokenizer, request);
    else if (!args.score_file.empty())
      run_score(node, args, *tokenizer);
    else
      outcome = run_generate_text(node, args, *tokenizer, request);
  }
  flush_stdout_or_fail();
  if (output) output->commit();
  node.shutdown();
  // The expert ranks wait for this with the --rank-timeout deadline: before the outputs.
  const std::vector<RankReport> reports = node.gather_reports();
  finish_offline(node, args, reports, outcome, request.sampling);
  return 0;
}

}  // namespace

int run_node(const CommandLine& args) {
  Node node(MPI_COMM_WORLD, args.node);
  if (!node.is_coordinator()) {
    if (args.serve) install_expert_rank_signal_handlers();
    node.serve();
    node.gather_reports();
    return 0;
  }
  print_start(node, args);
#ifdef COLIBRI_HAVE_SERVE
  if (args.serve) return run_serve(node, args);
#endif
  return run_offline(node, args);
}

void print_repin(Node& node, bool quiet) {
  if (quiet) return;
  if (node.options().prefetch_ahead && node.is_coordinator()) {
    const PrefetchStats& p = node.engine().prefetch_stats();
    std::string layers;
    for (size_t l = 0; l < p.pairs.size(); ++l)
      if (p.pairs[l] > 0)
        layers += fmt::format(
            " {}:{:.2f}/{:.2f}", l, double(p.pair_hits[l]) / double(p.pairs[l]),
            p.set_predicted[l] ? double(p.set_hits[l]) / double(p.set_predicted[l]) : 0.0);
    const PrefetchStats::Totals t = p.totals();
    if (t.pairs > 0)
      std::fprintf(stderr,
                   "prefetch ahead: recall %.3f of routed pairs, precision %.3f of hinted experts "
                   "(per layer recall/precision:%s)\n",
                   double(t.pair_hits) / double(t.pairs),
                   t.set_predicted ? double(t.set_hits) / double(t.set_predicted) : 0.0,
                   layers.c_str());
  }
  if (const RepinStats* r = node.repin_stats())
    std::fprintf(stderr,
                 "re-placement: %llu rounds, %llu of them moved experts (%llu (layer, expert) "
                 "holder changes), placement epoch %u, %.1f ms on the coordinator\n",
                 static_cast<unsigned long long>(r->rounds),
                 static_cast<unsigned long long>(r->changes),
                 static_cast<unsigned long long>(r->moves), node.placement().epoch,
                 double(r->coordinator_us) / 1e3);
}

Tokenizer load_tokenizer(const std::filesystem::path& model_dir) {
  const auto path = model_dir / "tokenizer.json";
  if (!path_present(path, "the tokenizer"))
    fail(
        "{}: missing; text prompts, --chat and --score need the model's tokenizer (use "
        "--prompt-ids)",
        path.string());
  return Tokenizer::load(path);
}

Thinking parse_thinking(const std::string& think) {
  if (think.empty()) return Thinking::kUnset;
  if (think == "on") return Thinking::kOn;
  if (think == "off") return Thinking::kOff;
  fail("--think '{}' must be on or off", think);
}

void TextStream::operator()(int token) const {
  const int one[] = {token};
  const std::string bytes = tokenizer_.decode_bytes(one, /*skip_special=*/true);
  std::fwrite(bytes.data(), 1, bytes.size(), stdout);
  flush_stdout_or_fail();
}

}  // namespace colibri
