#include "tokenizer/chat_template.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mobius::tokenizer {

absl::StatusOr<std::string> RenderChatMessages(absl::Span<const ChatMessage> messages,
                                               bool add_generation_prompt) {
  std::string prompt;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    // OpenAI's "developer" role replaced "system" for instructions to the model; ChatML has no
    // such role, so it is rendered as the system turn it means.
    const std::string role = message.role == "developer" ? std::string("system") : message.role;
    if (role != "system" && role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("chat message ", i, ": unsupported role \"", message.role,
                       "\" (expected system, developer, user or assistant)"));
    }
    absl::StrAppend(&prompt, "<|im_start|>", role, "\n", message.content, "<|im_end|>\n");
  }
  if (add_generation_prompt) prompt.append("<|im_start|>assistant\n");
  return prompt;
}

}  // namespace mobius::tokenizer
