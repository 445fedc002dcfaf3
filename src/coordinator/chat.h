// Chat formats of the supported model families, rendered to text with special-token strings
// and then encoded with the model's tokenizer (special tokens parsed).
//   GLM-5:       [gMASK]<sop><|system|>\n{..}<|user|>\n{..}<|assistant|>\n{..}   (+
//   <|assistant|>\n)
//                optional thinking block after the generation prompt: <think> (on) or
//                <think></think> (off)
//   DeepSeek-V3:
//   <｜begin▁of▁sentence｜>{system}<｜User｜>{..}<｜Assistant｜>{..}<｜end▁of▁sentence｜>
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace colibri {

enum class ChatFormat { kGlm5, kDeepseekV3 };
enum class Thinking { kUnset, kOn, kOff };

struct ChatMessage {
  std::string role;  // system, user, assistant
  std::string content;
};

ChatFormat chat_format_for(const ModelConfig& config);

// Text of the conversation. With add_generation_prompt it ends where the assistant's reply
// starts. `continuation` renders only the messages after the first `skip` ones, for a chat
// whose earlier turns are already in the KV cache.
std::string render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, Thinking thinking = Thinking::kUnset,
                        size_t skip = 0);

// Ids that end an assistant turn: the config's eos ids and the format's role tokens.
std::vector<int> chat_stop_ids(ChatFormat format, const ModelConfig& config,
                               const Tokenizer& tokenizer);

}  // namespace colibri
