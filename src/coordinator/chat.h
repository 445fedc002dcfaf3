// Chat formats of the supported model families, rendered to text with special-token strings
// and then encoded with the model's tokenizer (special tokens parsed).
//   GLM-5:       [gMASK]<sop><|system|>\n{..}<|user|>\n{..}<|assistant|>\n{..}   (+
//   <|assistant|>\n)
//                optional thinking block after the generation prompt: <think> (on) or
//                <think></think> (off)
//   DeepSeek-V3:
//   <｜begin▁of▁sentence｜>{system}<｜User｜>{..}<｜Assistant｜>{..}<｜end▁of▁sentence｜>
// Tools, tool calls and tool results as tool_calls.h writes them.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "coordinator/tool_calls.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace colibri {

enum class Thinking { kUnset, kOn, kOff };

struct ChatMessage {
  ChatMessage() = default;
  ChatMessage(std::string role_, std::string content_, std::vector<ToolCall> calls = {},
              std::string call_id = {})
      : role(std::move(role_)),
        content(std::move(content_)),
        tool_calls(std::move(calls)),
        tool_call_id(std::move(call_id)) {}
  std::string role;  // system, user, assistant, tool (GLM-5 also: observation)
  std::string content;
  std::vector<ToolCall> tool_calls;  // assistant: the calls it made
  std::string tool_call_id;          // tool: the call this is the result of
};

ChatFormat chat_format_for(const ModelConfig& config);

// Text of the conversation. With add_generation_prompt it ends where the assistant's reply
// starts. `continuation` renders only the messages after the first `skip` ones, for a chat
// whose earlier turns are already in the KV cache. `tools`: the functions the model may call,
// rendered as the format's template does (tool_calls.h).
std::string render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, Thinking thinking = Thinking::kUnset,
                        size_t skip = 0, const std::vector<Tool>& tools = {});

// Ids that end an assistant turn: the config's eos ids and the format's role tokens.
std::vector<int> chat_stop_ids(ChatFormat format, const ModelConfig& config,
                               const Tokenizer& tokenizer);

}  // namespace colibri
