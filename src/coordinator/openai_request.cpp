// The request side of the OpenAI wire format: parse_completion_request and its field checks.
#include "coordinator/openai_api.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

namespace colibri {
namespace {

using json = nlohmann::json;

std::string type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a number with a fraction";
    default:
      return "an integer";
  }
}

[[noreturn]] void wrong_type(const std::string& field, const char* expected, const json& v) {
  throw ApiError(400, fmt::format("'{}' must be {}, not {}", field, expected, type_name(v)), field,
                 "invalid_type");
}

bool get_bool(const json& v, const std::string& field) {
  if (!v.is_boolean()) wrong_type(field, "a boolean", v);
  return v.get<bool>();
}

double get_number(const json& v, const std::string& field, double lo, double hi) {
  if (!v.is_number()) wrong_type(field, "a number", v);
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    throw ApiError(400, fmt::format("'{}' must be a number in [{}, {}]", field, lo, hi), field);
  return x;
}

std::string get_string(const json& v, const std::string& field) {
  if (!v.is_string()) wrong_type(field, "a string", v);
  return v.get<std::string>();
}

// Message content: a string, or an array of {"type": "text", "text": ...} parts.
std::string get_content(const json& v, const std::string& field, bool null_ok) {
  if (v.is_null() && null_ok) return {};
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) wrong_type(field, "a string or an array of text parts", v);
  std::string text;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string part = fmt::format("{}[{}]", field, i);
    const json& p = v[i];
    if (!p.is_object()) wrong_type(part, "an object", p);
    const auto type = p.find("type");
    if (type == p.end() || !type->is_string() || *type != "text")
      throw ApiError(
          400, fmt::format("'{}.type' must be \"text\" (only text content is supported)", part),
          part + ".type");
    const auto t = p.find("text");
    if (t == p.end())
      throw ApiError(400, fmt::format("'{}.text' is missing", part), part + ".text",
                     "missing_field");
    text += get_string(*t, part + ".text");
  }
  return text;
}

int get_token(const json& v, const std::string& field, int vocab) {
  if (!v.is_number_integer()) wrong_type(field, "an integer token id", v);
  const int64_t value = v.get<int64_t>();
  if (value < 0 || value >= vocab ||
      (v.is_number_unsigned() && v.get<uint64_t>() >= uint64_t(vocab)))
    throw ApiError(400, fmt::format("'{}' = {} is not a token id in [0, {})", field, value, vocab),
                   field);
  return int(value);
}

const json* find_field(const json& j, const char* name) {
  const auto it = j.find(name);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

// top_k, min_p, the penalties, logit_bias and logprobs (the OpenAI and vLLM fields).
void parse_sampling(const json& j, CompletionRequest& r, int vocab) {
  if (const json* v = find_field(j, "top_k")) {
    if (!v->is_number_integer()) wrong_type("top_k", "an integer", *v);
    const int64_t k = v->get<int64_t>();
    if (k < -1 || (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(vocab)))
      throw ApiError(400, "'top_k' must be -1 or 0 (off) or a number of tokens", "top_k");
    r.top_k = k <= 0 ? 0 : int(std::min<int64_t>(k, vocab));
  }
  if (const json* v = find_field(j, "min_p")) r.min_p = float(get_number(*v, "min_p", 0, 1));
  if (const json* v = find_field(j, "presence_penalty"))
    r.presence_penalty = float(get_number(*v, "presence_penalty", -2, 2));
  if (const json* v = find_field(j, "frequency_penalty"))
    r.frequency_penalty = float(get_number(*v, "frequency_penalty", -2, 2));
  if (const json* v = find_field(j, "repetition_penalty")) {
    r.repetition_penalty = float(get_number(*v, "repetition_penalty", 0, 10));
    if (r.repetition_penalty <= 0)
      throw ApiError(400, "'repetition_penalty' must be in (0, 10]", "repetition_penalty");
  }
  if (const json* v = find_field(j, "logit_bias")) {
    if (!v->is_object()) wrong_type("logit_bias", "an object of token ids to numbers", *v);
    for (const auto& [key, bias] : v->items()) {
      const std::string f = fmt::format("logit_bias.{}", key);
      int token = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), token);
      if (ec != std::errc() || end != key.data() + key.size() || token < 0 || token >= vocab)
        throw ApiError(
            400, fmt::format("'logit_bias' key '{}' is not a token id in [0, {})", key, vocab),
            "logit_bias");
      r.logit_bias.emplace_back(token, float(get_number(bias, f, -100, 100)));
    }
  }
  constexpr int kMaxTopLogprobs = 20;
  if (r.chat) {
    const json* v = find_field(j, "logprobs");
    const bool wanted = v && get_bool(*v, "logprobs");
    int top = 0;
    if (const json* t = find_field(j, "top_logprobs")) {
      if (!t->is_number_integer()) wrong_type("top_logprobs", "an integer", *t);
      if (t->get<int64_t>() < 0 || t->get<int64_t>() > kMaxTopLogprobs)
        throw ApiError(400, fmt::format("'top_logprobs' must be in [0, {}]", kMaxTopLogprobs),
                       "top_logprobs");
      top = int(t->get<int64_t>());
      if (!wanted && top > 0)
        throw ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs");
    }
    if (wanted) r.logprobs = top;
  } else if (const json* v = find_field(j, "logprobs")) {
    if (!v->is_number_integer()) wrong_type("logprobs", "an integer", *v);
    if (v->get<int64_t>() < 0 || v->get<int64_t>() > kMaxTopLogprobs)
      throw ApiError(400, fmt::format("'logprobs' must be in [0, {}]", kMaxTopLogprobs),
                     "logprobs");
    r.logprobs = int(v->get<int64_t>());
  }
}

