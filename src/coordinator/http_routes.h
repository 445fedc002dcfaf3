// The handlers of --serve's POST routes (coordinator/http_server.h registers them):
// /v1/chat/completions and /v1/completions (n choices, whole or streamed as server-sent events),
// /tokenize and /detokenize. They run on the HTTP pool's threads: they check a request, submit it
// to the Scheduler and wait on its channel; the engine is the Scheduler's alone.
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/chat.h"
#include "coordinator/http_server.h"
#include "coordinator/openai_api.h"
#include "coordinator/scheduler.h"
#include "coordinator/serve_metrics.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace colibri {

// Answers with the OpenAI error body of `e` and its status.
void reply_error(httplib::Response& res, const ApiError& e);

class ServeApi {
 public:
  ServeApi(Scheduler& scheduler, ServeMetrics& metrics, const Tokenizer& tokenizer,
           const ModelConfig& config, const ServeOptions& options);

  // POST /v1/chat/completions (`chat`) or /v1/completions: submits the request's choices and
  // answers with them whole, or streams them.
  void completions(const std::string& body, httplib::Response& res, bool chat);

  // POST /tokenize (vLLM's): {"prompt": ...} or {"messages": [...]} -> the ids a completion of
  // it would start from (a chat with the assistant's generation prompt).
  void tokenize(const std::string& body, httplib::Response& res);

  // POST /detokenize: {"tokens": [ids]} -> {"prompt": text}, special tokens included.
  void detokenize(const std::string& body, httplib::Response& res);

 private:
  using Jobs = std::vector<std::shared_ptr<ServeJob>>;  // one a choice
  struct StreamState;

  static constexpr int kDefaultMaxTokens = 512;
  static constexpr int kClientClosedRequest = 499;  // counted, never sent

  Thinking thinking_of(const CompletionRequest& r) const;
  // The prompt's ids: a chat rendered in the model's format with the generation prompt.
  std::vector<int> prompt_of(const CompletionRequest& r) const;
  void handle(const std::string& body, httplib::Response& res, bool chat);
  // The scheduler's request for `r`: prompt, stop ids, max_tokens against the context and the KV
  // pool (refused with the numbers), sampling.
  ServeRequest serve_request_of(const CompletionRequest& r, bool chat);
  // Submits every choice; when one is refused, cancels those submitted and throws the refusal.
  void submit(const Jobs& jobs, httplib::Response& res);
  uint64_t next_seed();
  void whole(httplib::Response& res, const Jobs& jobs, const ResponseIdentity& who,
             const CompletionRequest& r);
  void stream(httplib::Response& res, const Jobs& jobs, const ResponseIdentity& who,
              const CompletionRequest& r);
  // One call of the stream's content provider: the events that arrived, written as chunks (or a
  // keep-alive); false when the client is gone.
  static bool stream_step(StreamState& state, httplib::DataSink& sink);
  // The chunk of choice i's new calls (none past the first without parallel_tool_calls).
  static std::string tool_calls_out(StreamState& state, size_t i, std::vector<ToolCall> calls);

  Scheduler& scheduler_;
  ServeMetrics& metrics_;
  const Tokenizer& tokenizer_;
  const ModelConfig& config_;
  const ServeOptions& options_;
  ChatFormat format_;
  std::vector<int> chat_stop_ids_;
  std::optional<int> think_open_, think_close_;  // the thinking block's markers, when tokens
  OutputGrammars grammars_;  // response_format and forced tool calls, compiled per request
  std::atomic<uint64_t> ids_{0};
};

}  // namespace colibri
