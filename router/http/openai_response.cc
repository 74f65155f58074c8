#include "router/http/openai_response.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "router/http/openai_request.h"
#include "tokenizer/utf8.h"

namespace mobius::router::openai {
namespace {

using Json = nlohmann::ordered_json;

// Longest Retry-After we pass on; a larger hint is more likely a misparse than advice.
constexpr double kMaxRetryAfterSeconds = 3600;

Json NullOr(const std::string& value) { return value.empty() ? Json(nullptr) : Json(value); }

const char* ErrorType(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return "invalid_request_error";
    case absl::StatusCode::kNotFound:
      return "not_found_error";
    case absl::StatusCode::kAlreadyExists:
      return "conflict_error";
    case absl::StatusCode::kResourceExhausted:
      return "rate_limit_error";
    case absl::StatusCode::kUnavailable:
      return "service_unavailable_error";
    case absl::StatusCode::kDeadlineExceeded:
      return "timeout_error";
    case absl::StatusCode::kCancelled:
      return "cancelled_error";
    default:
      return "internal_server_error";
  }
}

const char* FinishReason(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_ABORT:
      return "abort";
    case v1::FINISH_REASON_STOP:
    case v1::FINISH_REASON_UNSPECIFIED:
    default:
      return "stop";
  }
}

// A token as the logprobs show it: its text when the router sent its bytes (TokenLogprob.
// token_bytes) and they are whole UTF-8; vLLM's "bytes:\xNN..." spelling when they are part of
// a character; "token_id:N" without a tokenizer.
std::string TokenLabel(int32_t id, bool has_bytes, const std::string& bytes) {
  if (!has_bytes) return absl::StrCat("token_id:", id);
  if (tokenizer::IsValidUtf8(bytes)) return bytes;
  std::string out = "bytes:";
  for (unsigned char c : bytes) absl::StrAppend(&out, absl::StrFormat("\\x%02x", c));
  return out;
}
template <typename Entry>
std::string TokenLabelOf(const Entry& e, bool as_ids) {
  return TokenLabel(e.token_id(), e.has_token_bytes() && !as_ids, e.token_bytes());
}
// OpenAI's `bytes`: the token's UTF-8 bytes as integers, or null when unknown.
Json BytesJson(bool has_bytes, const std::string& bytes) {
  if (!has_bytes) return nullptr;
  Json out = Json::array();
  for (unsigned char c : bytes) out.push_back(static_cast<int>(c));
  return out;
}

size_t CountCodePoints(const std::string& text) {
  return static_cast<size_t>(std::count_if(text.begin(), text.end(), [](char c) {
    return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }));
}

Json IdsJson(const google::protobuf::RepeatedField<int32_t>& ids) {
  Json out = Json::array();
  for (int32_t id : ids) out.push_back(id);
  return out;
}

// A logprob as JSON: -inf (a token the model rules out) as vLLM writes it, -9999.0.
double ClampedLogprob(float logprob) { return std::max(static_cast<double>(logprob), -9999.0); }

// Prompt token k's bytes, or nullptr when the service sent none for it.
const std::string* PromptTokenBytes(const v1::PromptEcho& prompt, int k) {
  return k < prompt.token_bytes_size() && !prompt.token_bytes(k).empty() ? &prompt.token_bytes(k)
                                                                         : nullptr;
}

// vLLM's prompt_logprobs: null for the first token, then for each token after it an object
// keyed by token id (as a string) holding the token itself and its top n, each with logprob,
// rank (the token's own from the service, j + 1 for the j-th best) and decoded_token.
Json PromptLogprobsJson(const v1::PromptEcho& prompt) {
  Json out = Json::array();
  if (prompt.token_ids_size() == 0) return out;
  out.push_back(nullptr);
  for (int k = 0; k < prompt.logprobs_size() && k + 1 < prompt.token_ids_size(); ++k) {
    const v1::OutputLogprobs& scored = prompt.logprobs(k);
    const int32_t id = prompt.token_ids(k + 1);
    Json entry = Json::object();
    entry[std::to_string(id)] =
        Json{{"logprob", ClampedLogprob(scored.logprob())},
             {"rank", scored.rank()},
             {"decoded_token", TokenLabel(id, scored.has_token_bytes(), scored.token_bytes())}};
    for (int j = 0; j < scored.top_size(); ++j) {
      const v1::TokenLogprob& t = scored.top(j);
      const std::string key = std::to_string(t.token_id());
      if (entry.contains(key)) continue;
      entry[key] = Json{{"logprob", ClampedLogprob(t.logprob())},
                        {"rank", j + 1},
                        {"decoded_token", TokenLabelOf(t, /*as_ids=*/false)}};
    }
    out.push_back(std::move(entry));
  }
  return out;
}

