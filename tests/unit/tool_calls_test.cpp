// Tool calls in GLM-5's and DeepSeek-V3's chat formats: the prompt's tool block, calls and
// results written back into the history, the model's calls read out of its reply (whole and
// streamed in pieces), and the OpenAI request and response fields that carry them.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/chat.h"
#include "coordinator/openai_api.h"
#include "coordinator/tool_calls.h"

namespace colibri {
namespace {

using json = nlohmann::json;

std::vector<Tool> weather_tools() {
  const auto spec = nlohmann::ordered_json::parse(R"({"type": "function", "function": {
      "name": "get_weather", "description": "Weather of a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
      "days": {"type": "integer"}, "code": {"type": "string"}}, "required": ["city"]}}})");
  return {{"get_weather", spec}};
}

TEST(ToolCalls, Glm5PromptHasTheToolsBlockCallsAndResultsAsTheTemplateWritesThem) {
  std::vector<ChatMessage> messages = {{"user", "Weather in Paris?", {}, {}}};
  messages.push_back(
      {"assistant", "", {{"call_1", "get_weather", R"({"city":"Paris","days":2})"}}, {}});
  messages.push_back({"tool", "sunny", {}, "call_1"});
  messages.push_back({"tool", "warm", {}, "call_1"});
  const std::string text =
      render_chat(ChatFormat::kGlm5, messages, true, Thinking::kUnset, 0, weather_tools());
  const std::string want =
      "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the "
      "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
      "tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
      "\"description\": \"Weather of a city\", \"parameters\": {\"type\": \"object\", "
      "\"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}, "
      "\"code\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each "
      "function call, output the function name and arguments within the following XML "
      "format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
      "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>..."
      "</tool_call><|user|>\nWeather in Paris?<|assistant|>\n<tool_call>get_weather<arg_key>city"
      "</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
      "</tool_call><|observation|><tool_response>sunny</tool_response><tool_response>warm"
      "</tool_response><|assistant|>\n";
  EXPECT_EQ(text, want);
  EXPECT_EQ(render_chat(ChatFormat::kGlm5, {messages[0]}, true).find("# Tools"), std::string::npos)
      << "no tools, no block";
}

TEST(ToolCalls, DeepseekPromptEndsTheSystemPromptWithTheToolsAndWritesCallsAndOutputs) {
  std::vector<ChatMessage> messages = {{"system", "Be brief.", {}, {}}, {"user", "Paris?", {}, {}}};
  messages.push_back({"assistant", "", {{"c", "get_weather", R"({"city":"Paris"})"}}, {}});
  messages.push_back({"tool", "sunny", {}, "c"});
  const std::string text =
      render_chat(ChatFormat::kDeepseekV3, messages, true, Thinking::kUnset, 0, weather_tools());
  const std::string head =
      "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n\n### Function\n\nYou "
      "have the following functions available:\n\n- `get_weather`:\n```json\n{"
      "\n    \"name\": \"get_weather\",";
  EXPECT_EQ(text.substr(0, head.size()), head);
  const std::string tail =
      "<｜User｜>Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<"
      "｜tool▁sep｜>"
      "get_weather\n```json\n{\"city\":\"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
      "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<"
      "｜tool▁output▁end｜>"
      "<｜tool▁outputs▁end｜><｜Assistant｜>";
  ASSERT_GE(text.size(), tail.size());
  EXPECT_EQ(text.substr(text.size() - tail.size()), tail);
}

TEST(ToolCalls, Glm5CallsAreReadWithTheirArgumentsTypedByTheSchema) {
  const std::string reply =
      "Let me look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
      "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>code</arg_key><arg_value>75"
      "</arg_value></tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
      "Lyon</arg_value>\n</tool_call>";
  const ToolReply r = parse_tool_calls(ChatFormat::kGlm5, reply, weather_tools(), "x");
  EXPECT_EQ(r.content, "Let me look.");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].id, "call_x_0");
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(r.calls[0].arguments),
            json::parse(R"({"city":"Paris","days":3,"code":"75"})"))
      << "days is an integer, code a string";
  EXPECT_EQ(json::parse(r.calls[1].arguments), json::parse(R"({"city":"Lyon"})"))
      << "GLM-4.5's newlines are read too";
  EXPECT_EQ(r.calls[1].id, "call_x_1");

  for (const std::string broken :
       {"<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris",               // cut short
        "<tool_call><arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",  // no name
        "<tool_call>f<arg_key>city</arg_key>junk<arg_value>x</arg_value></tool_call>"}) {
    const ToolReply text = parse_tool_calls(ChatFormat::kGlm5, broken, weather_tools(), "x");
    EXPECT_TRUE(text.calls.empty()) << broken;
    EXPECT_EQ(text.content, broken);
  }
  EXPECT_EQ(parse_tool_calls(ChatFormat::kGlm5, "no call", {}, "x").content, "no call");
}

