// Offline generation: from --prompt-ids or a text prompt, one sequence streamed as it decodes or
// --sequences N decoded together.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <functional>

#include "common/output_file.h"
#include "coordinator/batch_generate.h"
#include "node/run_modes.h"

namespace colibri {
namespace {

// One sequence streams its tokens through `stream`; --sequences N > 1 decodes N copies of the
// request together (seeds seed, seed + 1, ...) and prints each one's `render`ed tokens at the end.
GenerateOutcome generate_sequences(
    Node& node, const CommandLine& args, const GenerateRequest& request,
    const std::function<void(int)>& stream,
    const std::function<std::string(const std::vector<int>&)>& render) {
  Engine& engine = node.engine();
  GenerateOutcome outcome;
  RunSummary& run = outcome.run;
  run.prefill_tokens = int(request.prompt.size()) * args.sequences;
  if (args.sequences == 1) {
    const int seq = engine.open_sequence();
    GenerateResult result =
        colibri::generate(sequence_forward(engine, seq), node.config().vocab_size, request, stream,
                          engine.profiler());
    engine.close_sequence(seq);
    run.prefill_seconds = result.prefill_seconds;
    run.decode_tokens = std::max(0, int(result.tokens.size()) - 1);
    run.decode_seconds = result.decode_seconds;
    run.ttft_seconds = result.ttft_seconds;
    outcome.logits = std::move(result.logits);
    std::fputs("\n", stdout);
    return outcome;
  }
  std::vector<GenerateRequest> requests(size_t(args.sequences), request);
  for (size_t i = 0; i < requests.size(); ++i) requests[i].sampling.seed = args.seed + i;
  BatchGenerateStats stats;
  const std::vector<GenerateResult> results = generate_batch(engine, requests, {}, &stats);
  for (size_t i = 0; i < results.size(); ++i) {
    std::printf("[sequence %zu] %s\n", i, render(results[i].tokens).c_str());
    run.prefill_seconds = std::max(run.prefill_seconds, results[i].ttft_seconds);
  }
  run.ttft_seconds = results.front().ttft_seconds;
  run.decode_tokens = stats.decode_only_tokens;  // steps of decode rows only
  run.decode_seconds = stats.decode_seconds;
  return outcome;
}

}  // namespace

GenerateRequest generate_request_of(const ModelConfig& config, const CommandLine& args) {
  GenerateRequest request;
  request.max_new_tokens = args.ngen;
  request.sampling.temperature = args.temperature;
  request.sampling.top_p = args.top_p;
  request.sampling.seed = args.seed;
  if (!args.ignore_eos) request.stop_ids = config.generation.eos_token_ids;
  request.keep_logits = !args.logits_out.empty();
  request.prefill_chunk = args.node.max_rows;
  return request;
}

GenerateOutcome run_generate_ids(Node& node, const CommandLine& args, GenerateRequest request) {
  request.prompt = parse_ids(args.prompt_ids);
  check_context(node.config(), request.prompt.size(), args.ngen, request.keep_logits);
  return generate_sequences(
      node, args, request,
      [](int token) {
        std::fprintf(stdout, "%d ", token);
        flush_stdout_or_fail();
      },
      [](const std::vector<int>& tokens) { return fmt::format("{}", fmt::join(tokens, " ")); });
}

GenerateOutcome run_generate_text(Node& node, const CommandLine& args, const Tokenizer& tokenizer,
                                  GenerateRequest request) {
  const ModelConfig& config = node.config();
  const std::string prompt = args.prompt.empty() ? std::string(kDefaultPrompt) : args.prompt;
  const ChatFormat format = chat_format_for(config);
  std::string shown_prompt;
  if (args.chat_format) {
    request.prompt =
        tokenizer.encode(render_chat(format, {{"user", prompt}}, true, parse_thinking(args.think)));
    if (!args.ignore_eos) request.stop_ids = chat_stop_ids(format, config, tokenizer);
  } else {
    request.prompt = tokenizer.encode(prompt);
    shown_prompt = prompt;
  }
  check_context(config, request.prompt.size(), args.ngen, request.keep_logits);
  if (!args.chat_format && args.sequences == 1) std::fputs(prompt.c_str(), stdout);
  return generate_sequences(node, args, request, TextStream(tokenizer),
                            [&](const std::vector<int>& tokens) {
                              return shown_prompt + tokenizer.decode(tokens, /*skip_special=*/true);
                            });
}

}  // namespace colibri