// The thinking block: chat_template_kwargs.enable_thinking (GLM, vLLM) or .thinking (DeepSeek),
// else reasoning_effort ("none": off; minimal, low, medium, high: on).
void parse_thinking(const json& j, CompletionRequest& r) {
  if (const json* v = find_field(j, "reasoning_effort")) {
    const std::string effort = get_string(*v, "reasoning_effort");
    if (effort != "none" && effort != "minimal" && effort != "low" && effort != "medium" &&
        effort != "high")
      throw ApiError(400, "'reasoning_effort' must be none, minimal, low, medium or high",
                     "reasoning_effort");
    r.thinking = effort != "none";
  }
  if (const json* v = find_field(j, "chat_template_kwargs")) {
    if (!v->is_object()) wrong_type("chat_template_kwargs", "an object", *v);
    for (const char* name : {"enable_thinking", "thinking"})
      if (const json* t = find_field(*v, name))
        r.thinking = get_bool(*t, fmt::format("chat_template_kwargs.{}", name));
  }
}

[[noreturn]] void not_supported(const std::string& field, const std::string& what) {
  throw ApiError(400, fmt::format("'{}' is not supported: {}", field, what), field,
                 "not_supported");
}

// Fields that would change what the response holds and that this server does not do: refused
// with their name, never ignored. (Informational fields, such as user, metadata, store and
// service_tier, are accepted as they change nothing.)
void refuse_unsupported(const json& j, bool chat) {
  if (!chat) {
    if (const json* v = find_field(j, "tools"); v && !(v->is_array() && v->empty()))
      not_supported("tools", "tool calls are a chat's (/v1/chat/completions)");
    if (const json* v = find_field(j, "tool_choice"); v && !(v->is_string() && *v == "none"))
      not_supported("tool_choice", "tool calls are a chat's (/v1/chat/completions)");
  }
  for (const char* legacy : {"functions", "function_call"})
    if (find_field(j, legacy)) not_supported(legacy, "this server does not parse function calls");
  if (chat) return;
  if (const json* v = find_field(j, "echo"); v && get_bool(*v, "echo"))
    not_supported("echo", "the prompt is not returned");
  if (const json* v = find_field(j, "suffix");
      v && !(v->is_string() && v->get<std::string>().empty()))
    not_supported("suffix", "no insertion");
  if (const json* v = find_field(j, "best_of")) {
    if (!v->is_number_integer()) wrong_type("best_of", "an integer", *v);
    if (v->get<int64_t>() != 1) not_supported("best_of", "one candidate per request");
  }
}

