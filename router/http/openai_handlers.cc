#include "router/http/openai_handlers.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/text_serializer.h>
#include <nlohmann/json.hpp>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "router/http/choice_fan_out.h"
#include "router/http/openai_request.h"
#include "router/http/structured_output_request.h"

namespace mobius::router::openai {
namespace {

namespace http = boost::beast::http;
using Json = nlohmann::ordered_json;

constexpr char kRequestIdHeader[] = "X-Request-Id";
constexpr char kRequestTimeoutHeader[] = "X-Request-Timeout";
constexpr size_t kMaxRequestIdLength = 256;

absl::string_view View(boost::beast::string_view s) {
  return absl::string_view(s.data(), s.size());
}

HttpResponse MakeResponse(const HttpRequest& request, http::status status, std::string body,
                          absl::string_view content_type) {
  HttpResponse response(status, request.version());
  response.set(http::field::content_type,
               boost::beast::string_view(content_type.data(), content_type.size()));
  response.keep_alive(request.keep_alive());
  response.body() = std::move(body);
  response.prepare_payload();
  return response;
}

HttpResponse JsonResponse(const HttpRequest& request, const Json& body) {
  return MakeResponse(request, http::status::ok,
                      body.dump(-1, ' ', false, Json::error_handler_t::replace),
                      "application/json");
}

HttpResponse PlainError(const HttpRequest& request, http::status status, absl::string_view message,
                        absl::string_view type) {
  return MakeResponse(request, status, ErrorBody(message, type), "application/json");
}

void SetRequestId(HttpResponseHeader& header, const std::string& id) {
  if (!id.empty()) header.set(kRequestIdHeader, id);
}

// X-Request-Id: echoed in the response and used as the service's request id.
absl::StatusOr<std::string> RequestIdHeader(const HttpRequest& request) {
  auto it = request.find(kRequestIdHeader);
  if (it == request.end()) return std::string();
  const absl::string_view id = View(it->value());
  const bool printable =
      std::all_of(id.begin(), id.end(), [](char c) { return c > 0x20 && c < 0x7f; });
  if (id.empty() || id.size() > kMaxRequestIdLength || !printable) {
    return FieldError(kRequestIdHeader,
                      absl::StrCat(kRequestIdHeader, " must be 1 to ", kMaxRequestIdLength,
                                   " printable ASCII characters without spaces"));
  }
  return std::string(id);
}

// X-Request-Timeout: seconds (decimal) the client will wait; becomes the call's deadline.
absl::StatusOr<absl::Time> DeadlineHeader(const HttpRequest& request) {
  auto it = request.find(kRequestTimeoutHeader);
  if (it == request.end()) return absl::InfiniteFuture();
  double seconds = 0;
  if (!absl::SimpleAtod(View(it->value()), &seconds) || !std::isfinite(seconds) || seconds <= 0) {
    return FieldError(
        kRequestTimeoutHeader,
        absl::StrCat(kRequestTimeoutHeader, " must be a positive number of seconds, got \"",
                     View(it->value()), "\""));
  }
  return absl::Now() + absl::Seconds(seconds);
}

// An id for a request with several choices whose client gave none: the choices' service calls
// are named after it, so it is made here. 64 random bits: unique among the requests in flight,
// which is where the service requires uniqueness.
std::string NewRequestId() {
  thread_local absl::BitGen bits;  // seeded from the OS entropy source
  return absl::StrFormat("http-%016x", absl::Uniform<uint64_t>(bits));
}

// A service error about the prompt names which prompt of a batch it is about.
absl::Status ForBatchPrompt(const absl::Status& status, int prompt, size_t prompts) {
  if (status.code() != absl::StatusCode::kInvalidArgument || prompts <= 1 || prompt < 0 ||
      ErrorParam(status) != "prompt") {
    return status;
  }
  std::string message(status.message());
  const std::string indexed = absl::StrCat("prompt[", prompt, "]");
  if (absl::StartsWith(message, "prompt")) {
    message.replace(0, 6, indexed);
  } else {
    message = absl::StrCat(indexed, ": ", message);
  }
  return FieldError(indexed, message);  // only INVALID_ARGUMENT names a field
}

// A request body must be JSON; a request without Content-Type is read as JSON too (curl -d
// without -H sends form encoding, which is refused, but scripts that send none are not).
bool IsJsonContentType(const HttpRequest& request) {
  auto it = request.find(http::field::content_type);
  if (it == request.end()) return true;
  absl::string_view type = View(it->value());
  type = type.substr(0, type.find(';'));
  return absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(type), "application/json");
}

// The JSON body of a POST: its Content-Type checked (JSON, or none), then parsed.
absl::StatusOr<nlohmann::json> JsonBody(const HttpRequest& request) {
  if (!IsJsonContentType(request)) {
    return FieldError("", absl::StrCat("Content-Type must be application/json, got \"",
                                       View(request[http::field::content_type]), "\""));
  }
  return ParseJsonBody(request.body());
}

// Holds back a completion's whole response (an error or a non-streamed answer) until the
// request has been counted: a client that reads /metrics right after its answer then finds it
// (the counter was bumped after the send, and CI once scraped in between). A stream's header and
// events go out at once; its end is held the same way, though its [DONE] event is already out.
class CountedResponseSink final : public ResponseSink {
 public:
  explicit CountedResponseSink(ResponseSink& inner) : inner_(inner) {}
  void Send(HttpResponse response) override { response_ = std::move(response); }
  bool StartStream(HttpResponseHeader header) override {
    return inner_.StartStream(std::move(header));
  }
  bool Write(std::string data) override { return inner_.Write(std::move(data)); }
  void EndStream(bool close) override { end_close_ = close; }
  [[nodiscard]] const std::atomic<bool>& cancelled() const override { return inner_.cancelled(); }
  // Sends what was held back.
  void Release() {
    if (response_.has_value()) inner_.Send(*std::move(response_));
    if (end_close_.has_value()) inner_.EndStream(*end_close_);
  }

