// Renders OpenAI-style chat messages into the prompt that Qwen3-family models are trained on, as
// the Qwen3 chat template (tokenizer_config.json's Jinja `chat_template`) renders them: ChatML
// turns "<|im_start|>{role}\n{content}<|im_end|>\n", tools listed in the system turn, assistant
// tool calls as <tool_call> blocks, tool results as <tool_response> blocks in a user turn, and the
// template's reasoning rules (an assistant turn after the last user query carries its
// <think> block; earlier ones lose it). The template's logic is written out here rather than
// interpreted; tests/tokenizer/chat_template_reference_test.cc checks it against the template
// itself rendered by Jinja. One deliberate difference: OpenAI's "developer" turn, which the
// template would drop, is rendered as the system turn it stands for.
#ifndef MOBIUS_TOKENIZER_CHAT_TEMPLATE_H_
#define MOBIUS_TOKENIZER_CHAT_TEMPLATE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace mobius::tokenizer {

// A function call an assistant turn made.
struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object as text, rendered as given
};

struct ChatMessage {
  std::string role;  // "system" (or "developer"), "user", "assistant" or "tool"
  std::string content;
  std::vector<ToolCall> tool_calls;              // assistant turns
  std::optional<std::string> reasoning_content;  // assistant turns: the <think> part, if given
};

// The template's other inputs.
struct ChatTemplateArgs {
  // Each tool's definition as JSON text (the template's `tool | tojson`), listed in the system
  // turn; none: no tool section.
  std::vector<std::string> tools;
  bool add_generation_prompt = true;  // end with the assistant turn's opening
  // False: that opening carries an empty <think> block, so a reasoning model answers at once
  // (the template's `enable_thinking`, which vLLM takes in `chat_template_kwargs`).
  bool enable_thinking = true;
};

// InvalidArgument naming the message for a role other than system, developer, user, assistant or
// tool (the template would drop such a turn silently).
absl::StatusOr<std::string> RenderChatMessages(absl::Span<const ChatMessage> messages,
                                               const ChatTemplateArgs& args);

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_CHAT_TEMPLATE_H_
