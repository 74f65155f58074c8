// Renders OpenAI-style chat messages into the ChatML prompt that Qwen-family models are trained
// on: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then "<|im_start|>assistant\n"
// when a reply is requested. The full Qwen3 Jinja template (tools, reasoning blocks) is not
// interpreted; this is its plain-conversation subset.
#ifndef MOBIUS_TOKENIZER_CHAT_TEMPLATE_H_
#define MOBIUS_TOKENIZER_CHAT_TEMPLATE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace mobius::tokenizer {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant".
  std::string content;
};

// InvalidArgument naming the role for any other role.
absl::StatusOr<std::string> RenderChatMessages(absl::Span<const ChatMessage> messages,
                                               bool add_generation_prompt);

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_CHAT_TEMPLATE_H_
