#include "tokenizer/chat_template.h"

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mobius::tokenizer {
namespace {

constexpr std::string_view kToolsHeader =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>";
constexpr std::string_view kToolsFooter =
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

// Python's str.lstrip / rstrip / strip of one character set, as the template calls them.
std::string_view LStrip(std::string_view s, char c) {
  while (!s.empty() && s.front() == c) s.remove_prefix(1);
  return s;
}
std::string_view RStrip(std::string_view s, char c) {
  while (!s.empty() && s.back() == c) s.remove_suffix(1);
  return s;
}

// The part after the last `sep` (Python's s.split(sep)[-1]) and before the first (split[0]).
std::string_view AfterLast(std::string_view s, std::string_view sep) {
  const size_t at = s.rfind(sep);
  return at == std::string_view::npos ? s : s.substr(at + sep.size());
}
std::string_view BeforeFirst(std::string_view s, std::string_view sep) {
  return s.substr(0, s.find(sep));
}

// A user turn that only carries tool results does not count as the user's query.
bool IsToolResponseTurn(std::string_view content) {
  return content.starts_with("<tool_response>") && content.ends_with("</tool_response>");
}

}  // namespace

absl::StatusOr<std::string> RenderChatMessages(absl::Span<const ChatMessage> messages,
                                               const ChatTemplateArgs& args) {
  const std::vector<std::string>& tools = args.tools;
  // OpenAI's "developer" role replaced "system" for instructions to the model; the template has
  // no such role, so it is rendered as the system turn it means.
  std::vector<std::string> roles;
  roles.reserve(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "developer" && role != "user" && role != "assistant" &&
        role != "tool") {
      return absl::InvalidArgumentError(
          absl::StrCat("chat message ", i, ": unsupported role \"", role,
                       "\" (expected system, developer, user, assistant or tool)"));
    }
    roles.push_back(role == "developer" ? "system" : role);
  }
  const size_t n = messages.size();
  const bool leading_system = n > 0 && roles[0] == "system";

  std::string prompt;
  if (!tools.empty()) {
    prompt = "<|im_start|>system\n";
    if (leading_system) absl::StrAppend(&prompt, messages[0].content, "\n\n");
    prompt.append(kToolsHeader);
    for (const std::string& tool : tools) absl::StrAppend(&prompt, "\n", tool);
    prompt.append(kToolsFooter);
  } else if (leading_system) {
    absl::StrAppend(&prompt, "<|im_start|>system\n", messages[0].content, "<|im_end|>\n");
  }

  // The last user query: assistant turns after it keep their reasoning.
  size_t last_query = n == 0 ? 0 : n - 1;
  for (size_t k = n; k-- > 0;) {
    if (roles[k] == "user" && !IsToolResponseTurn(messages[k].content)) {
      last_query = k;
      break;
    }
  }

  for (size_t i = 0; i < n; ++i) {
    const ChatMessage& message = messages[i];
    const std::string& role = roles[i];
    if (role == "user" || (role == "system" && i > 0)) {
      absl::StrAppend(&prompt, "<|im_start|>", role, "\n", message.content, "<|im_end|>\n");
    } else if (role == "assistant") {
      std::string_view content = message.content;
      std::string_view reasoning;
      if (message.reasoning_content.has_value()) {
        reasoning = *message.reasoning_content;
      } else if (content.find("</think>") != std::string_view::npos) {
        reasoning =
            LStrip(AfterLast(RStrip(BeforeFirst(content, "</think>"), '\n'), "<think>"), '\n');
        content = LStrip(AfterLast(content, "</think>"), '\n');
      }
      prompt.append("<|im_start|>assistant\n");
      if (i > last_query && (i + 1 == n || !reasoning.empty())) {
        prompt.append("<think>\n");
        prompt.append(RStrip(LStrip(reasoning, '\n'), '\n'));
        prompt.append("\n</think>\n\n");
        prompt.append(LStrip(content, '\n'));
      } else {
        prompt.append(content);
      }
      for (size_t c = 0; c < message.tool_calls.size(); ++c) {
        if (c > 0 || !content.empty()) prompt.push_back('\n');
        absl::StrAppend(&prompt, "<tool_call>\n{\"name\": \"", message.tool_calls[c].name,
                        "\", \"arguments\": ", message.tool_calls[c].arguments, "}\n</tool_call>");
      }
      prompt.append("<|im_end|>\n");
    } else if (role == "tool") {
      if (i == 0 || roles[i - 1] != "tool") prompt.append("<|im_start|>user");
      absl::StrAppend(&prompt, "\n<tool_response>\n", message.content, "\n</tool_response>");
      if (i + 1 == n || roles[i + 1] != "tool") prompt.append("<|im_end|>\n");
    }
  }
  if (args.add_generation_prompt) {
    prompt.append("<|im_start|>assistant\n");
    if (!args.enable_thinking) prompt.append("<think>\n\n</think>\n\n");
  }
  return prompt;
}

}  // namespace mobius::tokenizer