 private:
  ResponseSink& inner_;
  std::optional<HttpResponse> response_;
  std::optional<bool> end_close_;
};

}  // namespace

HttpResponse ErrorResponse(const HttpRequest& request, const absl::Status& status) {
  HttpResponse response =
      MakeResponse(request, static_cast<http::status>(HttpStatusFor(status.code())),
                   ErrorBody(status), "application/json");
  if (status.code() == absl::StatusCode::kResourceExhausted) {
    response.set(http::field::retry_after, absl::StrCat(RetryAfterSeconds(status.message())));
  }
  return response;
}

OpenAiApi::OpenAiApi(InferenceService& service, HttpServerOptions options)
    : service_(service), options_(std::move(options)), created_(absl::ToUnixSeconds(absl::Now())) {}

void OpenAiApi::Handle(const HttpRequest& request, ResponseSink& sink) {
  absl::string_view path = View(request.target());
  path = path.substr(0, path.find('?'));
  const http::verb method = request.method();

  auto allow_only = [&](http::verb allowed) {
    if (method == allowed) return true;
    HttpResponse response =
        PlainError(request, http::status::method_not_allowed,
                   absl::StrCat("method ", View(request.method_string()), " is not allowed on ",
                                path, "; use ", View(http::to_string(allowed))),
                   "invalid_request_error");
    response.set(http::field::allow, http::to_string(allowed));
    sink.Send(std::move(response));
    return false;
  };

  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (!allow_only(http::verb::post)) return;
    CountedResponseSink counted(sink);
    const absl::Status status =
        Generate(request, path == "/v1/chat/completions" ? Endpoint::kChat : Endpoint::kCompletions,
                 counted);
    if (options_.on_generate_done) options_.on_generate_done(status.code());
    counted.Release();
  } else if (path == "/v1/models") {
    if (allow_only(http::verb::get)) ListModels(request, sink);
  } else if (absl::StartsWith(path, "/v1/models/")) {
    if (allow_only(http::verb::get)) {
      GetModel(request, std::string(path.substr(sizeof("/v1/models/") - 1)), sink);
    }
  } else if (path == "/tokenize") {
    if (allow_only(http::verb::post)) Tokenize(request, sink);
  } else if (path == "/detokenize") {
    if (allow_only(http::verb::post)) Detokenize(request, sink);
  } else if (path == "/health") {
    if (allow_only(http::verb::get)) Health(request, sink);
  } else if (path == "/metrics") {
    if (allow_only(http::verb::get)) Metrics(request, sink);
  } else {
    sink.Send(PlainError(request, http::status::not_found, absl::StrCat("no route for ", path),
                         "not_found_error"));
  }
}

