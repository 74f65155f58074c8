// Fuzzes the OpenAI-compatible request parsers with arbitrary bodies: the JSON parse, each
// endpoint's field validation, and for an accepted chat body what the handler does next (tool
// definitions, the rendered prompt, a forced call's output form). A body may be refused but must
// never crash the router, and every refusal must be a client error the edge turns into a 400 or
// 404 with a message.
#include <string>

#include "absl/status/status.h"
#include "router/http/openai_request.h"
#include "router/http/structured_output_request.h"
#include "tests/fuzz/fuzz_check.h"
#include "tokenizer/chat_template.h"

namespace {

using namespace mobius::router::openai;  // NOLINT: a fuzz target's whole subject

constexpr char kModel[] = "mobius-fuzz";

// Errors the parsers may return for a client's body (400 / 404 at the edge); anything else (an
// internal error, say) would be a parser bug reported as a server fault.
void CheckClientError(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  const absl::StatusCode code = status.code();
  FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound ||
                 code == absl::StatusCode::kOutOfRange || code == absl::StatusCode::kUnimplemented,
             std::string(what) + ": " + status.ToString());
  FUZZ_CHECK(!status.message().empty(), std::string(what) + " refused without a message");
  // The edge's error mapping must take any of them.
  (void)ForOpenAiClient(status, /*chat=*/true);
  (void)ErrorParam(status);
  (void)ErrorCode(status);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  auto json = ParseJsonBody(body);
  CheckClientError(json.status(), "ParseJsonBody");
  if (!json.ok()) return 0;
  CheckClientError(ParseCompletionRequest(*json, kModel).status(), "ParseCompletionRequest");
  auto chat = ParseChatRequest(*json, kModel);
  CheckClientError(chat.status(), "ParseChatRequest");
  if (chat.ok()) {
    // What the chat handler does next with an accepted body: the tools' definitions, the prompt
    // rendered from the messages, and a forced call's output form.
    mobius::tokenizer::ChatTemplateArgs args;
    args.enable_thinking = chat->enable_thinking;
    if (chat->use_tools) {
      auto tools = ToolDefinitions(body);
      CheckClientError(tools.status(), "ToolDefinitions");
      if (tools.ok()) args.tools = *std::move(tools);
    }
    CheckClientError(mobius::tokenizer::RenderChatMessages(chat->messages, args).status(),
                     "RenderChatMessages");
    if (chat->forced_tool.has_value()) {
      CheckClientError(
          ForcedToolCallForm(body, *chat->forced_tool, chat->parallel_tool_calls).status(),
          "ForcedToolCallForm");
    }
  }
  auto tokenize = ParseTokenizeRequest(*json, kModel);
  CheckClientError(tokenize.status(), "ParseTokenizeRequest");
  if (tokenize.ok() && !tokenize->messages.empty()) {
    mobius::tokenizer::ChatTemplateArgs args;
    args.add_generation_prompt = tokenize->add_generation_prompt;
    args.enable_thinking = tokenize->enable_thinking;
    CheckClientError(mobius::tokenizer::RenderChatMessages(tokenize->messages, args).status(),
                     "RenderChatMessages (tokenize)");
  }
  CheckClientError(ParseDetokenizeRequest(*json, kModel).status(), "ParseDetokenizeRequest");
  return 0;
}
