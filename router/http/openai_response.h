// OpenAI response objects built from the service's stream messages: completion and chat
// completion bodies, their streamed chunks as server-sent events, usage, logprobs, and the error
// object with the HTTP status each absl code maps to.
#ifndef MOBIUS_ROUTER_HTTP_OPENAI_RESPONSE_H_
#define MOBIUS_ROUTER_HTTP_OPENAI_RESPONSE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "inference.pb.h"
#include "router/http/chat_output_parser.h"

namespace mobius::router::openai {

// 400 INVALID_ARGUMENT (and OUT_OF_RANGE, FAILED_PRECONDITION), 404 NOT_FOUND, 409 ALREADY_EXISTS,
// 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE,
// 504 DEADLINE_EXCEEDED, 499 CANCELLED (nginx's "client closed request"), 500 otherwise.
int HttpStatusFor(absl::StatusCode code);
// {"error": {"message", "type", "param", "code"}}; param and code from the status' payloads
// (openai_request.h) or null.
nlohmann::ordered_json ErrorJson(const absl::Status& status);
std::string ErrorBody(const absl::Status& status);
// An error object for failures outside the API's own (413, 415, 405 ...): param and code null.
std::string ErrorBody(absl::string_view message, absl::string_view type);
// The retry hint in a RESOURCE_EXHAUSTED message, in whole seconds rounded up and at least 1:
// the first number after "retry" ("retry after 2s", "retry in 1500 ms", "retry_after=3");
// 1 when the message has none.
int RetryAfterSeconds(absl::string_view message);

// "data: <json>\n\n".
std::string SseEvent(const nlohmann::ordered_json& data);
inline constexpr char kSseDone[] = "data: [DONE]\n\n";

enum class Endpoint { kCompletions, kChat };

struct ResponseContext {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;       // "cmpl-<request id>" or "chatcmpl-<request id>"
  int64_t created = 0;  // Unix seconds
  std::string model;
  bool logprobs = false;       // the client asked for logprobs
  bool include_usage = false;  // streaming: a usage chunk before [DONE]
  bool tokens_as_ids = false;  // logprob tokens as "token_id:<id>" (return_tokens_as_token_ids)
  int choice_index = 0;        // the `index` of the choice this formatter writes
  // Chat with tools: <tool_call> blocks in the output become the message's `tool_calls`
  // (ToolCallParser), at most `max_tool_calls` of them.
  bool parse_tool_calls = false;
  int max_tool_calls = 1 << 30;
  // Chat: a leading <think> block becomes `reasoning_content` (ReasoningParser).
  bool parse_reasoning = false;
  // Completions: the text (and the logprobs, with their first token's null) begins with the
  // prompt (TextChunk.prompt); the prompt's entries show at most `top_logprobs` alternatives.
  bool echo = false;
  int top_logprobs = 0;
  // prompt_logprobs was asked for: vLLM's `prompt_logprobs` list, in the choice (completions) or
  // the response (chat); streamed with the choice's first text event (completions) or in an
  // event of its own (chat).
  bool prompt_logprobs = false;
  // return_token_ids (vLLM's): the output's token ids beside its text (`token_ids`, per chunk
  // when streamed) and the prompt's (`prompt_token_ids`: in the choice for completions, in the
  // response for chat; with the first event when streamed). Completions' echo then leaves the
  // prompt's text out, as vLLM does.
  bool return_token_ids = false;
};

// Turns one choice's GenerateResponse messages into OpenAI objects, either chunk by chunk
// (streaming) or accumulated into one body. Logprob tokens are the tokens' text when the service
// sent their bytes (a router with a tokenizer does; vLLM's "bytes:\xNN" spelling for part of a
// character), and "token_id:<id>" without them or with return_tokens_as_token_ids (vLLM's form).
class CompletionFormatter {
 public:
  explicit CompletionFormatter(ResponseContext context);
  // The id may be learnt from the service's first message; set it before formatting.
  void set_id(std::string id);
  [[nodiscard]] const std::string& id() const { return context_.id; }