absl::Status OpenAiApi::Generate(const HttpRequest& request, Endpoint endpoint,
                                 ResponseSink& sink) {
  const int64_t created = absl::ToUnixSeconds(absl::Now());
  absl::StatusOr<std::string> request_id = RequestIdHeader(request);
  if (!request_id.ok()) {
    sink.Send(ErrorResponse(request, request_id.status()));
    return request_id.status();
  }
  auto fail = [&](const absl::Status& status) {
    HttpResponse response = ErrorResponse(request, status);
    SetRequestId(response.base(), *request_id);
    sink.Send(std::move(response));
    return status;
  };
  absl::StatusOr<nlohmann::json> body = JsonBody(request);
  if (!body.ok()) return fail(body.status());
  absl::StatusOr<absl::Time> deadline = DeadlineHeader(request);
  if (!deadline.ok()) return fail(deadline.status());

  ResponseContext context;
  context.endpoint = endpoint;
  context.created = created;
  // The name clients must use: --served-model-name, else the workers' own name (so that an
  // unknown `model` is refused in both cases, as OpenAI and vLLM do).
  context.model = ModelName();
  std::vector<v1::GenerateRequest> prompts;
  int n = 1;
  bool stream = false;
  std::optional<std::string> forced_tool;  // chat's tool_choice "required" or a named function
  bool parallel_tool_calls = true;
  bool reasoning_first = false;  // chat of a reasoning model with thinking on
  if (endpoint == Endpoint::kCompletions) {
    absl::StatusOr<CompletionParams> params = ParseCompletionRequest(*body, context.model);
    if (!params.ok()) return fail(params.status());
    prompts = std::move(params->prompts);
    n = params->n;
    stream = params->stream;
    context.include_usage = params->include_usage;
    context.logprobs = params->logprobs;
    context.tokens_as_ids = params->tokens_as_ids;
    context.echo = params->echo;
    context.return_token_ids = params->return_token_ids;
    if (!prompts.empty()) {
      const v1::SamplingParams& sampling = prompts.front().sampling_params();
      context.top_logprobs = sampling.logprobs();
      context.prompt_logprobs = sampling.has_prompt_logprobs();
    }
  } else {
    absl::StatusOr<ChatParams> params = ParseChatRequest(*body, context.model);
    if (!params.ok()) return fail(params.status());
    context.parse_reasoning = options_.parse_reasoning;
    reasoning_first = options_.parse_reasoning && params->enable_thinking;
    std::vector<std::string> tools;
    if (params->use_tools) {
      absl::StatusOr<std::vector<std::string>> definitions = ToolDefinitions(request.body());
      if (!definitions.ok()) return fail(definitions.status());
      tools = *std::move(definitions);
      context.parse_tool_calls = true;
      if (!params->parallel_tool_calls) context.max_tool_calls = 1;
      parallel_tool_calls = params->parallel_tool_calls;
      forced_tool = params->forced_tool;
    }
    absl::StatusOr<std::string> prompt =
        service_.RenderChat(params->messages, {.tools = std::move(tools),
                                               .add_generation_prompt = true,
                                               .enable_thinking = params->enable_thinking});
    if (!prompt.ok()) return fail(prompt.status());
    if (!params->sampling.has_max_tokens()) DefaultChatMaxTokens(&params->sampling);
    v1::GenerateRequest& generate = prompts.emplace_back();
    generate.set_text(*std::move(prompt));
    generate.set_echo(params->return_token_ids);  // the prompt's ids come with its echo
    *generate.mutable_sampling_params() = std::move(params->sampling);
    if (params->truncate_prompt_tokens.has_value()) {
      generate.set_truncate_prompt_tokens(*params->truncate_prompt_tokens);
    }
    n = params->n;
    stream = params->stream;
    context.include_usage = params->include_usage;
    context.logprobs = params->logprobs;
    context.tokens_as_ids = params->tokens_as_ids;
    context.prompt_logprobs = generate.sampling_params().has_prompt_logprobs();
    context.return_token_ids = params->return_token_ids;
  }

  if (forced_tool.has_value()) {
    absl::StatusOr<v1::StructuredOutput> form =
        ForcedToolCallForm(request.body(), *forced_tool, parallel_tool_calls);
    if (!form.ok()) return fail(form.status());
    for (v1::GenerateRequest& p : prompts) {
      *p.mutable_sampling_params()->mutable_structured_output() = *form;
    }
  }
  // A JSON schema's properties are generated in their declared order, which the body as parsed
  // above lost (its objects sort their keys): the schema's text comes from the body again.
  if (!prompts.empty() && prompts.front().sampling_params().structured_output().has_json_schema()) {
    absl::StatusOr<std::string> schema = OrderedSchemaText(request.body());
    if (!schema.ok()) return fail(schema.status());
    for (v1::GenerateRequest& p : prompts) {
      p.mutable_sampling_params()->mutable_structured_output()->set_json_schema(*schema);
    }
  }

  // A reasoning model thinks before it answers: the form holds after its "</think>", so that a
  // constrained answer does not cost it its reasoning (vLLM's reasoning-aware structured output).
  if (reasoning_first) {
    for (v1::GenerateRequest& p : prompts) {
      if (p.sampling_params().has_structured_output()) {
        p.mutable_sampling_params()->mutable_structured_output()->set_reasoning_end("</think>");
      }
    }
  }

  // One choice keeps the client's id, or none, and the service assigns one (its messages carry
  // it). Several are named "<id>-<index>" after one id, ours when the client gave none.
  std::string service_id = *request_id;
  if (service_id.empty() && prompts.size() * static_cast<size_t>(n) > 1) {
    service_id = NewRequestId();
  }
  const std::vector<v1::GenerateRequest> choices = ExpandChoices(prompts, n, service_id);
  const char* id_prefix = endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-";
  std::vector<CompletionFormatter> formatters;
  formatters.reserve(choices.size());
  for (size_t i = 0; i < choices.size(); ++i) {
    ResponseContext choice_context = context;
    choice_context.choice_index = static_cast<int>(i);
    if (!service_id.empty()) choice_context.id = absl::StrCat(id_prefix, service_id);
    formatters.emplace_back(std::move(choice_context));
  }
  auto learn_id = [&](const v1::GenerateResponse& response) {
    if (!service_id.empty()) return;
    service_id = response.request_id();
    for (CompletionFormatter& f : formatters) f.set_id(absl::StrCat(id_prefix, service_id));
  };
  // The usage of the whole response: each prompt's tokens once (all its choices report them),
  // every choice's output.
  auto total_usage = [&] {
    v1::Usage usage;
    for (size_t i = 0; i < formatters.size(); ++i) {
      const v1::Usage& u = formatters[i].usage();
      if (i % static_cast<size_t>(n) == 0) {
        usage.set_prompt_tokens(usage.prompt_tokens() + u.prompt_tokens());
        usage.set_cached_tokens(usage.cached_tokens() + u.cached_tokens());
      }
      usage.set_completion_tokens(usage.completion_tokens() + u.completion_tokens());
    }
    return usage;
  };
  auto all_complete = [&] {
    return std::all_of(formatters.begin(), formatters.end(),
                       [](const CompletionFormatter& f) { return f.complete(); });
  };
  CallContext call;
  call.deadline = *deadline;
  call.cancelled = &sink.cancelled();

  const bool chat = endpoint == Endpoint::kChat;
  if (!stream) {
    int failed = -1;
    absl::Status status = RunChoices(
        service_, choices, call,
        [&](int choice, const v1::GenerateResponse& r) {
          learn_id(r);
          formatters[choice].Append(r);
          return !sink.cancelled().load();
        },
        &failed);
    status =
        ForBatchPrompt(ForOpenAiClient(status, chat), failed < 0 ? -1 : failed / n, prompts.size());
    if (status.ok() && !all_complete()) {
      status = absl::InternalError("the service ended the request without a final message");
    }
    if (!status.ok()) {
      HttpResponse response = ErrorResponse(request, status);
      SetRequestId(response.base(), service_id);
      sink.Send(std::move(response));
      return status;
    }
    HttpResponse response =
        MakeResponse(request, http::status::ok,
                     CompletionFormatter::Body(formatters, total_usage()), "application/json");
    SetRequestId(response.base(), service_id);
    sink.Send(std::move(response));
    return status;
  }

  // Streams start once every choice has sent its first message, so that errors found before it
  // (an invalid prompt of a batch, queue full, no replica) still get their own HTTP status, as
  // when the request had one choice. Until then the messages wait here, in arrival order.
  bool started = false;
  bool client_gone = false;
  std::vector<bool> answered(choices.size(), false);
  size_t unanswered = choices.size();
  std::vector<std::pair<int, v1::GenerateResponse>> waiting;
  int failed = -1;
  absl::Status status = RunChoices(
      service_, choices, call,
      [&](int choice, const v1::GenerateResponse& r) {
        if (client_gone) return false;
        learn_id(r);
        if (!answered[choice]) {
          answered[choice] = true;
          --unanswered;
        }
        if (!started) {
          waiting.emplace_back(choice, r);
          if (unanswered > 0) return true;
          HttpResponseHeader header;
          header.version(request.version());
          header.result(http::status::ok);
          header.set(http::field::content_type, "text/event-stream");
          header.set(http::field::cache_control, "no-cache");
          SetRequestId(header, service_id);
          started = true;
          if (!sink.StartStream(std::move(header))) {
            client_gone = true;
            return false;
          }
          // Chat opens every choice with its role.
          std::string events;
          for (const CompletionFormatter& f : formatters) events += f.StreamStart();
          for (const auto& [c, message] : waiting) events += formatters[c].StreamEvents(message);
          waiting.clear();
          if (!events.empty() && !sink.Write(std::move(events))) client_gone = true;
          return !client_gone;
        }
        std::string events = formatters[choice].StreamEvents(r);
        if (!events.empty() && !sink.Write(std::move(events))) client_gone = true;
        return !client_gone;
      },
      &failed);
  status =
      ForBatchPrompt(ForOpenAiClient(status, chat), failed < 0 ? -1 : failed / n, prompts.size());
  if (!started) {
    if (status.ok()) {
      status = absl::InternalError("the service ended the request without a final message");
    }
    HttpResponse response = ErrorResponse(request, status);
    SetRequestId(response.base(), service_id);
    sink.Send(std::move(response));
    return status;
  }
  if (status.ok() && !all_complete()) {
    status = absl::InternalError("the service ended the stream without a final message");
  }
  if (!status.ok()) {
    // As vLLM does: the error as an event, then [DONE]; the connection is not reused.
    if (!client_gone) sink.Write(CompletionFormatter::StreamError(status));
    sink.EndStream(/*close=*/true);
    return status;
  }
  if (!client_gone && !sink.Write(formatters.front().StreamEnd(total_usage()))) client_gone = true;
  sink.EndStream(/*close=*/client_gone);
  return status;
}