// A function name as OpenAI allows it: 1-64 of a-z, A-Z, 0-9, _ and - (and . as some clients use).
bool valid_tool_name(const std::string& name) {
  return !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

// response_format: {"type": "text"} (free), {"type": "json_object"}, or {"type": "json_schema",
// "json_schema": {"name", "schema", "strict"}}.
OutputRule parse_response_format(const json& j) {
  OutputRule rule;
  const json* v = find_field(j, "response_format");
  if (!v) return rule;
  if (!v->is_object()) wrong_type("response_format", "an object", *v);
  const auto type = v->find("type");
  if (type == v->end())
    throw ApiError(400, "'response_format.type' is missing", "response_format.type",
                   "missing_field");
  const std::string kind = get_string(*type, "response_format.type");
  if (kind == "text") return rule;
  if (kind == "json_object") {
    rule.kind = OutputRule::Kind::kJsonObject;
    return rule;
  }
  if (kind != "json_schema")
    throw ApiError(400,
                   fmt::format("'response_format.type' is '{}'; supported are text, json_object "
                               "and json_schema",
                               kind),
                   "response_format.type");
  const auto spec = v->find("json_schema");
  if (spec == v->end() || !spec->is_object())
    throw ApiError(400, "'response_format.json_schema' must be an object with a 'schema'",
                   "response_format.json_schema");
  const auto schema = spec->find("schema");
  if (schema == spec->end() || !(schema->is_object() || schema->is_boolean()))
    throw ApiError(400, "'response_format.json_schema.schema' must be a JSON Schema (an object)",
                   "response_format.json_schema.schema");
  rule.kind = OutputRule::Kind::kJsonSchema;
  rule.schema = schema->dump();
  if (const auto strict = spec->find("strict"); strict != spec->end() && !strict->is_null())
    rule.strict = get_bool(*strict, "response_format.json_schema.strict");
  return rule;
}

// "tools" and "tool_choice" of a chat request: the functions offered, their objects in the order
// the client wrote them (the body parsed again keeping key order, only when tools are offered).
// tool_choice "none" offers none; "required" and a named function ({"type": "function",
// "function": {"name"}}) set `forced` to a tool-call rule, enforced by constrained decoding.
std::vector<Tool> parse_tools(const json& j, std::string_view body, OutputRule& forced) {
  const json* tools = find_field(j, "tools");
  const json* choice = find_field(j, "tool_choice");
  if (!tools || (tools->is_array() && tools->empty())) {
    if (choice && !(choice->is_string() && *choice == "none"))
      throw ApiError(400, "'tool_choice' needs 'tools' to choose from", "tool_choice");
    return {};
  }
  if (!tools->is_array()) wrong_type("tools", "an array", *tools);
  std::string named;  // the function tool_choice names
  if (choice) {
    if (choice->is_string() && *choice == "none") return {};
    if (choice->is_object()) {
      const auto function = choice->find("function");
      const json* name = function != choice->end() && function->is_object()
                             ? find_field(*function, "name")
                             : nullptr;
      if (choice->value("type", std::string()) != "function" || !name || !name->is_string())
        throw ApiError(400,
                       "'tool_choice' as an object must be {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}",
                       "tool_choice");
      named = name->get<std::string>();
      forced.kind = OutputRule::Kind::kToolCalls;
      forced.named = true;
    } else if (choice->is_string() && *choice == "required") {
      forced.kind = OutputRule::Kind::kToolCalls;
    } else if (!(choice->is_string() && *choice == "auto")) {
      throw ApiError(400,
                     fmt::format("'tool_choice' is {}; supported are \"none\", \"auto\", "
                                 "\"required\" and a named function",
                                 choice->dump()),
                     "tool_choice");
    }
  }
  const auto ordered = nlohmann::ordered_json::parse(body.begin(), body.end());
  std::vector<Tool> out;
  for (size_t i = 0; i < tools->size(); ++i) {
    const std::string f = fmt::format("tools[{}]", i);
    const json& t = (*tools)[i];
    if (!t.is_object()) wrong_type(f, "an object", t);
    if (t.value("type", std::string()) != "function")
      throw ApiError(400, fmt::format("'{}.type' must be \"function\"", f), f + ".type");
    const auto function = t.find("function");
    if (function == t.end() || !function->is_object())
      throw ApiError(400, fmt::format("'{}.function' must be an object", f), f + ".function");
    const auto name = function->find("name");
    if (name == function->end())
      throw ApiError(400, fmt::format("'{}.function.name' is missing", f), f + ".function.name",
                     "missing_field");
    const std::string n = get_string(*name, f + ".function.name");
    if (!valid_tool_name(n))
      throw ApiError(
          400,
          fmt::format("'{}.function.name' '{}' is not 1-64 of a-z, A-Z, 0-9, _, - and .", f, n),
          f + ".function.name");
    if (const auto p = function->find("parameters"); p != function->end() && !p->is_object())
      wrong_type(f + ".function.parameters", "an object (a JSON Schema)", *p);
    for (const Tool& earlier : out)
      if (earlier.name == n)
        throw ApiError(400, fmt::format("'{}.function.name' '{}' is offered twice", f, n),
                       f + ".function.name");
    out.push_back({n, ordered["tools"][i]});
  }
  if (forced.named) {
    const auto it =
        std::find_if(out.begin(), out.end(), [&](const Tool& t) { return t.name == named; });
    if (it == out.end())
      throw ApiError(400,
                     fmt::format("'tool_choice' names '{}', which 'tools' does not offer", named),
                     "tool_choice.function.name");
    forced.tools = {*it};
  } else if (forced.kind == OutputRule::Kind::kToolCalls) {
    forced.tools = out;
  }
  return out;
}

// An assistant message's "tool_calls": [{id, type: "function", function: {name, arguments}}],
// arguments the text of a JSON object.
std::vector<ToolCall> parse_message_tool_calls(const json& calls, const std::string& f) {
  if (!calls.is_array()) wrong_type(f, "an array", calls);
  std::vector<ToolCall> out;
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string c = fmt::format("{}[{}]", f, i);
    const json& call = calls[i];
    if (!call.is_object()) wrong_type(c, "an object", call);
    const auto function = call.find("function");
    if (function == call.end() || !function->is_object())
      throw ApiError(400, fmt::format("'{}.function' must be an object", c), c + ".function");
    ToolCall t;
    if (const auto id = call.find("id"); id != call.end()) t.id = get_string(*id, c + ".id");
    const auto name = function->find("name");
    if (name == function->end())
      throw ApiError(400, fmt::format("'{}.function.name' is missing", c), c + ".function.name",
                     "missing_field");
    t.name = get_string(*name, c + ".function.name");
    const auto arguments = function->find("arguments");
    t.arguments =
        arguments == function->end() ? "{}" : get_string(*arguments, c + ".function.arguments");
    const json parsed = json::parse(t.arguments, nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object())
      throw ApiError(400,
                     fmt::format("'{}.function.arguments' is not the text of a JSON object", c),
                     c + ".function.arguments");
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

CompletionRequest parse_completion_request(std::string_view body, bool chat, int vocab) {
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    throw ApiError(400, fmt::format("the body is not valid JSON: {}", e.what()), {},
                   "invalid_json");
  }
  if (!j.is_object()) throw ApiError(400, "the body must be a JSON object", {}, "invalid_json");
  CompletionRequest r;
  r.chat = chat;
  const auto field = [&](const char* name) -> const json* {
    const auto it = j.find(name);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };

  if (const json* m = field("model")) get_string(*m, "model");
  if (chat) {
    const json* messages = field("messages");
    if (!messages) throw ApiError(400, "'messages' is missing", "messages", "missing_field");
    if (!messages->is_array()) wrong_type("messages", "an array", *messages);
    if (messages->empty()) throw ApiError(400, "'messages' is empty", "messages");
    for (size_t i = 0; i < messages->size(); ++i) {
      const std::string f = fmt::format("messages[{}]", i);
      const json& m = (*messages)[i];
      if (!m.is_object()) wrong_type(f, "an object", m);
      const auto role = m.find("role");
      if (role == m.end())
        throw ApiError(400, fmt::format("'{}.role' is missing", f), f + ".role", "missing_field");
      std::string role_name = get_string(*role, f + ".role");
      if (role_name == "developer") role_name = "system";
      if (role_name != "system" && role_name != "user" && role_name != "assistant" &&
          role_name != "tool")
        throw ApiError(400,
                       fmt::format("'{}.role' is '{}'; supported roles are system, developer, "
                                   "user, assistant, tool",
                                   f, role_name),
                       f + ".role");
      const auto content = m.find("content");
      if (content == m.end() && role_name != "assistant")
        throw ApiError(400, fmt::format("'{}.content' is missing", f), f + ".content",
                       "missing_field");
      ChatMessage message{role_name,
                          content == m.end()
                              ? std::string()
                              : get_content(*content, f + ".content", role_name == "assistant"),
                          {},
                          {}};
      if (const auto calls = m.find("tool_calls");
          calls != m.end() && !calls->is_null() && role_name == "assistant")
        message.tool_calls = parse_message_tool_calls(*calls, f + ".tool_calls");
      if (const auto id = m.find("tool_call_id"); id != m.end() && role_name == "tool")
        message.tool_call_id = get_string(*id, f + ".tool_call_id");
      r.messages.push_back(std::move(message));
    }
    r.tools = parse_tools(j, body, r.output);
    if (const json* v = field("parallel_tool_calls"))
      r.parallel_tool_calls = get_bool(*v, "parallel_tool_calls");
    r.output.parallel = r.parallel_tool_calls;
  } else {
    const json* prompt = field("prompt");
    if (!prompt) throw ApiError(400, "'prompt' is missing", "prompt", "missing_field");
    if (prompt->is_string()) {
      r.prompt_text = prompt->get<std::string>();
    } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
      r.prompt_text = (*prompt)[0].get<std::string>();
    } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
      r.prompt_is_ids = true;
      for (size_t i = 0; i < prompt->size(); ++i) {
        const json& id = (*prompt)[i];
        const std::string f = fmt::format("prompt[{}]", i);
        if (!id.is_number_integer()) wrong_type(f, "an integer token id", id);
        const int64_t value = id.get<int64_t>();
        if (value < 0 || value >= vocab ||
            (id.is_number_unsigned() && id.get<uint64_t>() >= uint64_t(vocab)))
          throw ApiError(400,
                         fmt::format("'{}' = {} is not a token id in [0, {})", f, value, vocab), f);
        r.prompt_ids.push_back(int(value));
      }
    } else {
      throw ApiError(400,
                     "'prompt' must be a string, an array of one string, or an array of token ids",
                     "prompt", "invalid_type");
    }
    if (!r.prompt_is_ids && r.prompt_text.empty())
      throw ApiError(400, "'prompt' is empty", "prompt");
  }
  if (OutputRule format = parse_response_format(j); !format.free()) {
    if (!r.output.free() || !r.tools.empty())
      throw ApiError(400,
                     "'response_format' other than text cannot go with tools offered (send "
                     "tool_choice \"none\" for a structured reply)",
                     "response_format");
    r.output = std::move(format);
  }

  for (const char* name : {"max_tokens", "max_completion_tokens"}) {
    const json* v = field(name);
    if (!v) continue;
    if (!v->is_number_integer()) wrong_type(name, "an integer", *v);
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      r.max_tokens = std::numeric_limits<int64_t>::max();
    else
      r.max_tokens = v->get<int64_t>();
    if (*r.max_tokens < 1) throw ApiError(400, fmt::format("'{}' must be at least 1", name), name);
  }
  if (const json* v = field("temperature"))
    r.temperature = float(get_number(*v, "temperature", 0, 2));
  if (const json* v = field("top_p")) {
    r.top_p = float(get_number(*v, "top_p", 0, 1));
    if (r.top_p <= 0) throw ApiError(400, "'top_p' must be in (0, 1]", "top_p");
  }
  if (const json* v = field("seed")) {
    if (!v->is_number_integer()) wrong_type("seed", "an integer", *v);
    r.seed = v->is_number_unsigned() ? v->get<uint64_t>() : uint64_t(v->get<int64_t>());
  }
  if (const json* v = field("n")) {
    if (!v->is_number_integer()) wrong_type("n", "an integer", *v);
    const bool in_range = v->is_number_unsigned()
                              ? v->get<uint64_t>() >= 1 && v->get<uint64_t>() <= kMaxChoices
                              : v->get<int64_t>() >= 1 && v->get<int64_t>() <= kMaxChoices;
    if (!in_range) throw ApiError(400, fmt::format("'n' must be 1 to {}", kMaxChoices), "n");
    r.n = v->get<int>();
  }
  parse_sampling(j, r, vocab);
  refuse_unsupported(j, chat);
  if (chat) parse_thinking(j, r);
  if (const json* v = field("stop")) {
    if (v->is_string()) {
      r.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      if (v->size() > 16) throw ApiError(400, "'stop' has more than 16 strings", "stop");
      for (size_t i = 0; i < v->size(); ++i)
        r.stop.push_back(get_string((*v)[i], fmt::format("stop[{}]", i)));
    } else {
      wrong_type("stop", "a string or an array of strings", *v);
    }
    for (size_t i = 0; i < r.stop.size(); ++i)
      if (r.stop[i].empty()) throw ApiError(400, "'stop' strings must not be empty", "stop");
  }
  if (const json* v = field("stream")) r.stream = get_bool(*v, "stream");
  if (const json* v = field("stream_options")) {
    if (!v->is_object()) wrong_type("stream_options", "an object", *v);
    const auto u = v->find("include_usage");
    if (u != v->end() && !u->is_null())
      r.include_usage = get_bool(*u, "stream_options.include_usage");
  }
  if (const json* v = field("stop_token_ids")) {
    if (!v->is_array()) wrong_type("stop_token_ids", "an array of token ids", *v);
    for (size_t i = 0; i < v->size(); ++i)
      r.stop_token_ids.push_back(get_token((*v)[i], fmt::format("stop_token_ids[{}]", i), vocab));
  }
  if (const json* v = field("ignore_eos")) r.ignore_eos = get_bool(*v, "ignore_eos");
  if (const json* v = field("return_token_ids"))
    r.return_token_ids = get_bool(*v, "return_token_ids");
  return r;
}

}  // namespace colibri
