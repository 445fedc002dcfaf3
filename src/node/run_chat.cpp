// --chat: one conversation on stdin/stdout, the model's chat format, the KV cache holding every
// turn (and with --kv-file, a file holding it across runs).
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <iostream>
#include <optional>

#include "common/error.h"
#include "common/output_file.h"
#include "coordinator/kv_file.h"
#include "node/run_modes.h"

namespace colibri {
namespace {

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

// --kv-file: the conversation so far comes back into `seq` without a prefill; each turn is
// appended to the file.
void restore_conversation(std::optional<KvFile>& kv_file, Node& node, const CommandLine& args,
                          int seq, std::vector<ChatMessage>& messages) {
  kv_file.emplace(args.kv_file, node.config(), node.model_identity());
  std::vector<std::string> notes;
  const std::vector<int> ids = kv_file->restore(node.engine().kv(), seq, notes);
  for (const std::string& note : notes) std::fprintf(stderr, "(%s)\n", note.c_str());
  if (!ids.empty()) {
    std::fprintf(stderr, "(continuing the conversation in %s: %zu tokens, no prefill)\n",
                 args.kv_file.c_str(), ids.size());
    messages.push_back({"history", ""});  // rendered already: new turns follow it
  }
}

// Appends the positions a turn added to the file: its prompt and the reply, but the last token
// when it was not fed (a final stop token, or the last of --ngen).
void append_turn(KvFile& kv_file, Engine& engine, int seq, int before,
                 const std::vector<int>& prompt, const std::vector<int>& generated) {
  std::vector<int> turn = prompt;
  turn.insert(turn.end(), generated.begin(), generated.end());
  const int grew = engine.length(seq) - before;
  if (grew > int(turn.size()) || grew + 1 < int(turn.size()))
    fail("--kv-file: the turn holds {} tokens but the sequence grew by {}", turn.size(), grew);
  turn.resize(size_t(grew));
  kv_file.append(engine.kv(), seq, before, turn);
}

}  // namespace

void run_chat(Node& node, const CommandLine& args, const Tokenizer& tokenizer,
              GenerateRequest request) {
  const ChatFormat format = chat_format_for(node.config());
  request.stop_ids = chat_stop_ids(format, node.config(), tokenizer);
  Engine& engine = node.engine();
  const int seq = engine.open_sequence();
  const ForwardFn forward = sequence_forward(engine, seq);
  std::vector<ChatMessage> messages;
  std::optional<KvFile> kv_file;
  if (!args.kv_file.empty()) restore_conversation(kv_file, node, args, seq, messages);
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
        render_chat(format, messages, true, parse_thinking(args.think), rendered);
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
      request.prompt =
          tokenizer.encode(render_chat(format, messages, true, parse_thinking(args.think), 0));
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
    const GenerateResult result =
        colibri::generate(forward, node.config().vocab_size, request, stream, engine.profiler());
    std::fputs("\n", stdout);
    flush_stdout_or_fail();
    std::vector<int> reply = result.tokens;
    if (!reply.empty() &&
        std::count(request.stop_ids.begin(), request.stop_ids.end(), reply.back()))
      reply.pop_back();
    if (kv_file) append_turn(*kv_file, engine, seq, before, request.prompt, result.tokens);
    messages.push_back({"assistant", tokenizer.decode(reply, true)});
    if (engine.length(seq) + request.max_new_tokens + 64 > node.config().max_position_embeddings) {
      std::fputs("(context is full; starting a new conversation)\n", stderr);
      new_conversation();
      messages.clear();
    }
  }
}

}  // namespace colibri