// Appends each array of the logprobs object `more` to `into`'s array of the same key.
void AppendLogprobs(Json& into, Json more) {
  for (auto& [key, values] : more.items()) {
    for (Json& v : values) into[key].push_back(std::move(v));
  }
}

}  // namespace

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:  // a request id already in flight
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    case absl::StatusCode::kCancelled:
      return 499;
    default:
      return 500;
  }
}

Json ErrorJson(const absl::Status& status) {
  std::string code = ErrorCode(status);
  if (code.empty() && status.code() == absl::StatusCode::kResourceExhausted) {
    code = "rate_limit_exceeded";
  }
  // OpenAI reports an unknown model as an invalid request with code model_not_found.
  const char* type = code == "model_not_found" ? "invalid_request_error" : ErrorType(status.code());
  Json error;
  error["message"] = std::string(status.message());
  error["type"] = type;
  error["param"] = NullOr(ErrorParam(status));
  error["code"] = NullOr(code);
  Json body;
  body["error"] = std::move(error);
  return body;
}

std::string ErrorBody(const absl::Status& status) {
  return ErrorJson(status).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string ErrorBody(absl::string_view message, absl::string_view type) {
  Json body;
  body["error"] = Json{{"message", std::string(message)},
                       {"type", std::string(type)},
                       {"param", nullptr},
                       {"code", nullptr}};
  return body.dump(-1, ' ', false, Json::error_handler_t::replace);
}

int RetryAfterSeconds(absl::string_view message) {
  const std::string lower = absl::AsciiStrToLower(message);
  size_t pos = lower.find("retry");
  if (pos == std::string::npos) return 1;
  while (pos < lower.size() && !std::isdigit(static_cast<unsigned char>(lower[pos]))) ++pos;
  if (pos == lower.size()) return 1;
  const char* begin = lower.c_str() + pos;
  char* end = nullptr;
  double value = std::strtod(begin, &end);
  absl::string_view unit = absl::StripLeadingAsciiWhitespace(absl::string_view(end));
  if (absl::StartsWith(unit, "ms") || absl::StartsWith(unit, "milli")) {
    value /= 1000;
  } else if (absl::StartsWith(unit, "min")) {
    value *= 60;
  }
  if (!std::isfinite(value)) return 1;
  value = std::clamp(std::ceil(value), 1.0, kMaxRetryAfterSeconds);
  return static_cast<int>(value);
}

std::string SseEvent(const Json& data) {
  return absl::StrCat("data: ", data.dump(-1, ' ', false, Json::error_handler_t::replace), "\n\n");
}

void CompletionFormatter::set_id(std::string id) { context_.id = std::move(id); }

// An id for a tool call: "call_" and 24 random letters and digits, as OpenAI's.
static std::string NewToolCallId() {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local absl::BitGen bits;
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) {
    id.push_back(kAlphabet[absl::Uniform<size_t>(bits, 0, sizeof(kAlphabet) - 1)]);
  }
  return id;
}

CompletionFormatter::CompletionFormatter(ResponseContext context) : context_(std::move(context)) {
  if (context_.endpoint == Endpoint::kChat &&
      (context_.parse_tool_calls || context_.parse_reasoning)) {
    output_parser_.emplace(context_.parse_reasoning, context_.parse_tool_calls,
                           context_.max_tool_calls);
  }
  if (context_.endpoint == Endpoint::kCompletions) {
    logprobs_ = Json{{"tokens", Json::array()},
                     {"token_logprobs", Json::array()},
                     {"top_logprobs", Json::array()},
                     {"text_offset", Json::array()}};
  } else {
    logprobs_ = Json{{"content", Json::array()}};
  }
}

Json CompletionFormatter::ChunkEnvelope() const {
  Json chunk;
  chunk["id"] = context_.id;
  chunk["object"] =
      context_.endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion";
  chunk["created"] = context_.created;
  chunk["model"] = context_.model;
  return chunk;
}

