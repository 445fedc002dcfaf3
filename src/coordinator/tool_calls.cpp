#include "coordinator/tool_calls.h"

#include <fmt/format.h>

#include <algorithm>

namespace colibri {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kGlmCallOpen = "<tool_call>", kGlmCallClose = "</tool_call>",
                           kGlmKeyOpen = "<arg_key>", kGlmKeyClose = "</arg_key>",
                           kGlmValueOpen = "<arg_value>", kGlmValueClose = "</arg_value>";
constexpr std::string_view kDsCallsBegin = "<｜tool▁calls▁begin｜>",
                           kDsCallsEnd = "<｜tool▁calls▁end｜>",
                           kDsCallBegin = "<｜tool▁call▁begin｜>",
                           kDsCallEnd = "<｜tool▁call▁end｜>", kDsSep = "<｜tool▁sep｜>";

std::string_view trim(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

// JSON as Python's json.dumps(value, ensure_ascii=False) writes it: ", " and ": " separators.
std::string python_json(const ojson& j) {
  if (j.is_object()) {
    std::string out = "{";
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it != j.begin()) out += ", ";
      out += ojson(it.key()).dump() + ": " + python_json(it.value());
    }
    return out + "}";
  }
  if (j.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + python_json(j[i]);
    return out + "]";
  }
  return j.dump(-1, ' ', false, ojson::error_handler_t::replace);
}

// The schema type of `name`'s parameter `key` ("" when the tool or the type is not given).
std::string parameter_type(const std::vector<Tool>& tools, const std::string& name,
                           const std::string& key) {
  for (const Tool& t : tools) {
    if (t.name != name) continue;
    const ojson* f = t.spec.contains("function") ? &t.spec["function"] : &t.spec;
    if (!f->contains("parameters") || !(*f)["parameters"].is_object()) return "";
    const ojson& p = (*f)["parameters"];
    if (!p.contains("properties") || !p["properties"].is_object() || !p["properties"].contains(key))
      return "";
    const ojson& property = p["properties"][key];
    return property.is_object() && property.contains("type") && property["type"].is_string()
               ? property["type"].get<std::string>()
               : "";
  }
  return "";
}

// One GLM-5 call's body (between <tool_call> and </tool_call>); false when it cannot be read.
bool read_glm_call(std::string_view body, const std::vector<Tool>& tools, ToolCall& call) {
  const size_t first_key = body.find(kGlmKeyOpen);
  call.name = std::string(trim(body.substr(0, first_key)));
  if (call.name.empty() || call.name.find('<') != std::string::npos) return false;
  ojson arguments = ojson::object();
  std::string_view rest = first_key == std::string_view::npos ? "" : body.substr(first_key);
  while (!trim(rest).empty()) {
    rest = trim(rest);
    if (!rest.starts_with(kGlmKeyOpen)) return false;
    const size_t key_end = rest.find(kGlmKeyClose);
    if (key_end == std::string_view::npos) return false;
    const std::string key(trim(rest.substr(kGlmKeyOpen.size(), key_end - kGlmKeyOpen.size())));
    rest = trim(rest.substr(key_end + kGlmKeyClose.size()));
    if (key.empty() || !rest.starts_with(kGlmValueOpen)) return false;
    const size_t value_end = rest.find(kGlmValueClose);
    if (value_end == std::string_view::npos) return false;
    const std::string value(rest.substr(kGlmValueOpen.size(), value_end - kGlmValueOpen.size()));
    rest = rest.substr(value_end + kGlmValueClose.size());
    // A "string" parameter keeps its text; any other is JSON where it reads as JSON, else its
    // text, without the whitespace around it.
    ojson typed = value;
    if (parameter_type(tools, call.name, key) != "string") {
      const ojson parsed = ojson::parse(value, nullptr, false);
      typed = parsed.is_discarded() ? ojson(std::string(trim(value))) : parsed;
    }
    arguments[key] = typed;
  }
  call.arguments = arguments.dump(-1, ' ', false, ojson::error_handler_t::replace);
  return true;
}

