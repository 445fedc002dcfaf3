// What a rank runs once the start-up checks agreed: an expert rank serves the coordinator; the
// coordinator generates (one sequence, or --sequences N together), chats (--chat), scores a file
// (--score) or serves HTTP (--serve), then gathers every rank's report and prints or writes it.
// One file a mode: run_generate.cpp, run_chat.cpp, run_score.cpp, run_serve.cpp.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "common/profile.h"
#include "coordinator/chat.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "node/command_line.h"
#include "node/node.h"
#include "tokenizer/tokenizer.h"

namespace colibri {

// This rank's whole run after the start-up checks (main hands over here); returns the exit code.
// Collective over MPI_COMM_WORLD.
int run_node(const CommandLine& args);

// What an offline generation leaves for the end of the run: its speed, and the logits of every
// position it fed when --logits-out keeps them ([positions, vocab]).
struct GenerateOutcome {
  RunSummary run;
  std::vector<float> logits;
};

// The request of an offline run from its flags (ngen, sampling, stop ids, --logits-out); the
// prompt is the mode's to fill.
GenerateRequest generate_request_of(const ModelConfig& config, const CommandLine& args);

// --prompt-ids: generates from the given ids and prints the new ids.
GenerateOutcome run_generate_ids(Node& node, const CommandLine& args, GenerateRequest request);

// A text prompt (--prompt, or the default one; --chat-format renders it as a user message):
// generates and prints the text.
GenerateOutcome run_generate_text(Node& node, const CommandLine& args, const Tokenizer& tokenizer,
                                  GenerateRequest request);

// --chat: an interactive conversation on stdin/stdout; the KV cache keeps the whole conversation
// (with --kv-file, on disk across runs too).
void run_chat(Node& node, const CommandLine& args, const Tokenizer& tokenizer,
              GenerateRequest request);

// --score: every token's negative log-likelihood in a text file, and its perplexity.
void run_score(Node& node, const CommandLine& args, const Tokenizer& tokenizer);

// --serve (built with the HTTP server only): serves until a signal drains the server, then the
// reports; returns the server's exit code.
int run_serve(Node& node, const CommandLine& args);

// One line on how well --prefetch-ahead predicted, one on what live re-placement did
// (--repin-every); nothing when `quiet`.
void print_repin(Node& node, bool quiet);

// The model's tokenizer.json; refused with a hint when the model has none.
Tokenizer load_tokenizer(const std::filesystem::path& model_dir);

// --think: "on", "off" or "" (the chat template's default).
Thinking parse_thinking(const std::string& think);

// Prints generated tokens as text as they arrive; special tokens are not printed.
class TextStream {
 public:
  explicit TextStream(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  void operator()(int token) const;

 private:
  const Tokenizer& tokenizer_;
};

}  // namespace colibri