Json CompletionFormatter::Logprobs(const v1::TextChunk& chunk, size_t text_offset) const {
  if (!context_.logprobs) return nullptr;
  const int n = chunk.token_ids_size();
  auto entry_logprob = [&](int k) -> Json {
    return k < chunk.logprobs_size() ? Json(chunk.logprobs(k).logprob()) : Json(nullptr);
  };
  // The chosen token's bytes, or null when the service did not send them.
  auto chosen_bytes = [&](int k) -> const std::string* {
    return k < chunk.logprobs_size() && chunk.logprobs(k).has_token_bytes()
               ? &chunk.logprobs(k).token_bytes()
               : nullptr;
  };
  auto chosen_label = [&](int k) {
    const std::string* bytes = chosen_bytes(k);
    return TokenLabel(chunk.token_ids(k), bytes != nullptr && !context_.tokens_as_ids,
                      bytes != nullptr ? *bytes : std::string());
  };
  if (context_.endpoint == Endpoint::kCompletions) {
    Json out{{"tokens", Json::array()},
             {"token_logprobs", Json::array()},
             {"top_logprobs", Json::array()},
             {"text_offset", Json::array()}};
    for (int k = 0; k < n; ++k) {
      const std::string chosen = chosen_label(k);
      out["tokens"].push_back(chosen);
      out["token_logprobs"].push_back(entry_logprob(k));
      Json top = Json::object();
      if (k < chunk.logprobs_size()) {
        for (const v1::TokenLogprob& t : chunk.logprobs(k).top()) {
          top[TokenLabelOf(t, context_.tokens_as_ids)] = t.logprob();
        }
        top[chosen] = chunk.logprobs(k).logprob();
      }
      out["top_logprobs"].push_back(std::move(top));
      // Each token starts where the ones before it in the chunk end, counted in code points of
      // their bytes (a partial character counts once, at its lead byte). Without the bytes every
      // token of the chunk starts where its text does.
      out["text_offset"].push_back(text_offset);
      if (const std::string* bytes = chosen_bytes(k)) text_offset += CountCodePoints(*bytes);
    }
    return out;
  }
  Json content = Json::array();
  for (int k = 0; k < n; ++k) {
    Json top = Json::array();
    if (k < chunk.logprobs_size()) {
      for (const v1::TokenLogprob& t : chunk.logprobs(k).top()) {
        top.push_back(Json{{"token", TokenLabelOf(t, context_.tokens_as_ids)},
                           {"logprob", t.logprob()},
                           {"bytes", BytesJson(t.has_token_bytes(), t.token_bytes())}});
      }
    }
    const std::string* bytes = chosen_bytes(k);
    content.push_back(Json{{"token", chosen_label(k)},
                           {"logprob", entry_logprob(k)},
                           {"bytes", bytes != nullptr ? BytesJson(true, *bytes) : Json(nullptr)},
                           {"top_logprobs", std::move(top)}});
  }
  return Json{{"content", std::move(content)}};
}

Json CompletionFormatter::EchoLogprobs(const v1::PromptEcho& prompt) const {
  Json out{{"tokens", Json::array()},
           {"token_logprobs", Json::array()},
           {"top_logprobs", Json::array()},
           {"text_offset", Json::array()}};
  size_t text_offset = 0;
  for (int k = 0; k < prompt.token_ids_size(); ++k) {
    const std::string* bytes = PromptTokenBytes(prompt, k);
    const std::string chosen =
        TokenLabel(prompt.token_ids(k), bytes != nullptr && !context_.tokens_as_ids,
                   bytes != nullptr ? *bytes : std::string());
    out["tokens"].push_back(chosen);
    // Token k > 0 is scored by logprobs[k - 1]; the first has nothing before it (null).
    if (k > 0 && k - 1 < prompt.logprobs_size()) {
      const v1::OutputLogprobs& scored = prompt.logprobs(k - 1);
      out["token_logprobs"].push_back(ClampedLogprob(scored.logprob()));
      Json top = Json::object();
      for (int j = 0; j < scored.top_size() && j < context_.top_logprobs; ++j) {
        top[TokenLabelOf(scored.top(j), context_.tokens_as_ids)] =
            ClampedLogprob(scored.top(j).logprob());
      }
      top[chosen] = ClampedLogprob(scored.logprob());
      out["top_logprobs"].push_back(std::move(top));
    } else {
      out["token_logprobs"].push_back(nullptr);
      out["top_logprobs"].push_back(nullptr);
    }
    out["text_offset"].push_back(text_offset);
    if (bytes != nullptr) text_offset += CountCodePoints(*bytes);
  }
  return out;
}