void OpenAiApi::DefaultChatMaxTokens(v1::SamplingParams* sampling) {
  // The service clamps max_tokens to what the context leaves after the prompt, so the whole
  // context length means "until the context is full" without tokenizing the prompt twice.
  if (const int32_t context_length = MaxContextLength(); context_length > 0) {
    sampling->set_max_tokens(context_length);
  }
}

int32_t OpenAiApi::MaxContextLength() {
  // Asked every time, not cached: the service's length is the least of the replicas that have
  // answered, and it drops when a replica with a shorter context joins. A cached default then
  // exceeded it, and every chat request without max_tokens was refused for a field the client
  // never sent.
  absl::StatusOr<v1::ModelInfo> info = service_.GetModelInfo();
  if (!info.ok()) return 0;  // the replicas may not be up yet
  return std::max(info->max_context_length(), 0);
}

std::string OpenAiApi::ModelName() {
  if (!options_.served_model_name.empty()) return options_.served_model_name;
  absl::StatusOr<v1::ModelInfo> info = service_.GetModelInfo();
  return info.ok() ? info->model_name() : std::string();
}

void OpenAiApi::ListModels(const HttpRequest& request, ResponseSink& sink) {
  Json model{
      {"id", ModelName()}, {"object", "model"}, {"created", created_}, {"owned_by", "mobius"}};
  if (const int32_t length = MaxContextLength(); length > 0) model["max_model_len"] = length;
  sink.Send(JsonResponse(request, Json{{"object", "list"}, {"data", Json::array({model})}}));
}

