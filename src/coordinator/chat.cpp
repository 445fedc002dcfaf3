#include "coordinator/chat.h"

#include <algorithm>

#include "common/error.h"

namespace colibri {

ChatFormat chat_format_for(const ModelConfig& config) {
  return config.arch == Architecture::kGlmMoeDsa ? ChatFormat::kGlm5 : ChatFormat::kDeepseekV3;
}

namespace {

// The results of the run of "tool" messages that starts at i; i moves past them.
std::vector<std::string> tool_run(const std::vector<ChatMessage>& messages, size_t& i) {
  std::vector<std::string> results;
  for (; i < messages.size() && messages[i].role == "tool"; ++i)
    results.push_back(messages[i].content);
  --i;
  return results;
}

std::string render_glm5(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                        Thinking thinking, size_t skip, const std::vector<Tool>& tools) {
  std::string text;
  if (skip == 0) text = "[gMASK]<sop>" + render_tools(ChatFormat::kGlm5, tools);
  for (size_t i = skip; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "tool") {
      text += render_tool_results(ChatFormat::kGlm5, tool_run(messages, i));
      continue;
    }
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "observation")
      fail("chat message {}: role '{}' is not one of system, user, assistant, tool, observation", i,
           m.role);
    text += "<|" + m.role + "|>\n" + m.content + render_tool_calls(ChatFormat::kGlm5, m.tool_calls);
  }
  if (add_generation_prompt) {
    text += "<|assistant|>\n";
    if (thinking == Thinking::kOn) text += "<think>";
    if (thinking == Thinking::kOff) text += "<think></think>";
  }
  return text;
}

std::string render_deepseek(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                            Thinking thinking, size_t skip, const std::vector<Tool>& tools) {
  std::string text;
  size_t first = skip;
  if (skip == 0) {
    text = "<｜begin▁of▁sentence｜>";
    // The tools close the system prompt (after the system messages that open the chat).
    for (; first < messages.size() && messages[first].role == "system"; ++first)
      text += messages[first].content;
    if (!tools.empty())
      text += (first > 0 ? "\n\n" : "") + render_tools(ChatFormat::kDeepseekV3, tools);
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "system") {
      text += m.content;
    } else if (m.role == "user") {
      text += "<｜User｜>" + m.content;
    } else if (m.role == "assistant") {
      text += "<｜Assistant｜>" + m.content +
              render_tool_calls(ChatFormat::kDeepseekV3, m.tool_calls) + "<｜end▁of▁sentence｜>";
    } else if (m.role == "tool") {
      text += render_tool_results(ChatFormat::kDeepseekV3, tool_run(messages, i));
    } else {
      fail("chat message {}: role '{}' is not one of system, user, assistant, tool", i, m.role);
    }
  }
  if (add_generation_prompt) {
    text += "<｜Assistant｜>";
    if (thinking == Thinking::kOn) text += "<think>\n";
  }
  return text;
}

}  // namespace

std::string render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, Thinking thinking, size_t skip,
                        const std::vector<Tool>& tools) {
  return format == ChatFormat::kGlm5
             ? render_glm5(messages, add_generation_prompt, thinking, skip, tools)
             : render_deepseek(messages, add_generation_prompt, thinking, skip, tools);
}

std::vector<int> chat_stop_ids(ChatFormat format, const ModelConfig& config,
                               const Tokenizer& tokenizer) {
  std::vector<int> ids = config.generation.eos_token_ids;
  const std::vector<std::string> role_tokens =
      format == ChatFormat::kGlm5
          ? std::vector<std::string>{"<|user|>", "<|observation|>", "<|system|>", "<|endoftext|>"}
          : std::vector<std::string>{"<｜end▁of▁sentence｜>", "<｜User｜>"};
  for (const auto& token : role_tokens)
    if (auto id = tokenizer.token_to_id(token)) ids.push_back(*id);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace colibri
