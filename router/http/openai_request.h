// Turns OpenAI request bodies (/v1/completions, /v1/chat/completions) into mobius.v1 requests.
// Only shapes and types are checked here; value ranges (temperature < 0, top_p outside (0, 1],
// ...) are the service's to judge. Every error is INVALID_ARGUMENT naming the field, with the
// field attached as the error's `param` (see ErrorParam), except an unknown model (NOT_FOUND).
#ifndef MOBIUS_ROUTER_HTTP_OPENAI_REQUEST_H_
#define MOBIUS_ROUTER_HTTP_OPENAI_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "inference.pb.h"
#include "tokenizer/chat_template.h"

namespace mobius::router::openai {

// The most choices one request may ask for (its prompts times `n`): each is a service call of its
// own, running on a thread of the HTTP server for as long as it generates.
inline constexpr int kMaxChoices = 128;

struct CompletionParams {
  // One per prompt (a batch has several), each with the input and the sampling params;
  // request_id left to the caller.
  std::vector<v1::GenerateRequest> prompts;
  int n = 1;  // choices per prompt
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;       // `logprobs` was given (sampling_params.logprobs holds n)
  bool tokens_as_ids = false;  // return_tokens_as_token_ids (vLLM): "token_id:<id>" labels
  // The text (and logprobs) begin with the prompt; with logprobs, prompt_logprobs defaults to
  // the same n (vLLM's), and max_tokens may be 0 (the prompt alone, OpenAI's echo use).
  bool echo = false;
  bool return_token_ids = false;  // vLLM's: token ids beside the text (ResponseContext)
};

struct ChatParams {
  std::vector<tokenizer::ChatMessage> messages;
  v1::SamplingParams sampling;  // max_tokens unset when the client gave neither alias
  int n = 1;                    // choices
  // `tools` given and `tool_choice` "auto" (or unset): the tools go into the prompt
  // (ToolDefinitions) and <tool_call> blocks of the output become tool calls.
  bool use_tools = false;
  bool parallel_tool_calls = true;  // false: at most one call is returned
  // `tool_choice` "required" (empty: any of the tools) or a named function: the output is held
  // to one call (ForcedToolCallForm), with the tools in the prompt as for "auto".
  std::optional<std::string> forced_tool;
  bool enable_thinking = true;                    // chat_template_kwargs.enable_thinking (vLLM's)
  std::optional<int32_t> truncate_prompt_tokens;  // vLLM's: keep the prompt's last N tokens
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;       // `logprobs: true` (sampling.logprobs holds top_logprobs)
  bool tokens_as_ids = false;  // return_tokens_as_token_ids
  bool return_token_ids = false;
};

// POST /tokenize (vLLM's): the tokens of a text (`prompt`) or of a chat rendered as the chat
// endpoint renders it (`messages`, `add_generation_prompt` default true); exactly one of them.
struct TokenizeParams {
  std::optional<std::string> prompt;
  std::vector<tokenizer::ChatMessage> messages;
  bool add_generation_prompt = true;
  bool enable_thinking = true;  // chat_template_kwargs.enable_thinking
  bool use_tools = false;       // `tools` (and `tool_choice`) as the chat endpoint takes them
};

// The service calls of a request's choices, in OpenAI's order (prompt by prompt, then `n` choices
// of each: choice index = prompt * n + k). Choice k of a prompt with a seed draws with seed + k
// (wrapping), so that the choices differ and the whole response is still reproducible, as vLLM
// does. A single choice keeps `request_id`; several get "<request_id>-<index>".
std::vector<v1::GenerateRequest> ExpandChoices(const std::vector<v1::GenerateRequest>& prompts,
                                               int n, const std::string& request_id);

// Parses a request body. Malformed JSON names the byte offset; nesting is capped.
absl::StatusOr<nlohmann::json> ParseJsonBody(absl::string_view body);

// `served_model_name` empty accepts any `model`.
absl::StatusOr<CompletionParams> ParseCompletionRequest(const nlohmann::json& body,
                                                        const std::string& served_model_name);
absl::StatusOr<ChatParams> ParseChatRequest(const nlohmann::json& body,
                                            const std::string& served_model_name);

// Each of a chat request body's `tools` as JSON text for the prompt, as the Qwen3 template's
// `tojson` writes it: in the client's key order (so `body` is parsed again, keeping it), Python's
// separators. For a body ParseChatRequest accepted.
absl::StatusOr<std::vector<std::string>> ToolDefinitions(absl::string_view body);

absl::StatusOr<TokenizeParams> ParseTokenizeRequest(const nlohmann::json& body,
                                                    const std::string& served_model_name);
// POST /detokenize (vLLM's): `tokens`, an array of token ids.
absl::StatusOr<v1::DetokenizeRequest> ParseDetokenizeRequest(const nlohmann::json& body,
                                                             const std::string& served_model_name);

// INVALID_ARGUMENT "<message>" carrying `field` as its OpenAI `param`.
absl::Status FieldError(absl::string_view field, absl::string_view message);
// A service error in the OpenAI API's terms: a field the router's validation named
// (RequestFieldOf) becomes the error's `param` in the endpoint's spelling (the prompt is `prompt`,
// or `messages` for chat; chat's logprobs count is `top_logprobs`), and its message loses the
// "sampling_params." prefix of the gRPC field. Other statuses pass unchanged.
absl::Status ForOpenAiClient(const absl::Status& status, bool chat);
// The OpenAI error `param` / `code` attached to a status, or "" when none.
std::string ErrorParam(const absl::Status& status);
std::string ErrorCode(const absl::Status& status);
// NOT_FOUND for a model other than the served one (OpenAI's `model_not_found`).
absl::Status ModelNotFoundError(absl::string_view model);

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_OPENAI_REQUEST_H_