void OpenAiApi::GetModel(const HttpRequest& request, const std::string& id, ResponseSink& sink) {
  if (id != ModelName()) return sink.Send(ErrorResponse(request, ModelNotFoundError(id)));
  Json model{{"id", id}, {"object", "model"}, {"created", created_}, {"owned_by", "mobius"}};
  if (const int32_t length = MaxContextLength(); length > 0) model["max_model_len"] = length;
  sink.Send(JsonResponse(request, model));
}

void OpenAiApi::Tokenize(const HttpRequest& request, ResponseSink& sink) {
  absl::StatusOr<nlohmann::json> body = JsonBody(request);
  if (!body.ok()) return sink.Send(ErrorResponse(request, body.status()));
  absl::StatusOr<TokenizeParams> params = ParseTokenizeRequest(*body, ModelName());
  if (!params.ok()) return sink.Send(ErrorResponse(request, params.status()));
  v1::TokenizeRequest tokenize;
  if (params->prompt.has_value()) {
    tokenize.set_text(*params->prompt);
  } else {
    // The prompt the chat endpoint would send for these messages.
    std::vector<std::string> tools;
    if (params->use_tools) {
      absl::StatusOr<std::vector<std::string>> definitions = ToolDefinitions(request.body());
      if (!definitions.ok()) return sink.Send(ErrorResponse(request, definitions.status()));
      tools = *std::move(definitions);
    }
    absl::StatusOr<std::string> text = service_.RenderChat(
        params->messages, {.tools = std::move(tools),
                           .add_generation_prompt = params->add_generation_prompt,
                           .enable_thinking = params->enable_thinking});
    if (!text.ok()) return sink.Send(ErrorResponse(request, text.status()));
    tokenize.set_text(*std::move(text));
  }
  absl::StatusOr<v1::TokenizeResponse> ids = service_.Tokenize(tokenize);
  if (!ids.ok()) return sink.Send(ErrorResponse(request, ids.status()));
  Json out{{"count", ids->ids_size()}};
  if (const int32_t length = MaxContextLength(); length > 0) out["max_model_len"] = length;
  out["tokens"] = std::vector<int32_t>(ids->ids().begin(), ids->ids().end());
  sink.Send(JsonResponse(request, out));
}