std::string CompletionFormatter::PromptEvent(const v1::PromptEcho& prompt) const {
  Json chunk = ChunkEnvelope();
  chunk["choices"] = Json::array({Json{{"index", context_.choice_index},
                                       {"delta", Json::object()},
                                       {"logprobs", nullptr},
                                       {"finish_reason", nullptr}}});
  if (context_.prompt_logprobs) chunk["prompt_logprobs"] = PromptLogprobsJson(prompt);
  if (context_.return_token_ids) chunk["prompt_token_ids"] = IdsJson(prompt.token_ids());
  if (context_.include_usage) chunk["usage"] = nullptr;
  return SseEvent(chunk);
}

Json CompletionFormatter::TokenIds(const v1::TextChunk& piece) const {
  if (!context_.return_token_ids) return nullptr;
  return IdsJson(piece.token_ids());
}

static Json UsageJson(const v1::Usage& usage) {
  return Json{{"prompt_tokens", usage.prompt_tokens()},
              {"completion_tokens", usage.completion_tokens()},
              {"total_tokens", usage.prompt_tokens() + usage.completion_tokens()},
              {"prompt_tokens_details", Json{{"cached_tokens", usage.cached_tokens()}}}};
}

Json CompletionFormatter::StopReason() const {
  switch (final_.matched_stop_case()) {
    case v1::TextComplete::kMatchedTokenId:
      return final_.matched_token_id();
    case v1::TextComplete::kMatchedString:
      return final_.matched_string();
    case v1::TextComplete::MATCHED_STOP_NOT_SET:
      break;
  }
  return nullptr;
}

std::string CompletionFormatter::StreamStart() const {
  if (context_.endpoint != Endpoint::kChat) return "";
  Json chunk = ChunkEnvelope();
  chunk["choices"] = Json::array({Json{{"index", context_.choice_index},
                                       {"delta", Json{{"role", "assistant"}, {"content", ""}}},
                                       {"logprobs", nullptr},
                                       {"finish_reason", nullptr}}});
  if (context_.include_usage) chunk["usage"] = nullptr;
  return SseEvent(chunk);
}

Json CompletionFormatter::ToolCallJson(const ParsedToolCall& call, int position, bool with_index) {
  Json json;
  if (with_index) json["index"] = position;
  const size_t k = static_cast<size_t>(position);
  while (tool_call_ids_.size() <= k) tool_call_ids_.push_back(NewToolCallId());
  json["id"] = tool_call_ids_[k];
  json["type"] = "function";
  json["function"] = Json{{"name", call.name}, {"arguments", call.arguments}};
  return json;
}

const char* CompletionFormatter::ChoiceFinishReason(int calls) const {
  if (calls > 0 && final_.finish_reason() == v1::FINISH_REASON_STOP) return "tool_calls";
  return FinishReason(final_.finish_reason());
}

std::string CompletionFormatter::DeltaEvent(Json delta, Json logprobs, Json token_ids) {
  Json choice;
  choice["index"] = context_.choice_index;
  choice["delta"] = std::move(delta);
  choice["logprobs"] = std::move(logprobs);
  choice["finish_reason"] = nullptr;
  if (!token_ids.is_null()) choice["token_ids"] = std::move(token_ids);
  Json chunk = ChunkEnvelope();
  chunk["choices"] = Json::array({std::move(choice)});
  if (context_.include_usage) chunk["usage"] = nullptr;
  return SseEvent(chunk);
}

std::string CompletionFormatter::ParsedChatEvents(const v1::TextChunk* piece) {
  ChatOutputParser::Step step =
      piece != nullptr ? output_parser_->Push(piece->text()) : output_parser_->Finish();
  const bool tokens = piece != nullptr && piece->token_ids_size() > 0;
  Json logprobs = tokens && context_.logprobs ? Logprobs(*piece, 0) : Json(nullptr);
  // The piece's ids go with its first event, as its logprobs do.
  Json token_ids = tokens ? TokenIds(*piece) : Json(nullptr);
  std::string events;
  if (!step.reasoning.empty()) {
    events += DeltaEvent(Json{{"reasoning_content", step.reasoning}}, std::move(logprobs),
                         std::move(token_ids));
    logprobs = nullptr;
    token_ids = nullptr;
  }
  if (!step.content.empty() || !logprobs.is_null() || !token_ids.is_null()) {
    events +=
        DeltaEvent(Json{{"content", step.content}}, std::move(logprobs), std::move(token_ids));
  }
  for (const ParsedToolCall& call : step.calls) {
    const int position = tool_calls_sent_++;
    events += DeltaEvent(Json{{"tool_calls", Json::array({ToolCallJson(call, position, true)})}},
                         nullptr);
  }
  return events;
}

