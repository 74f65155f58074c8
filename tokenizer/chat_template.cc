#include "tokenizer/chat_template.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mobius::tokenizer {

absl::StatusOr<std::string> RenderChatMessages(absl::Span<const ChatMessage> messages,
                                               bool add_generation_prompt) {
  std::string prompt;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    if (message.role != "system" && message.role != "user" && message.role != "assistant") {
      return absl::InvalidArgumentError(absl::StrCat("chat message ", i, ": unsupported role \"",
                                                     message.role,
                                                     "\" (expected system, user or assistant)"));
    }
    absl::StrAppend(&prompt, "<|im_start|>", message.role, "\n", message.content, "<|im_end|>\n");
  }
  if (add_generation_prompt) prompt.append("<|im_start|>assistant\n");
  return prompt;
}

}  // namespace mobius::tokenizer
