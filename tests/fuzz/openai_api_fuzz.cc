// Fuzzes the OpenAI-compatible HTTP API end to end above the socket: raw request bytes parsed as
// the server parses them (Beast), answered by OpenAiApi::Handle over a scripted service that
// streams a fuzzed model output back. Whatever the request and the output, the handler must
// answer exactly once, with well-formed JSON bodies and server-sent events, and never throw
// (a JSON dump of text that is not UTF-8 would) or crash.
//
// Input: a flags byte, the model's output text, a 0 byte, then the HTTP request.
#include <atomic>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "boost/asio/buffer.hpp"
#include "boost/beast/http.hpp"
#include "nlohmann/json.hpp"
#include "router/core/request_validation.h"
#include "router/http/openai_handlers.h"
#include "router/http/openai_http_server.h"
#include "router/inference_service.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/utf8_text.h"
#include "tokenizer/chat_template.h"

namespace {

namespace http = boost::beast::http;
namespace v1 = mobius::v1;
using mobius::router::CallContext;
using mobius::router::InferenceService;
using mobius::router::openai::HttpRequest;
using mobius::router::openai::HttpResponse;
using mobius::router::openai::HttpResponseHeader;
using mobius::router::openai::OpenAiApi;
using mobius::router::openai::ResponseSink;

constexpr char kModel[] = "mobius-fuzz";
constexpr int kVocab = 4096;

// The service as its contract says: validation as the router validates, then the output in
// whole-character chunks (with logprobs and the prompt echo when asked), then `complete`.
class ScriptedService final : public InferenceService {
 public:
  ScriptedService(std::string_view output, uint8_t flags) : output_(output), flags_(flags) {
    info_.set_model_name(kModel);
    info_.set_model_type("interns2_mobius");
    info_.set_vocab_size(kVocab);
    info_.set_max_context_length(8192);
    info_.add_eos_token_ids(2);
  }

  absl::Status Generate(
      const v1::GenerateRequest& request, const CallContext& context,
      const std::function<bool(const v1::GenerateResponse&)>& on_response) override {
    const v1::SamplingParams& sampling = request.sampling_params();
    if (absl::Status s = mobius::router::ValidateSamplingParams(sampling, info_); !s.ok()) {
      return s;
    }
    std::vector<int32_t> prompt;
    if (request.has_input_ids()) {
      prompt.assign(request.input_ids().ids().begin(), request.input_ids().ids().end());
    } else {
      for (const char c : request.text()) prompt.push_back(static_cast<unsigned char>(c) + 3);
    }
    if (absl::Status s = mobius::router::ValidatePrompt(prompt, "prompt", info_); !s.ok()) {
      return s;
    }
    const int top_n = sampling.has_logprobs() ? sampling.logprobs() : -1;
    if (request.echo() || sampling.has_prompt_logprobs()) {
      v1::GenerateResponse head;
      v1::PromptEcho* echo = head.mutable_chunk()->mutable_prompt();
      for (const int32_t id : prompt) {
        echo->add_token_ids(id);
        echo->add_token_bytes(TokenBytes(id));
      }
      echo->set_text(request.text());
      if (sampling.has_prompt_logprobs()) {
        for (size_t i = 1; i < prompt.size(); ++i) {
          AddLogprobs(prompt[i], sampling.prompt_logprobs(), echo->add_logprobs());
        }
      }
      if (!on_response(head)) return absl::CancelledError("client gone");
    }
    // The service only streams whole characters.
    const std::string_view text = output_.substr(0, mobius::fuzz::ValidUtf8Prefix(output_));
    int tokens = 0;
    for (std::string_view piece : mobius::fuzz::CharacterChunks(text, 1 + (flags_ >> 1 & 3))) {
      v1::GenerateResponse chunk;
      const int32_t id = 3 + static_cast<unsigned char>(piece.front());
      chunk.mutable_chunk()->add_token_ids(id);
      chunk.mutable_chunk()->set_text(std::string(piece));
      if (top_n >= 0) AddLogprobs(id, top_n, chunk.mutable_chunk()->add_logprobs());
      if (!on_response(chunk)) return absl::CancelledError("client gone");
      ++tokens;
      if ((flags_ & 32) != 0 && tokens == 2) return absl::UnavailableError("replica went away");
      if (context.cancelled != nullptr && context.cancelled->load()) {
        return absl::CancelledError("client gone");
      }
    }
    v1::GenerateResponse done;
    v1::TextComplete* complete = done.mutable_complete();
    complete->set_finish_reason((flags_ & 16) != 0 ? v1::FINISH_REASON_LENGTH
                                                   : v1::FINISH_REASON_STOP);
    if ((flags_ & 16) == 0) complete->set_matched_token_id(2);
    complete->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(prompt.size()));
    complete->mutable_usage()->set_completion_tokens(tokens);
    if (!on_response(done)) return absl::CancelledError("client gone");
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> RenderChat(
      const std::vector<mobius::tokenizer::ChatMessage>& messages,
      const mobius::tokenizer::ChatTemplateArgs& args) override {
    return mobius::tokenizer::RenderChatMessages(messages, args);
  }
  absl::StatusOr<v1::TokenizeResponse> Tokenize(const v1::TokenizeRequest& request) override {
    v1::TokenizeResponse response;
    for (const char c : request.text()) response.add_ids(static_cast<unsigned char>(c) + 3);
    return response;
  }
  absl::StatusOr<v1::DetokenizeResponse> Detokenize(const v1::DetokenizeRequest& request) override {
    v1::DetokenizeResponse response;
    std::string text;
    for (const int32_t id : request.ids()) {
      if (id < 3 || id >= 3 + 256) return absl::InvalidArgumentError("ids: unknown id");
      text.push_back(static_cast<char>(id - 3));
    }
    response.set_text(text.substr(0, mobius::fuzz::ValidUtf8Prefix(text)));
    return response;
  }
  absl::StatusOr<v1::ModelInfo> GetModelInfo() override { return info_; }
  absl::StatusOr<v1::AbortResponse> Abort(const v1::AbortRequest&) override {
    return v1::AbortResponse();
  }
  bool Ready() override { return (flags_ & 64) == 0; }

