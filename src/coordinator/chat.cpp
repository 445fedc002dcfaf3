#include "coordinator/chat.h"

#include <algorithm>

#include "common/error.h"

namespace colibri {

ChatFormat chat_format_for(const ModelConfig& config) {
  return config.arch == Architecture::kGlmMoeDsa ? ChatFormat::kGlm5 : ChatFormat::kDeepseekV3;
}

std::string render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, Thinking thinking, size_t skip) {
  std::string text;
  if (format == ChatFormat::kGlm5) {
    if (skip == 0) text = "[gMASK]<sop>";
    for (size_t i = skip; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      if (m.role != "system" && m.role != "user" && m.role != "assistant" &&
          m.role != "observation")
        fail("chat message {}: role '{}' is not one of system, user, assistant, observation", i,
             m.role);
      text += "<|" + m.role + "|>\n" + m.content;
    }
    if (add_generation_prompt) {
      text += "<|assistant|>\n";
      if (thinking == Thinking::kOn) text += "<think>";
      if (thinking == Thinking::kOff) text += "<think></think>";
    }
    return text;
  }
  if (skip == 0) text = "<｜begin▁of▁sentence｜>";
  for (size_t i = skip; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "system") {
      text += m.content;
    } else if (m.role == "user") {
      text += "<｜User｜>" + m.content;
    } else if (m.role == "assistant") {
      text += "<｜Assistant｜>" + m.content + "<｜end▁of▁sentence｜>";
    } else {
      fail("chat message {}: role '{}' is not one of system, user, assistant", i, m.role);
    }
  }
  if (add_generation_prompt) {
    text += "<｜Assistant｜>";
    if (thinking == Thinking::kOn) text += "<think>\n";
  }
  return text;
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