// One DeepSeek call (between <｜tool▁call▁begin｜> and <｜tool▁call▁end｜>).
bool read_deepseek_call(std::string_view body, ToolCall& call) {
  const size_t sep = body.find(kDsSep);
  if (sep == std::string_view::npos) return false;
  const std::string_view before = trim(body.substr(0, sep));
  std::string_view after = body.substr(sep + kDsSep.size());
  std::string_view args;
  if (before == "function") {  // V3: function<sep>NAME\n```json\nARGS\n```
    const size_t line = after.find('\n');
    if (line == std::string_view::npos) return false;
    call.name = std::string(trim(after.substr(0, line)));
    args = trim(after.substr(line + 1));
    if (args.starts_with("```json"))
      args.remove_prefix(7);
    else if (args.starts_with("```"))
      args.remove_prefix(3);
    args = trim(args);
    if (args.ends_with("```")) args.remove_suffix(3);
  } else {  // V3.1: NAME<sep>ARGS
    call.name = std::string(before);
    args = after;
  }
  if (call.name.empty()) return false;
  const ojson parsed = ojson::parse(trim(args), nullptr, false);
  if (parsed.is_discarded() || !parsed.is_object()) return false;
  call.arguments = parsed.dump(-1, ' ', false, ojson::error_handler_t::replace);
  return true;
}

std::string call_id(const std::string& stem, size_t index) {
  return fmt::format("call_{}_{}", stem, index);
}

// The length of the longest end of `text` that begins `marker` (and is shorter than it).
size_t partial_marker(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (marker.starts_with(text.substr(text.size() - n))) return n;
  return 0;
}

}  // namespace

std::string render_tools(ChatFormat format, const std::vector<Tool>& tools) {
  if (tools.empty()) return {};
  std::string out;
  if (format == ChatFormat::kGlm5) {
    out =
        "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML "
        "tags:\n<tools>\n";
    for (const Tool& t : tools) out += python_json(t.spec) + "\n";
    out +=
        "</tools>\n\nFor each function call, output the function name and arguments within the "
        "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>"
        "<arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>"
        "{arg-value-2}</arg_value>...</tool_call>";
    return out;
  }
  out = "## Tools\n\n### Function\n\nYou have the following functions available:\n\n";
  for (const Tool& t : tools) {
    const ojson& f = t.spec.contains("function") ? t.spec["function"] : t.spec;
    out += "- `" + t.name + "`:\n```json\n" +
           f.dump(4, ' ', false, ojson::error_handler_t::replace) + "\n```\n";
  }
  return out;
}

std::string render_tool_calls(ChatFormat format, const std::vector<ToolCall>& calls) {
  if (calls.empty()) return {};
  std::string out;
  if (format == ChatFormat::kGlm5) {
    for (const ToolCall& c : calls) {
      out += std::string(kGlmCallOpen) + c.name;
      const ojson arguments = ojson::parse(c.arguments, nullptr, false);
      if (arguments.is_object())
        for (auto it = arguments.begin(); it != arguments.end(); ++it)
          out += std::string(kGlmKeyOpen) + it.key() + std::string(kGlmKeyClose) +
                 std::string(kGlmValueOpen) +
                 (it->is_string() ? it->get<std::string>() : python_json(*it)) +
                 std::string(kGlmValueClose);
      out += kGlmCallClose;
    }
    return out;
  }
  out = kDsCallsBegin;
  for (const ToolCall& c : calls)
    out += std::string(kDsCallBegin) + "function" + std::string(kDsSep) + c.name + "\n```json\n" +
           c.arguments + "\n```" + std::string(kDsCallEnd);
  return out + std::string(kDsCallsEnd);
}

std::string render_tool_results(ChatFormat format, const std::vector<std::string>& results) {
  std::string out;
  if (format == ChatFormat::kGlm5) {
    out = "<|observation|>";
    for (const std::string& r : results) out += "<tool_response>" + r + "</tool_response>";
    return out;
  }
  out = "<｜tool▁outputs▁begin｜>";
  for (const std::string& r : results)
    out += "<｜tool▁output▁begin｜>" + r + "<｜tool▁output▁end｜>";
  return out + "<｜tool▁outputs▁end｜>";
}

