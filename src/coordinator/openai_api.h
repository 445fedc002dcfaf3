// The OpenAI wire format of POST /v1/chat/completions and /v1/completions: request bodies parsed
// and checked field by field (wrong types or values are an ApiError naming the field; unknown
// fields are ignored, as OpenAI clients expect), and the JSON of responses, stream chunks and
// error bodies ({"error": {"message", "type", "param", "code"}}).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/chat.h"
#include "coordinator/output_grammar.h"
#include "coordinator/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace colibri {

class ApiError : public std::runtime_error {
 public:
  ApiError(int http_status, const std::string& message, std::string field = {},
           std::string error_code = "invalid_value",
           std::string error_type = "invalid_request_error")
      : std::runtime_error(message),
        status(http_status),
        param(std::move(field)),
        code(std::move(error_code)),
        type(std::move(error_type)) {}
  int status;
  std::string param, code, type;
};

struct CompletionRequest {
  bool chat = false;
  std::vector<ChatMessage> messages;  // chat
  std::string prompt_text;            // completions: text ...
  std::vector<int> prompt_ids;        // ... or token ids
  bool prompt_is_ids = false;
  std::optional<int64_t> max_tokens;  // max_tokens or max_completion_tokens
  float temperature = 1.0f;
  float top_p = 1.0f;
  std::optional<uint64_t> seed;
  int top_k = 0;  // top_k: -1 and 0 are off
  float min_p = 0.0f;
  float presence_penalty = 0.0f, frequency_penalty = 0.0f, repetition_penalty = 1.0f;
  std::vector<std::pair<int, float>> logit_bias;  // {"<token id>": bias}
  std::vector<std::string> stop;
  std::vector<int> stop_token_ids;  // extension (vLLM): generation ends after one of these
  // Log-probabilities of the sampled tokens, each with this many most likely alternatives;
  // -1: none (chat: logprobs + top_logprobs; completions: logprobs N).
  int logprobs = -1;
  int n = 1;  // choices, each its own sequence (seeds seed, seed + 1, ...)
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage
  bool ignore_eos = false;        // extension (vLLM): keep going after end-of-sequence ids
  bool return_token_ids = false;  // extension (vLLM): the generated ids in every choice
  // Chat: the thinking block on or off (chat_template_kwargs.enable_thinking or .thinking,
  // reasoning_effort "none" or not); unset: the server's --think.
  std::optional<bool> thinking;
  // Chat: the functions the model may call (tools, with tool_choice "auto", "required" or a
  // named function; none with "none"), and whether a reply may make more than one call (the
  // first only when false).
  std::vector<Tool> tools;
  bool parallel_tool_calls = true;
  // What the reply must be: free, response_format's JSON, or tool_choice's forced calls.
  OutputRule output;
};

// Parses a request body; throws ApiError (400) naming the field at fault. `vocab` bounds token
// ids (of a prompt given as ids, logit_bias, stop_token_ids). A field that would change the
// response and is not supported (echo, suffix, best_of, ...) is refused, never ignored.
CompletionRequest parse_completion_request(std::string_view body, bool chat, int vocab);

// Most choices (n) one request may ask for.
inline constexpr int kMaxChoices = 16;

// {"error": {...}} of an ApiError.
std::string error_body(const ApiError& error);

// Identity of one response: the same id and created time in every chunk.
struct ResponseIdentity {
  std::string id;
  int64_t created = 0;
  std::string model;
  bool chat = true;
};

nlohmann::json usage_json(int prompt_tokens, int completion_tokens, int cached_tokens);

// The "logprobs" of a choice for these tokens: chat {"content": [{token, logprob, bytes,
// top_logprobs}]}, completions {tokens, token_logprobs, top_logprobs, text_offset} (offsets from
// `text_offset`, the bytes of text before the first of them).
nlohmann::json logprobs_json(bool chat, const std::vector<TokenLogprob>& logprobs,
                             const Tokenizer& tokenizer, size_t text_offset = 0);

// One choice of a whole (non-streamed) response; `logprobs` null when not asked for; `reasoning`
// (the thinking block, as message.reasoning_content) only for a chat whose reply is split.
struct Choice {
  std::string text;
  std::vector<int> tokens;
  ServeEvent finish;
  nlohmann::json logprobs = nullptr;
  std::optional<std::string> reasoning;
  std::vector<ToolCall> tool_calls;  // chat: the calls read from the reply (its text the rest)
};

// A whole response: choices with index 0, 1, ... in order; usage the prompt once and every
// choice's completion tokens.
std::string completion_body(const ResponseIdentity& who, const std::vector<Choice>& choices,
                            bool return_token_ids);

// One server-sent event "data: {...}\n\n": the first chunk of a chat stream (role), a text
// delta, the finish chunk, the usage chunk (choices: []), an error.
// `index`: the choice the chunk is of.
std::string sse_role_chunk(const ResponseIdentity& who, int index = 0);
std::string sse_delta_chunk(const ResponseIdentity& who, const std::string& text,
                            const std::vector<int>& tokens, bool return_token_ids,
                            const nlohmann::json& logprobs = nullptr,
                            const std::string& reasoning = {}, int index = 0);
// The calls of a chat's reply as a delta ({"tool_calls": [{index, id, type, function: {name,
// arguments}}]}), numbered from `first` within the choice.
std::string sse_tool_calls_chunk(const ResponseIdentity& who, const std::vector<ToolCall>& calls,
                                 size_t first, int index = 0);
// `tool_calls`: the reply made calls (finish_reason "tool_calls" when it stopped on its own).
std::string sse_finish_chunk(const ResponseIdentity& who, FinishReason reason, int index = 0,
                             bool tool_calls = false);
// Usage of the whole response: the prompt once, the completion tokens of every choice.
std::string sse_usage_chunk(const ResponseIdentity& who, const ServeEvent& finish,
                            int completion_tokens);
std::string sse_error(const std::string& message, int status);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// JSON text; bytes that are not UTF-8 become U+FFFD rather than an exception.
std::string dump_json(const nlohmann::json& j);

}  // namespace colibri