void OpenAiApi::Detokenize(const HttpRequest& request, ResponseSink& sink) {
  absl::StatusOr<nlohmann::json> body = JsonBody(request);
  if (!body.ok()) return sink.Send(ErrorResponse(request, body.status()));
  absl::StatusOr<v1::DetokenizeRequest> params = ParseDetokenizeRequest(*body, ModelName());
  if (!params.ok()) return sink.Send(ErrorResponse(request, params.status()));
  absl::StatusOr<v1::DetokenizeResponse> text = service_.Detokenize(*params);
  if (!text.ok()) {
    absl::Status status = text.status();
    // The service names its field "ids"; this API's is "tokens".
    if (RequestFieldOf(status) == "ids") {
      std::string message(status.message());
      if (absl::StartsWith(message, "ids")) message.replace(0, 3, "tokens");
      status = FieldError("tokens", message);
    }
    return sink.Send(ErrorResponse(request, status));
  }
  sink.Send(JsonResponse(request, Json{{"prompt", text->text()}}));
}

void OpenAiApi::Health(const HttpRequest& request, ResponseSink& sink) {
  if (service_.Ready()) {
    return sink.Send(MakeResponse(request, http::status::ok, "", "text/plain"));
  }
  sink.Send(PlainError(request, http::status::service_unavailable,
                       "no healthy replica, or the router is draining",
                       "service_unavailable_error"));
}

void OpenAiApi::Metrics(const HttpRequest& request, ResponseSink& sink) {
  if (options_.metrics == nullptr) {
    return sink.Send(PlainError(request, http::status::not_found, "this server exports no metrics",
                                "not_found_error"));
  }
  std::ostringstream text;
  prometheus::TextSerializer().Serialize(text, options_.metrics->Collect());
  sink.Send(MakeResponse(request, http::status::ok, text.str(),
                         "text/plain; version=0.0.4; charset=utf-8"));
}

}  // namespace mobius::router::openai