TEST(ToolCalls, DeepseekCallsAreReadInTheV3AndV31Forms) {
  const std::string v3 =
      "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
      "get_weather\n```json\n{\"city\": \"Lyon\", \"days\": 2}\n```<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>";
  const ToolReply r = parse_tool_calls(ChatFormat::kDeepseekV3, v3, {}, "d");
  EXPECT_EQ(r.content, "Sure.");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(json::parse(r.calls[1].arguments), json::parse(R"({"city":"Lyon","days":2})"));
  const ToolReply v31 = parse_tool_calls(
      ChatFormat::kDeepseekV3,
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\":\"Rome\"}"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
      {}, "d");
  ASSERT_EQ(v31.calls.size(), 1u);
  EXPECT_EQ(v31.calls[0].name, "get_weather");
  EXPECT_TRUE(v31.content.empty());
  const std::string bad =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city}<"
      "｜tool▁call▁end｜>";
  EXPECT_TRUE(parse_tool_calls(ChatFormat::kDeepseekV3, bad, {}, "d").calls.empty());
}

TEST(ToolCalls, RenderedCallsReadBackAsTheSameCalls) {
  const std::vector<ToolCall> calls = {{"a", "get_weather", R"({"city":"Paris","days":3})"},
                                       {"b", "get_weather", R"({"city":"Nîmes","code":"30"})"}};
  for (const ChatFormat format : {ChatFormat::kGlm5, ChatFormat::kDeepseekV3}) {
    const ToolReply r =
        parse_tool_calls(format, render_tool_calls(format, calls), weather_tools(), "r");
    ASSERT_EQ(r.calls.size(), calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(r.calls[i].name, calls[i].name);
      EXPECT_EQ(json::parse(r.calls[i].arguments), json::parse(calls[i].arguments));
    }
  }
}

// Streamed a few bytes at a time: the content goes out as it comes (never a byte of a call), the
// calls whole, and together they are what the whole reply reads as.
TEST(ToolCalls, AStreamedReplySendsItsTextAtOnceAndEachCallWhole) {
  const std::vector<std::pair<ChatFormat, std::string>> replies = {
      {ChatFormat::kGlm5,
       "I will check <the> weather.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
       "</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon"
       "</arg_value></tool_call>"},
      {ChatFormat::kDeepseekV3,
       "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
       "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>"},  // ends at end-of-sentence
  };
  for (const auto& [format, reply] : replies) {
    for (const size_t piece : {1, 3, 7}) {
      ToolCallStream stream(format, weather_tools(), "s");
      std::string content;
      std::vector<ToolCall> calls;
      for (size_t at = 0; at < reply.size(); at += piece) {
        ToolCallStream::Out out = stream.add(std::string_view(reply).substr(at, piece));
        EXPECT_EQ(out.content.find("<tool_call>"), std::string::npos);
        content += out.content;
        calls.insert(calls.end(), out.calls.begin(), out.calls.end());
      }
      ToolCallStream::Out rest = stream.finish();
      content += rest.content;
      calls.insert(calls.end(), rest.calls.begin(), rest.calls.end());
      const ToolReply whole = parse_tool_calls(format, reply, weather_tools(), "s");
      EXPECT_EQ(content, whole.content) << "pieces of " << piece;
      ASSERT_EQ(calls.size(), whole.calls.size()) << "pieces of " << piece;
      for (size_t i = 0; i < calls.size(); ++i) {
        EXPECT_EQ(calls[i].id, whole.calls[i].id);
        EXPECT_EQ(calls[i].arguments, whole.calls[i].arguments);
      }
    }
  }
  ToolCallStream text(ChatFormat::kGlm5, {}, "t");
  EXPECT_EQ(text.add("a <tool").content, "a ") << "what may begin a call waits";
  EXPECT_EQ(text.add("box> b").content, "<toolbox> b");
  EXPECT_EQ(text.add("<tool_call>f<arg_key>k").content, "");
  const ToolCallStream::Out cut = text.finish();
  EXPECT_EQ(cut.content, "<tool_call>f<arg_key>k") << "a call cut short is text";
  EXPECT_TRUE(cut.calls.empty());
}

