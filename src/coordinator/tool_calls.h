// Tool calls in the two chat formats the server speaks, as their published chat templates write
// them and the reference servers' parsers read them:
//   GLM-5        tools: a <|system|> block "# Tools" with one JSON object a line in <tools>,
//                then the format instruction; a call:
//                <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
//                (V a string as it is, any other value as JSON); results after <|observation|>,
//                each <tool_response>...</tool_response>.
//   DeepSeek-V3  tools: "## Tools" / "### Function" in the system prompt, each function's JSON in
//                a fenced block (the model card's form); calls:
//                <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//                ```json\nARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (V3.1's
//                <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜> is read too);
//                results <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>...<｜tool▁output▁end｜>
//                ...<｜tool▁outputs▁end｜>.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace colibri {

enum class ChatFormat { kGlm5, kDeepseekV3 };

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // the text of a JSON object
};

// A function the request offers: {"type": "function", "function": {name, description?,
// parameters?}} as the client wrote it (its keys in their order).
struct Tool {
  std::string name;
  nlohmann::ordered_json spec;
};

// The tools' block of the prompt: GLM-5's <|system|> turn, or the text DeepSeek-V3's system
// prompt ends with.
std::string render_tools(ChatFormat format, const std::vector<Tool>& tools);
// An assistant turn's calls, as the template writes them back into the history.
std::string render_tool_calls(ChatFormat format, const std::vector<ToolCall>& calls);
// A run of tool results (the contents of consecutive "tool" messages).
std::string render_tool_results(ChatFormat format, const std::vector<std::string>& results);

// A reply split into its text and its calls. When any call in it cannot be read (no name, an
// argument list that is not a JSON object, a call cut short), the reply is all text and no call.
struct ToolReply {
  std::string content;
  std::vector<ToolCall> calls;
};
// `tools` type the GLM-5 argument values: a parameter whose schema type is "string" keeps its
// text, any other is read as JSON where it is JSON. Each call gets the id "call_<id_stem>_<i>".
ToolReply parse_tool_calls(ChatFormat format, std::string_view text, const std::vector<Tool>& tools,
                           const std::string& id_stem);

// A streamed reply's text in pieces: the text that is surely content goes out at once, a GLM-5
// call goes out whole when its </tool_call> arrives (as the reference servers stream them), a
// DeepSeek section of calls when it ends, and text that may begin a call waits.
class ToolCallStream {
 public:
  ToolCallStream(ChatFormat format, std::vector<Tool> tools, std::string id_stem);
  struct Out {
    std::string content;
    std::vector<ToolCall> calls;  // complete calls, in order
  };
  Out add(std::string_view text);
  // End of the reply: what is left (a call cut short goes out as text).
  Out finish();
  size_t calls() const { return calls_; }

 private:
  ChatFormat format_;
  std::vector<Tool> tools_;
  std::string id_stem_;
  std::string pending_;  // text not yet sent: a call begun, or what may begin one
  size_t calls_ = 0;
};

}  // namespace colibri
