#include "coordinator/openai_api.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace colibri {
namespace {

using json = nlohmann::json;

}  // namespace

std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string error_body(const ApiError& e) {
  json error = {{"message", e.what()}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) error["param"] = e.param;
  if (!e.code.empty()) error["code"] = e.code;
  return dump_json({{"error", error}});
}

json usage_json(int prompt_tokens, int completion_tokens, int cached_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

namespace {

// A reply that made calls and stopped on its own ends with "tool_calls"; one cut at max_tokens
// stays "length".
std::string finish_name(FinishReason reason, bool tool_calls) {
  const std::string name = finish_reason_name(reason);
  return tool_calls && name == "stop" ? "tool_calls" : name;
}

// [{index?, id, type: "function", function: {name, arguments}}] (index from `first` when
// streamed).
json tool_calls_json(const std::vector<ToolCall>& calls, size_t first, bool streamed) {
  json out = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    json call = {{"id", calls[k].id},
                 {"type", "function"},
                 {"function", {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}};
    if (streamed) call["index"] = first + k;
    out.push_back(std::move(call));
  }
  return out;
}

json envelope(const ResponseIdentity& who, bool chunk) {
  return {{"id", who.id},
          {"object",
           who.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", who.created},
          {"model", who.model}};
}

std::string sse(const json& j) {
  return "data: " + dump_json(j) + "\n\n";
}

}  // namespace

json logprobs_json(bool chat, const std::vector<TokenLogprob>& logprobs, const Tokenizer& tokenizer,
                   size_t text_offset) {
  const auto text_of = [&](int token) {
    const int one[] = {token};
    return tokenizer.decode_bytes(one, /*skip_special=*/false);
  };
  const auto bytes_of = [](const std::string& text) {
    json bytes = json::array();
    for (unsigned char c : text) bytes.push_back(int(c));
    return bytes;
  };
  if (chat) {
    json content = json::array();
    for (const TokenLogprob& t : logprobs) {
      const std::string text = text_of(t.token);
      json top = json::array();
      for (const auto& [id, logprob] : t.top) {
        const std::string alt = text_of(id);
        top.push_back({{"token", alt}, {"logprob", logprob}, {"bytes", bytes_of(alt)}});
      }
      content.push_back({{"token", text},
                         {"logprob", t.logprob},
                         {"bytes", bytes_of(text)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), tops = json::array(),
       offsets = json::array();
  for (const TokenLogprob& t : logprobs) {
    const std::string text = text_of(t.token);
    tokens.push_back(text);
    token_logprobs.push_back(t.logprob);
    json top = json::object();
    for (const auto& [id, logprob] : t.top) top[text_of(id)] = logprob;
    tops.push_back(top);
    offsets.push_back(text_offset);
    text_offset += text.size();
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

std::string completion_body(const ResponseIdentity& who, const std::vector<Choice>& choices,
                            bool return_token_ids) {
  json j = envelope(who, false);
  j["choices"] = json::array();
  int completion_tokens = 0;
  for (size_t i = 0; i < choices.size(); ++i) {
    const Choice& c = choices[i];
    json choice = {{"index", i},
                   {"logprobs", c.logprobs},
                   {"finish_reason", finish_name(c.finish.finish, !c.tool_calls.empty())}};
    if (who.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      if (!c.tool_calls.empty()) {
        choice["message"]["tool_calls"] = tool_calls_json(c.tool_calls, 0, false);
        if (c.text.empty()) choice["message"]["content"] = nullptr;
      }
      if (c.reasoning)
        choice["message"]["reasoning_content"] =
            c.reasoning->empty() ? json(nullptr) : json(*c.reasoning);
    } else {
      choice["text"] = c.text;
    }
    if (return_token_ids) choice["token_ids"] = c.tokens;
    j["choices"].push_back(choice);
    completion_tokens += c.finish.completion_tokens;
  }
  const ServeEvent& first = choices.front().finish;
  j["usage"] = usage_json(first.prompt_tokens, completion_tokens, first.cached_tokens);
  return dump_json(j);
}

std::string sse_role_chunk(const ResponseIdentity& who, int index) {
  json j = envelope(who, true);
  j["choices"] = json::array({{{"index", index},
                               {"delta", {{"role", "assistant"}, {"content", ""}}},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  j["usage"] = nullptr;
  return sse(j);
}

std::string sse_delta_chunk(const ResponseIdentity& who, const std::string& text,
                            const std::vector<int>& tokens, bool return_token_ids,
                            const json& logprobs, const std::string& reasoning, int index) {
  json j = envelope(who, true);
  json choice = {{"index", index}, {"logprobs", logprobs}, {"finish_reason", nullptr}};
  if (who.chat && !reasoning.empty() && text.empty())
    choice["delta"] = {{"reasoning_content", reasoning}};
  else if (who.chat && !reasoning.empty())
    choice["delta"] = {{"reasoning_content", reasoning}, {"content", text}};
  else if (who.chat)
    choice["delta"] = {{"content", text}};
  else
    choice["text"] = text;
  if (return_token_ids) choice["token_ids"] = tokens;
  j["choices"] = json::array({choice});
  j["usage"] = nullptr;
  return sse(j);
}

std::string sse_tool_calls_chunk(const ResponseIdentity& who, const std::vector<ToolCall>& calls,
                                 size_t first, int index) {
  json j = envelope(who, true);
  j["choices"] = json::array({{{"index", index},
                               {"delta", {{"tool_calls", tool_calls_json(calls, first, true)}}},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  j["usage"] = nullptr;
  return sse(j);
}

std::string sse_finish_chunk(const ResponseIdentity& who, FinishReason reason, int index,
                             bool tool_calls) {
  json j = envelope(who, true);
  json choice = {
      {"index", index}, {"logprobs", nullptr}, {"finish_reason", finish_name(reason, tool_calls)}};
  if (who.chat)
    choice["delta"] = json::object();
  else
    choice["text"] = "";
  j["choices"] = json::array({choice});
  j["usage"] = nullptr;
  return sse(j);
}

std::string sse_usage_chunk(const ResponseIdentity& who, const ServeEvent& finish,
                            int completion_tokens) {
  json j = envelope(who, true);
  j["choices"] = json::array();
  j["usage"] = usage_json(finish.prompt_tokens, completion_tokens, finish.cached_tokens);
  return sse(j);
}

std::string sse_error(const std::string& message, int status) {
  return sse({{"error",
               {{"message", message},
                {"type", status == 503 ? "unavailable_error" : "server_error"},
                {"param", nullptr},
                {"code", status}}}});
}

}  // namespace colibri