  // Streaming. The first event: chat's {"role": "assistant"} delta; "" for completions.
  [[nodiscard]] std::string StreamStart() const;
  // The events of one message: a text chunk (none when it carries no text and no logprobs
  // were asked for), or for `complete` the choice's finish chunk.
  std::string StreamEvents(const v1::GenerateResponse& response);
  // The end of a stream, once every choice has finished: the usage chunk (of all the choices) if
  // asked for, and [DONE].
  [[nodiscard]] std::string StreamEnd(const v1::Usage& usage) const;
  // An error after the stream started: the error object as an event, then [DONE].
  static std::string StreamError(const absl::Status& status);

  // Non-streaming.
  void Append(const v1::GenerateResponse& response);
  [[nodiscard]] bool complete() const { return complete_; }
  // The whole response of the request's choices (each formatter's own, in order; the first one's
  // id and model) with the usage of all of them.
  static std::string Body(std::span<CompletionFormatter> choices, const v1::Usage& usage);
  // The final message's usage (empty before it).
  [[nodiscard]] const v1::Usage& usage() const { return final_.usage(); }

 private:
  nlohmann::ordered_json ChunkEnvelope() const;
  // A chat stream's events for `piece` (nullptr: the end of the output) through the reasoning
  // and tool-call parsers: a reasoning chunk, a content chunk, then one chunk per completed call;
  // `piece`'s logprobs go with the first of them (a content chunk of "" when there is none).
  std::string ParsedChatEvents(const v1::TextChunk* piece);
  // A delta chunk of this choice.
  std::string DeltaEvent(nlohmann::ordered_json delta, nlohmann::ordered_json logprobs,
                         nlohmann::ordered_json token_ids = nullptr);
  // The choice's call number `position` as OpenAI's tool_calls entry (its id made once per
  // position); `index` only in stream deltas.
  nlohmann::ordered_json ToolCallJson(const ParsedToolCall& call, int position, bool with_index);
  // "tool_calls" when the output made calls and ended by itself, else the service's reason.
  [[nodiscard]] const char* ChoiceFinishReason(int calls) const;
  nlohmann::ordered_json Logprobs(const v1::TextChunk& chunk, size_t text_offset) const;
  // Completions with echo: the prompt's logprobs entries (the first token's null), from offset 0.
  nlohmann::ordered_json EchoLogprobs(const v1::PromptEcho& prompt) const;
  // The events of one message without chat's prompt-scores event (StreamEvents adds it).
  std::string ChoiceEvents(const v1::GenerateResponse& response);
  // Chat: a chunk of this choice with no content and the response-level `prompt_logprobs` and
  // `prompt_token_ids` (those asked for).
  std::string PromptEvent(const v1::PromptEcho& prompt) const;
  // The ids of `piece` as a JSON array when return_token_ids, else null.
  nlohmann::ordered_json TokenIds(const v1::TextChunk& piece) const;
  // The choice object of a whole (non-streamed) response (not const: tool-call ids are made once).
  [[nodiscard]] nlohmann::ordered_json Choice();
  [[nodiscard]] nlohmann::ordered_json StopReason() const;

  ResponseContext context_;
  std::string text_;                         // accumulated (non-streaming) or streamed so far
  size_t text_chars_ = 0;                    // code points in text_, for completions' text_offset
  nlohmann::ordered_json logprobs_;          // accumulated (non-streaming)
  nlohmann::ordered_json prompt_logprobs_;   // vLLM's list, once the prompt came (non-streaming)
  nlohmann::ordered_json prompt_token_ids_;  // return_token_ids (non-streaming)
  nlohmann::ordered_json token_ids_ = nlohmann::ordered_json::array();  // ditto, the output's
  bool complete_ = false;
  v1::TextComplete final_;
  // Streaming a chat answer with parse_reasoning or parse_tool_calls.
  std::optional<ChatOutputParser> output_parser_;
  int tool_calls_sent_ = 0;
  std::vector<std::string> tool_call_ids_;  // per call, made once (a body may be built twice)
};

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_OPENAI_RESPONSE_H_