ToolReply parse_tool_calls(ChatFormat format, std::string_view text, const std::vector<Tool>& tools,
                           const std::string& id_stem) {
  ToolReply reply;
  const ToolReply as_text{std::string(text), {}};
  if (format == ChatFormat::kGlm5) {
    size_t at = 0;
    for (;;) {
      const size_t open = text.find(kGlmCallOpen, at);
      reply.content += text.substr(at, open == std::string_view::npos ? text.npos : open - at);
      if (open == std::string_view::npos) break;
      const size_t close = text.find(kGlmCallClose, open);
      if (close == std::string_view::npos) return as_text;
      ToolCall call;
      const size_t body = open + kGlmCallOpen.size();
      if (!read_glm_call(text.substr(body, close - body), tools, call)) return as_text;
      call.id = call_id(id_stem, reply.calls.size());
      reply.calls.push_back(std::move(call));
      at = close + kGlmCallClose.size();
    }
  } else {
    const size_t begin = text.find(kDsCallsBegin);
    if (begin == std::string_view::npos) return as_text;
    reply.content = text.substr(0, begin);
    std::string_view rest = text.substr(begin + kDsCallsBegin.size());
    for (;;) {
      rest = trim(rest);
      if (rest.empty() || rest.starts_with(kDsCallsEnd)) break;
      if (!rest.starts_with(kDsCallBegin)) return as_text;
      const size_t end = rest.find(kDsCallEnd);
      if (end == std::string_view::npos) return as_text;
      ToolCall call;
      if (!read_deepseek_call(rest.substr(kDsCallBegin.size(), end - kDsCallBegin.size()), call))
        return as_text;
      call.id = call_id(id_stem, reply.calls.size());
      reply.calls.push_back(std::move(call));
      rest = rest.substr(end + kDsCallEnd.size());
    }
    if (rest.starts_with(kDsCallsEnd)) reply.content += trim(rest.substr(kDsCallsEnd.size()));
  }
  if (!reply.calls.empty()) reply.content = std::string(trim(reply.content));
  return reply;
}

ToolCallStream::ToolCallStream(ChatFormat format, std::vector<Tool> tools, std::string id_stem)
    : format_(format), tools_(std::move(tools)), id_stem_(std::move(id_stem)) {}

ToolCallStream::Out ToolCallStream::add(std::string_view text) {
  pending_ += text;
  Out out;
  const std::string_view open = format_ == ChatFormat::kGlm5 ? kGlmCallOpen : kDsCallsBegin;
  const std::string_view close = format_ == ChatFormat::kGlm5 ? kGlmCallClose : kDsCallsEnd;
  for (;;) {
    const size_t start = pending_.find(open);
    if (start == std::string::npos) {  // text, but for an end that may begin a call
      const size_t keep = partial_marker(pending_, open);
      out.content += pending_.substr(0, pending_.size() - keep);
      pending_.erase(0, pending_.size() - keep);
      return out;
    }
    out.content += pending_.substr(0, start);
    pending_.erase(0, start);
    // GLM: one call a block; DeepSeek: the calls' section, whole.
    const size_t end = pending_.find(close);
    if (end == std::string::npos) return out;
    const size_t length = end + close.size();
    ToolReply one =
        parse_tool_calls(format_, std::string_view(pending_).substr(0, length), tools_, id_stem_);
    if (one.calls.empty()) {
      out.content += pending_.substr(0, length);
    } else {
      for (ToolCall& c : one.calls) {
        c.id = call_id(id_stem_, calls_++);
        out.calls.push_back(std::move(c));
      }
    }
    pending_.erase(0, length);
  }
}

ToolCallStream::Out ToolCallStream::finish() {
  Out out;
  // A DeepSeek section whose end marker never came (the reply stopped at end-of-sentence) is
  // read as it stands; anything else left is text.
  ToolReply rest = parse_tool_calls(format_, pending_, tools_, id_stem_);
  out.content = std::move(rest.content);
  for (ToolCall& c : rest.calls) {
    c.id = call_id(id_stem_, calls_++);
    out.calls.push_back(std::move(c));
  }
  pending_.clear();
  return out;
}

}  // namespace colibri