TEST(ToolCalls, RequestsCarryToolsToolMessagesCallsAndForcedChoices) {
  const std::string body = R"({"messages": [
      {"role": "user", "content": "Paris?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
      "description": "d"}}],
    "tool_choice": "auto", "parallel_tool_calls": false})";
  const CompletionRequest r = parse_completion_request(body, true, 100);
  ASSERT_EQ(r.tools.size(), 1u);
  EXPECT_EQ(r.tools[0].name, "get_weather");
  EXPECT_EQ(r.tools[0].spec["function"].begin().key(), "name") << "the client's key order";
  EXPECT_EQ(std::next(r.tools[0].spec["function"].begin()).key(), "parameters");
  EXPECT_FALSE(r.parallel_tool_calls);
  ASSERT_EQ(r.messages.size(), 3u);
  ASSERT_EQ(r.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r.messages[1].tool_calls[0].id, "c1");
  EXPECT_EQ(r.messages[2].role, "tool");
  EXPECT_EQ(r.messages[2].tool_call_id, "c1");

  const auto refused = [](const std::string& text, const std::string& param) {
    try {
      parse_completion_request(text, true, 100);
    } catch (const ApiError& e) {
      EXPECT_EQ(e.param, param) << text;
      return;
    }
    ADD_FAILURE() << "accepted: " << text;
  };
  const std::string user = R"("messages": [{"role": "user", "content": "x"}])";
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "f"}}])";
  refused("{" + user + ", " + tools +
              R"(, "tool_choice": {"type": "function", "function": {"name": "g"}}})",
          "tool_choice.function.name");
  refused("{" + user + ", " + tools + R"(, "tool_choice": {"type": "function"}})", "tool_choice");
  refused("{" + user + ", " + tools + R"(, "tool_choice": "always"})", "tool_choice");
  refused("{" + user + ", " + tools +
              R"(, "tool_choice": "required", "response_format": {"type": "json_object"}})",
          "response_format");
  // Forced calls: "required" any of the tools, a named function that one alone.
  const CompletionRequest required = parse_completion_request(
      "{" + user + ", " + tools + R"(, "tool_choice": "required"})", true, 100);
  EXPECT_EQ(required.output.kind, OutputRule::Kind::kToolCalls);
  EXPECT_FALSE(required.output.named);
  EXPECT_EQ(required.output.tools.size(), 1u);
  const CompletionRequest named = parse_completion_request(
      "{" + user + R"(, "tools": [{"type": "function", "function": {"name": "f"}},
          {"type": "function", "function": {"name": "g"}}], "parallel_tool_calls": false,
          "tool_choice": {"type": "function", "function": {"name": "g"}}})",
      true, 100);
  EXPECT_TRUE(named.output.named);
  ASSERT_EQ(named.output.tools.size(), 1u);
  EXPECT_EQ(named.output.tools[0].name, "g");
  EXPECT_FALSE(named.output.parallel);
  EXPECT_EQ(named.tools.size(), 2u) << "every tool stays in the prompt";
  const CompletionRequest schema = parse_completion_request(
      "{" + user + R"(, "response_format": {"type": "json_schema", "json_schema":
          {"name": "x", "strict": true, "schema": {"type": "object"}}}})",
      true, 100);
  EXPECT_EQ(schema.output.kind, OutputRule::Kind::kJsonSchema);
  EXPECT_TRUE(schema.output.strict);
  EXPECT_EQ(json::parse(schema.output.schema), json::parse(R"({"type": "object"})"));
  refused("{" + user + R"(, "tool_choice": "auto"})", "tool_choice");
  refused("{" + user + R"(, "tools": [{"type": "function", "function": {"name": "a b"}}]})",
          "tools[0].function.name");
  refused("{" + user + R"(, "tools": [{"type": "function"}]})", "tools[0].function");
  refused(R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
      "function": {"name": "f", "arguments": "[1]"}}]}]})",
          "messages[0].tool_calls[0].function.arguments");
  EXPECT_TRUE(
      parse_completion_request("{" + user + ", " + tools + R"(, "tool_choice": "none"})", true, 100)
          .tools.empty());
}

TEST(ToolCalls, ResponsesCarryTheCallsWithFinishReasonToolCalls) {
  const ResponseIdentity who{"chatcmpl-1", 0, "m", true};
  Choice c;
  c.finish.finish = FinishReason::kStop;
  c.tool_calls = {{"call_1", "get_weather", R"({"city":"Paris"})"}};
  const json whole = json::parse(completion_body(who, {c}, false));
  const json& choice = whole["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["arguments"], R"({"city":"Paris"})");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["type"], "function");
  EXPECT_FALSE(choice["message"]["tool_calls"][0].contains("index"));

  const std::string chunk = sse_tool_calls_chunk(who, c.tool_calls, 2, 0);
  ASSERT_EQ(chunk.rfind("data: ", 0), 0u);
  const json delta = json::parse(chunk.substr(6))["choices"][0]["delta"];
  EXPECT_EQ(delta["tool_calls"][0]["index"], 2);
  EXPECT_EQ(delta["tool_calls"][0]["id"], "call_1");
  EXPECT_EQ(delta["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(sse_finish_chunk(who, FinishReason::kStop, 0, true)
                            .substr(6))["choices"][0]["finish_reason"],
            "tool_calls");
  EXPECT_EQ(json::parse(sse_finish_chunk(who, FinishReason::kLength, 0, true)
                            .substr(6))["choices"][0]["finish_reason"],
            "length");
}

}  // namespace
}  // namespace colibri