 private:
  // Byte-level tokens: a token's bytes may be part of a character (as in the real vocabulary).
  static std::string TokenBytes(int32_t id) {
    return std::string(1, static_cast<char>(id >= 3 ? (id - 3) & 0xFF : 0x80));
  }
  static void AddLogprobs(int32_t id, int top_n, v1::OutputLogprobs* out) {
    out->set_logprob(-0.5F);
    out->set_token_bytes(TokenBytes(id));
    for (int i = 0; i < top_n && i < 20; ++i) {
      v1::TokenLogprob* top = out->add_top();
      top->set_token_id(0x83 + i);  // bytes 0x80..: continuation bytes, never whole characters
      top->set_logprob(-1.0F - static_cast<float>(i));
      top->set_token_bytes(TokenBytes(0x83 + i));
    }
  }

  std::string_view output_;
  uint8_t flags_;
  v1::ModelInfo info_;
};

void CheckJson(std::string_view body, const std::string& what) {
  const nlohmann::json parsed = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  FUZZ_CHECK(!parsed.is_discarded(), what + " is not JSON: " + std::string(body.substr(0, 200)));
}

// Records the answer and checks its form as it is sent.
class CheckingSink final : public ResponseSink {
 public:
  explicit CheckingSink(int writes_before_gone) : writes_left_(writes_before_gone) {}

  void Send(HttpResponse response) override {
    FUZZ_CHECK(answers_ == 0, "a second answer");
    ++answers_;
    const unsigned status = response.result_int();
    FUZZ_CHECK(status >= 200 && status < 600, "status " + std::to_string(status));
    const std::string type(response[http::field::content_type]);
    if (type.starts_with("application/json")) CheckJson(response.body(), "body");
    if (status >= 400 && type.starts_with("application/json")) {
      const auto error = nlohmann::json::parse(response.body());
      FUZZ_CHECK(error.contains("error") || error.contains("detail") || error.contains("message"),
                 "error body without an error: " + response.body());
    }
  }
  bool StartStream(HttpResponseHeader header) override {
    FUZZ_CHECK(answers_ == 0, "a stream after an answer");
    ++answers_;
    streaming_ = true;
    return true;
  }
  bool Write(std::string data) override {
    FUZZ_CHECK(streaming_ && !ended_, "a write outside a stream");
    // Server-sent events: "data: <JSON or [DONE]>\n\n", whole events per write.
    std::string_view rest = data;
    while (!rest.empty()) {
      const size_t end = rest.find("\n\n");
      FUZZ_CHECK(end != std::string_view::npos, "a partial event: " + std::string(rest));
      std::string_view event = rest.substr(0, end);
      rest.remove_prefix(end + 2);
      FUZZ_CHECK(event.starts_with("data: "), "an event without data: " + std::string(event));
      event.remove_prefix(6);
      if (event != "[DONE]") CheckJson(event, "event");
    }
    if (writes_left_ >= 0 && writes_left_-- == 0) {
      gone_ = true;
      return false;
    }
    return true;
  }
  void EndStream(bool close) override {
    FUZZ_CHECK(streaming_ && !ended_, "a stream ended twice or never started");
    ended_ = true;
  }
  [[nodiscard]] const std::atomic<bool>& cancelled() const override { return gone_; }

  void CheckAnswered() const {
    FUZZ_CHECK(answers_ == 1, "answers: " + std::to_string(answers_));
    FUZZ_CHECK(!streaming_ || ended_, "a stream left open");
  }

 private:
  int answers_ = 0;
  bool streaming_ = false;
  bool ended_ = false;
  int writes_left_;
  std::atomic<bool> gone_{false};
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mobius::fuzz::InputCursor input(data, size);
  const uint8_t flags = input.TakeByte();
  const std::string_view output = input.TakeUntilNul();
  const std::string_view raw = input.Rest();

  // Parsed as the server's session parses it (a body limit, then the whole message).
  http::request_parser<http::string_body> parser;
  parser.body_limit(1 << 20);
  boost::beast::error_code ec;
  size_t offset = 0;
  while (!ec && !parser.is_done() && offset < raw.size()) {
    const size_t used =
        parser.put(boost::asio::buffer(raw.data() + offset, raw.size() - offset), ec);
    if (ec == http::error::need_more) ec = {};
    if (used == 0) break;
    offset += used;
  }
  if (!ec && !parser.is_done()) parser.put_eof(ec);
  if (ec || !parser.is_done()) return 0;
  const HttpRequest request = parser.release();

  ScriptedService service(output, flags);
  mobius::router::HttpServerOptions options;
  options.served_model_name = kModel;
  options.parse_reasoning = (flags & 1) != 0;
  OpenAiApi api(service, options);
  CheckingSink sink((flags & 128) != 0 ? 1 : -1);
  api.Handle(request, sink);
  sink.CheckAnswered();
  return 0;
}
