// colibri-node: run a Mixture-of-Experts model from a Hugging Face directory, alone or as one
// rank of `mpirun -np N colibri-node`.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/npy.h"
#include "model/generate.h"
#include "node/node.h"
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
  std::string prompt_ids, logits_out, profile_json, trace;
  int ngen = 16;
  float temperature = 0.0f, top_p = 1.0f;
  uint64_t seed = 0;
  bool ignore_eos = false, print_placement = false;
};

// Test hook COLIBRI_TEST_FAULT="kill|stop|corrupt:RANK:LAYER": that expert rank kills itself,
// stops itself, or corrupts its reply when serving LAYER.
void install_fault(colibri::NodeOptions& options, int rank) {
  const char* spec = std::getenv("COLIBRI_TEST_FAULT");
  if (!spec) return;
  char kind[16] = {};
  int fault_rank = -1, layer = -1;
  if (std::sscanf(spec, "%15[a-z]:%d:%d", kind, &fault_rank, &layer) != 3)
    fail("COLIBRI_TEST_FAULT='{}' is not KIND:RANK:LAYER", spec);
  if (fault_rank != rank) return;
  const std::string k = kind;
  if (k == "corrupt") {
    options.corrupt_reply_at_layer = layer;
  } else if (k == "kill" || k == "stop") {
    options.signal_at_layer = layer;
    options.signal = k == "kill" ? SIGKILL : SIGSTOP;
  } else {
    fail("COLIBRI_TEST_FAULT kind '{}' is unknown (kill, stop, corrupt)", k);
  }
}

int run(const Args& args, int rank) {
  colibri::Node node(MPI_COMM_WORLD, args.node);
  if (!node.is_coordinator()) {
    node.serve();
    node.gather_reports();
    return 0;
  }
  const colibri::ModelConfig& config = node.config();
  if (args.print_placement)
    std::fputs(colibri::format_placement(node.placement(), node.layout(), node.expert_bytes()).c_str(), stderr);

  colibri::GenerateRequest request;
  request.prompt = parse_ids(args.prompt_ids);
  request.max_new_tokens = args.ngen;
  request.sampling = {args.temperature, args.top_p, args.seed};
  if (!args.ignore_eos) request.stop_ids = config.generation.eos_token_ids;
  request.keep_logits = !args.logits_out.empty();
  request.prefill_chunk = args.node.max_rows;
  const colibri::GenerateResult result = colibri::generate(node.model(), request, [](int token) {
    std::fprintf(stdout, "%d ", token);
    std::fflush(stdout);
  });
  std::fprintf(stdout, "\n");
  std::fflush(stdout);
  node.shutdown();

  if (!args.logits_out.empty()) {
    const int64_t shape[] = {int64_t(result.logits.size()) / config.vocab_size, config.vocab_size};
    colibri::write_npy_f32(args.logits_out, result.logits, shape);
  }
  const std::vector<colibri::RankReport> reports = node.gather_reports();
  colibri::RunSummary run;
  run.prefill_tokens = int(request.prompt.size());
  run.prefill_seconds = result.prefill_seconds;
  run.decode_tokens = std::max(0, int(result.tokens.size()) - 1);
  run.decode_seconds = result.decode_seconds;
  run.ttft_seconds = result.ttft_seconds;
  colibri::print_profile(stderr, reports, run);
  if (!args.profile_json.empty()) colibri::write_profile_json(args.profile_json, reports, run);
  if (!args.trace.empty()) colibri::write_trace(args.trace, reports);
  (void)rank;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  Args args;
  CLI::App app{"colibri-node: Mixture-of-Experts inference across GPUs and CPU memory.\n"
               "Run alone or as `mpirun -np N colibri-node ...` (rank 0 coordinates unless --layout says otherwise)."};
  app.add_option("--model", args.node.model_dir, "Hugging Face model directory")->required()->check(CLI::ExistingDirectory);
  app.add_option("--prompt-ids", args.prompt_ids, "prompt as comma-separated token ids, e.g. 1,2,3")->required();
  app.add_option("--ngen", args.ngen, "number of tokens to generate")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  app.add_option("--temp", args.temperature, "sampling temperature; 0 = greedy")->capture_default_str();
  app.add_option("--top-p", args.top_p, "nucleus sampling mass in (0, 1]")->capture_default_str();
  app.add_option("--seed", args.seed, "random seed for sampling")->capture_default_str();
  app.add_flag("--ignore-eos", args.ignore_eos, "keep generating after an end-of-sequence token");
  app.add_option("--logits-out", args.logits_out,
                 "write the logits of every position (prompt and generated) as float32 .npy [positions, vocab]");
  app.add_option("--layout", args.layout, "layout file: rank -> role, GPU, NUMA node, budgets (default: rank 0 "
                                          "coordinates, the others are expert ranks)");
  app.add_option("--placement", args.placement, "expert placement policy: balanced, round-robin, contiguous")
      ->capture_default_str();
  app.add_flag("--print-placement", args.print_placement, "print the expert placement table at start-up");
  app.add_option("--rank-timeout", args.node.rank_timeout_s,
                 "seconds the coordinator waits for an expert rank within one exchange before aborting")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--max-rows", args.node.max_rows, "rows per forward call (prefill chunk); sizes the exchange buffers")
      ->capture_default_str()->check(CLI::Range(1, 1 << 16));
  app.add_option("--profile-json", args.profile_json, "write the per-rank profile as JSON");
  app.add_option("--trace", args.trace, "write a Chrome/Perfetto trace-event JSON, one process per rank");

  int code = 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (rank == 0) code = app.exit(e);
    else code = e.get_exit_code();
    MPI_Finalize();
    return code;
  }

  try {
    if (!args.layout.empty()) args.node.layout_file = args.layout;
    args.node.placement = colibri::parse_placement_policy(args.placement);
    args.node.keep_trace = !args.trace.empty();
    install_fault(args.node, rank);
    code = run(args, rank);
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