std::string CompletionFormatter::StreamEvents(const v1::GenerateResponse& response) {
  std::string head;
  if (context_.endpoint == Endpoint::kChat &&
      (context_.prompt_logprobs || context_.return_token_ids) && response.has_chunk() &&
      response.chunk().has_prompt()) {
    head = PromptEvent(response.chunk().prompt());
  }
  return head + ChoiceEvents(response);
}

std::string CompletionFormatter::ChoiceEvents(const v1::GenerateResponse& response) {
  const bool chat = context_.endpoint == Endpoint::kChat;
  const bool parsed = output_parser_.has_value();
  if (parsed && response.has_chunk()) return ParsedChatEvents(&response.chunk());
  std::string tail;  // a parsed stream's held-back text and last calls
  if (parsed && response.has_complete()) tail = ParsedChatEvents(nullptr);
  if (response.has_chunk()) {
    const v1::TextChunk& piece = response.chunk();
    // Completions: the prompt (echo) and its scores go out with the choice's first event.
    const bool prompt = !chat && piece.has_prompt() &&
                        (context_.echo || context_.prompt_logprobs || context_.return_token_ids);
    const bool tokens = piece.token_ids_size() > 0;
    if (piece.text().empty() && !((context_.logprobs || context_.return_token_ids) && tokens) &&
        !prompt) {
      return "";
    }
    Json choice;
    choice["index"] = context_.choice_index;
    Json logprobs = nullptr;
    if (chat) {
      choice["delta"] = Json{{"content", piece.text()}};
    } else if (prompt && context_.echo) {
      // With return_token_ids the prompt is in prompt_token_ids, not the text (vLLM's).
      const std::string& echoed = context_.return_token_ids ? "" : piece.prompt().text();
      choice["text"] = echoed + piece.text();
      if (context_.logprobs) logprobs = EchoLogprobs(piece.prompt());
      text_chars_ += CountCodePoints(echoed);
    } else {
      choice["text"] = piece.text();
    }
    if (context_.logprobs) {
      Json own = Logprobs(piece, text_chars_);
      if (logprobs.is_null()) {
        logprobs = std::move(own);
      } else {
        AppendLogprobs(logprobs, std::move(own));
      }
    }
    choice["logprobs"] = std::move(logprobs);
    choice["finish_reason"] = nullptr;
    if (prompt && context_.prompt_logprobs) {
      choice["prompt_logprobs"] = PromptLogprobsJson(piece.prompt());
    }
    if (prompt && context_.return_token_ids) {
      choice["prompt_token_ids"] = IdsJson(piece.prompt().token_ids());
    }
    if (context_.return_token_ids) choice["token_ids"] = TokenIds(piece);
    text_chars_ += CountCodePoints(piece.text());
    Json chunk = ChunkEnvelope();
    chunk["choices"] = Json::array({std::move(choice)});
    if (context_.include_usage) chunk["usage"] = nullptr;
    return SseEvent(chunk);
  }
  if (!response.has_complete()) return "";
  complete_ = true;
  final_ = response.complete();
  Json choice;
  choice["index"] = context_.choice_index;
  if (chat) {
    choice["delta"] = Json::object();
  } else {
    choice["text"] = "";
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = ChoiceFinishReason(tool_calls_sent_);
  choice["stop_reason"] = StopReason();
  Json chunk = ChunkEnvelope();
  chunk["choices"] = Json::array({std::move(choice)});
  if (context_.include_usage) chunk["usage"] = nullptr;
  return tail + SseEvent(chunk);
}

std::string CompletionFormatter::StreamEnd(const v1::Usage& usage) const {
  std::string events;
  if (context_.include_usage) {
    Json usage_chunk = ChunkEnvelope();
    usage_chunk["choices"] = Json::array();
    usage_chunk["usage"] = UsageJson(usage);
    events += SseEvent(usage_chunk);
  }
  return events + kSseDone;
}

std::string CompletionFormatter::StreamError(const absl::Status& status) {
  return absl::StrCat(SseEvent(ErrorJson(status)), kSseDone);
}

void CompletionFormatter::Append(const v1::GenerateResponse& response) {
  if (response.has_chunk()) {
    const v1::TextChunk& piece = response.chunk();
    if (piece.has_prompt()) {
      if (context_.prompt_logprobs) prompt_logprobs_ = PromptLogprobsJson(piece.prompt());
      if (context_.return_token_ids) prompt_token_ids_ = IdsJson(piece.prompt().token_ids());
      if (context_.echo && context_.endpoint == Endpoint::kCompletions) {
        // With return_token_ids the prompt is in prompt_token_ids, not the text (vLLM's).
        if (!context_.return_token_ids) {
          text_ += piece.prompt().text();
          text_chars_ += CountCodePoints(piece.prompt().text());
        }
        if (context_.logprobs) AppendLogprobs(logprobs_, EchoLogprobs(piece.prompt()));
      }
    }
    for (int32_t id : piece.token_ids()) token_ids_.push_back(id);
    if (context_.logprobs) {
      AppendLogprobs(logprobs_, Logprobs(piece, text_chars_));
    }
    text_ += piece.text();
    text_chars_ += CountCodePoints(piece.text());
  } else if (response.has_complete()) {
    complete_ = true;
    final_ = response.complete();
  }
}

Json CompletionFormatter::Choice() {
  Json choice;
  choice["index"] = context_.choice_index;
  int calls = 0;
  if (context_.endpoint == Endpoint::kChat &&
      (context_.parse_tool_calls || context_.parse_reasoning)) {
    // The whole text through the same parsers a stream uses: the same reasoning, content and
    // calls.
    const ChatOutputParser::Step step =
        ChatOutputParser(context_.parse_reasoning, context_.parse_tool_calls,
                         context_.max_tool_calls)
            .Parse(text_);
    Json message{{"role", "assistant"},
                 {"content", step.content.empty() ? Json(nullptr) : Json(step.content)}};
    if (context_.parse_reasoning) {
      message["reasoning_content"] = step.reasoning.empty() ? Json(nullptr) : Json(step.reasoning);
    }
    if (!step.calls.empty()) {
      message["tool_calls"] = Json::array();
      for (size_t k = 0; k < step.calls.size(); ++k) {
        message["tool_calls"].push_back(ToolCallJson(step.calls[k], static_cast<int>(k), false));
      }
    }
    calls = static_cast<int>(step.calls.size());
    choice["message"] = std::move(message);
  } else if (context_.endpoint == Endpoint::kChat) {
    choice["message"] = Json{{"role", "assistant"}, {"content", text_}};
  } else {
    choice["text"] = text_;
  }
  choice["logprobs"] = context_.logprobs ? logprobs_ : Json(nullptr);
  choice["finish_reason"] = ChoiceFinishReason(calls);
  choice["stop_reason"] = StopReason();
  if (context_.prompt_logprobs && context_.endpoint == Endpoint::kCompletions) {
    choice["prompt_logprobs"] = prompt_logprobs_;
  }
  if (context_.return_token_ids) {
    if (context_.endpoint == Endpoint::kCompletions) choice["prompt_token_ids"] = prompt_token_ids_;
    choice["token_ids"] = token_ids_;
  }
  return choice;
}

std::string CompletionFormatter::Body(std::span<CompletionFormatter> choices,
                                      const v1::Usage& usage) {
  Json body;
  if (!choices.empty()) {
    const ResponseContext& context = choices.front().context_;
    body["id"] = context.id;
    body["object"] = context.endpoint == Endpoint::kChat ? "chat.completion" : "text_completion";
    body["created"] = context.created;
    body["model"] = context.model;
  }
  body["choices"] = Json::array();
  for (CompletionFormatter& choice : choices) body["choices"].push_back(choice.Choice());
  body["usage"] = UsageJson(usage);
  // Chat's prompt_logprobs and prompt_token_ids belong to the response (every choice has the
  // same prompt).
  if (!choices.empty() && choices.front().context_.endpoint == Endpoint::kChat) {
    const CompletionFormatter& first = choices.front();
    if (first.context_.prompt_logprobs) body["prompt_logprobs"] = first.prompt_logprobs_;
    if (first.context_.return_token_ids) body["prompt_token_ids"] = first.prompt_token_ids_;
  }
  return body.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace mobius::router::openai
