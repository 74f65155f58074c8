// OpenAiHttpServer over real HTTP on 127.0.0.1, against a fake InferenceService that streams
// scripted messages and records what it was asked.
#include "router/http/openai_http_server.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grammar/grammar_matcher.h"
#include "grammar/json_schema_compiler.h"

namespace mobius::router {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Json = nlohmann::json;

// A flag that may be raised many times and waited on. (std::mutex rather than absl::Mutex: the
// system absl is not built for ThreadSanitizer, which then reports its users' accesses.)
class Event {
 public:
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);
    set_ = true;
    cv_.notify_all();
  }
  bool HasBeenNotified() {
    std::lock_guard<std::mutex> lock(mu_);
    return set_;
  }
  bool WaitForNotificationWithTimeout(absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [this] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

v1::GenerateResponse Chunk(const std::string& text, std::vector<int> ids = {7}) {
  v1::GenerateResponse r;
  r.mutable_chunk()->set_text(text);
  for (int id : ids) r.mutable_chunk()->add_token_ids(id);
  return r;
}

v1::GenerateResponse Complete(v1::FinishReason reason, int prompt_tokens, int completion_tokens) {
  v1::GenerateResponse r;
  r.mutable_complete()->set_finish_reason(reason);
  r.mutable_complete()->mutable_usage()->set_prompt_tokens(prompt_tokens);
  r.mutable_complete()->mutable_usage()->set_completion_tokens(completion_tokens);
  return r;
}

class FakeService : public InferenceService {
 public:
  // What the next Generate calls do: stream `responses`, then (if `block`) wait until cancelled
  // or 5 s, then return `status`.
  std::vector<v1::GenerateResponse> responses;
  absl::Status status;
  bool block = false;
  absl::Duration delay = absl::ZeroDuration();  // before each message
  std::string service_request_id = "svc-1";     // stamped on messages when the client gave none
  // When set, answers each call in place of the fields above (after it is recorded).
  std::function<absl::Status(const v1::GenerateRequest&, const CallContext&,
                             const std::function<bool(const v1::GenerateResponse&)>&)>
      script;

  absl::Status Generate(
      const v1::GenerateRequest& request, const CallContext& context,
      const std::function<bool(const v1::GenerateResponse&)>& on_response) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      requests_.push_back(request);
    }
    started_.Notify();
    if (script) return script(request, context, on_response);
    for (v1::GenerateResponse r : responses) {
      absl::SleepFor(delay);
      r.set_request_id(request.request_id().empty() ? service_request_id : request.request_id());
      if (!on_response(r)) {
        saw_cancel_.Notify();
        return absl::CancelledError("client went away");
      }
    }
    if (block) {
      const absl::Time until = absl::Now() + absl::Seconds(5);
      while (absl::Now() < until) {
        if (context.cancelled != nullptr && context.cancelled->load()) {
          saw_cancel_.Notify();
          return absl::CancelledError("cancelled");
        }
        absl::SleepFor(absl::Milliseconds(2));
      }
      return absl::DeadlineExceededError("the test never cancelled");
    }
    return status;
  }

  absl::StatusOr<std::string> RenderChat(const std::vector<tokenizer::ChatMessage>& messages,
                                         const tokenizer::ChatTemplateArgs& args) override {
    const bool add_generation_prompt = args.add_generation_prompt;
    std::lock_guard<std::mutex> lock(mu_);
    chat_messages_ = messages;
    chat_tools_ = args.tools;
    chat_enable_thinking_ = args.enable_thinking;
    std::string out;
    for (const auto& m : messages) out += "<" + m.role + ">" + m.content;
    return out + (add_generation_prompt ? "<assistant>" : "");
  }

  absl::StatusOr<v1::TokenizeResponse> Tokenize(const v1::TokenizeRequest& request) override {
    v1::TokenizeResponse out;
    for (size_t i = 0; i < request.text().size(); ++i) out.add_ids(1);  // one id per byte
    return out;
  }

  // "<id>,<id>,..."; ids from 1000 are refused as the router refuses unknown ids.
  absl::StatusOr<v1::DetokenizeResponse> Detokenize(const v1::DetokenizeRequest& request) override {
    v1::DetokenizeResponse out;
    for (int k = 0; k < request.ids_size(); ++k) {
      if (request.ids(k) >= 1000) {
        absl::Status status = absl::InvalidArgumentError(
            absl::StrCat("ids[", k, "] = ", request.ids(k), " is not a token id"));
        status.SetPayload(kRequestFieldPayload, absl::Cord("ids"));
        return status;
      }
      out.mutable_text()->append(absl::StrCat(k > 0 ? "," : "", request.ids(k)));
    }
    return out;
  }

  absl::StatusOr<v1::ModelInfo> GetModelInfo() override {
    if (!model_info_ok) return absl::UnavailableError("no replica");
    v1::ModelInfo info;
    info.set_model_name("qwen-tiny");
    info.set_max_context_length(context_length.load());
    return info;
  }

  absl::StatusOr<v1::AbortResponse> Abort(const v1::AbortRequest&) override {
    return v1::AbortResponse();
  }
  bool Ready() override { return ready.load(); }

  std::vector<v1::GenerateRequest> requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }
  std::vector<tokenizer::ChatMessage> chat_messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return chat_messages_;
  }
  std::vector<std::string> chat_tools() {
    std::lock_guard<std::mutex> lock(mu_);
    return chat_tools_;
  }
  bool chat_enable_thinking() {
    std::lock_guard<std::mutex> lock(mu_);
    return chat_enable_thinking_;
  }
  Event& started() { return started_; }
  Event& saw_cancel() { return saw_cancel_; }

  std::atomic<bool> ready{true};
  std::atomic<bool> model_info_ok{true};
  std::atomic<int32_t> context_length{100};

 private:
  std::mutex mu_;
  std::vector<v1::GenerateRequest> requests_;
  std::vector<tokenizer::ChatMessage> chat_messages_;
  std::vector<std::string> chat_tools_;
  bool chat_enable_thinking_ = true;
  Event started_;
  Event saw_cancel_;
};

struct Reply {
  unsigned status = 0;
  http::fields headers;
  std::string body;
  std::string header(http::field name) const { return std::string(headers[name]); }
  std::string header(const char* name) const { return std::string(headers[name]); }
  Json json() const { return Json::parse(body, nullptr, /*allow_exceptions=*/false); }
};

// Reads from `socket` until `marker` has arrived; false (a failure recorded) if a read fails.
bool ReadUntil(tcp::socket& socket, const std::string& marker) {
  std::string seen;
  char buffer[1024];
  while (!absl::StrContains(seen, marker)) {
    beast::error_code ec;
    const size_t n = socket.read_some(net::buffer(buffer), ec);
    if (ec) {
      ADD_FAILURE() << "reading until \"" << marker << "\": " << ec.message();
      return false;
    }
    seen.append(buffer, n);
  }
  return true;
}

// The `data:` payloads of a server-sent event stream, in order.
std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  for (absl::string_view event : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    EXPECT_TRUE(absl::StartsWith(event, "data: ")) << event;
    out.emplace_back(event.substr(6));
  }
  return out;
}

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpServerOptions options = {}) {
    options.host = "127.0.0.1";
    options.port = 0;
    if (options.served_model_name.empty()) options.served_model_name = "mobius-test";
    options.num_threads = 2;
    absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> server =
        OpenAiHttpServer::Start(service_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void SetUp() override { StartServer(); }

  tcp::socket Connect() {
    tcp::socket socket(ioc_);
    beast::error_code ec;
    socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), server_->port()), ec);
    EXPECT_FALSE(ec) << ec.message();
    return socket;
  }

  static http::request<http::string_body> MakeRequest(
      http::verb method, const std::string& target, const std::string& body,
      const std::vector<std::pair<std::string, std::string>>& headers) {
    http::request<http::string_body> request(method, target, 11);
    request.set(http::field::host, "127.0.0.1");
    if (!body.empty()) request.set(http::field::content_type, "application/json");
    for (const auto& [name, value] : headers) request.set(name, value);
    request.body() = body;
    request.prepare_payload();
    return request;
  }

  Reply Send(tcp::socket& socket, http::verb method, const std::string& target,
             const std::string& body = "",
             const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    beast::error_code ec;
    http::write(socket, MakeRequest(method, target, body, headers), ec);
    EXPECT_FALSE(ec) << ec.message();
    beast::flat_buffer buffer;
    http::response<http::string_body> response;
    http::read(socket, buffer, response, ec);
    EXPECT_FALSE(ec) << ec.message();
    Reply reply;
    reply.status = response.result_int();
    reply.headers = response.base();
    reply.body = response.body();
    return reply;
  }

  Reply Send(http::verb method, const std::string& target, const std::string& body = "",
             const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    tcp::socket socket = Connect();
    return Send(socket, method, target, body, headers);
  }

  Reply Post(const std::string& target, const Json& body,
             const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    return Send(http::verb::post, target, body.dump(), headers);
  }

  void ExpectError(const Reply& reply, unsigned status, const std::string& param,
                   const std::string& message_part) {
    EXPECT_EQ(reply.status, status) << reply.body;
    Json body = reply.json();
    ASSERT_TRUE(body.contains("error")) << reply.body;
    const Json& error = body["error"];
    EXPECT_TRUE(error["type"].is_string()) << reply.body;
    if (param.empty()) {
      EXPECT_TRUE(error["param"].is_null()) << reply.body;
    } else {
      EXPECT_EQ(error["param"], param) << reply.body;
    }
    EXPECT_TRUE(absl::StrContains(error["message"].get<std::string>(), message_part)) << reply.body;
  }

  FakeService service_;
  net::io_context ioc_;
  std::unique_ptr<OpenAiHttpServer> server_;
};

TEST_F(HttpServerTest, CompletionWholeResponse) {
  service_.responses = {Chunk("Hello"), Chunk(" world"), Complete(v1::FINISH_REASON_LENGTH, 3, 2)};
  Reply reply = Post("/v1/completions",
                     {{"model", "mobius-test"},
                      {"prompt", "hi"},
                      {"temperature", 0.5},
                      {"top_k", 40},
                      {"seed", 7},
                      {"stop", "\n"},
                      {"include_stop_str_in_output", true},
                      {"logit_bias", {{"57025", -100}, {"3", 2.5}}},
                      {"min_tokens", 2},
                      {"truncate_prompt_tokens", 100},
                      {"allowed_token_ids", {4, 9}},
                      {"bad_words", {"no", " way"}},
                      {"return_token_ids", true},
                      {"user", "ignored"}},
                     {{"X-Request-Id", "abc"}});
  ASSERT_EQ(reply.status, 200u) << reply.body;
  EXPECT_EQ(reply.header("X-Request-Id"), "abc");
  EXPECT_TRUE(absl::StartsWith(reply.header(http::field::content_type), "application/json"));
  Json body = reply.json();
  EXPECT_EQ(body["id"], "cmpl-abc");
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["model"], "mobius-test");
  EXPECT_TRUE(body["created"].is_number_integer());
  EXPECT_EQ(body["choices"][0]["index"], 0);
  EXPECT_EQ(body["choices"][0]["text"], "Hello world");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(body["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(body["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(body["usage"]["completion_tokens"], 2);
  EXPECT_EQ(body["usage"]["total_tokens"], 5);

  std::vector<v1::GenerateRequest> requests = service_.requests();
  ASSERT_EQ(requests.size(), 1u);
  const v1::GenerateRequest& request = requests[0];
  EXPECT_EQ(request.request_id(), "abc");
  EXPECT_EQ(request.text(), "hi");
  EXPECT_EQ(request.sampling_params().max_tokens(), 16);  // OpenAI's default
  EXPECT_FLOAT_EQ(request.sampling_params().temperature(), 0.5f);
  EXPECT_EQ(request.sampling_params().top_k(), 40);
  EXPECT_EQ(request.sampling_params().seed(), 7u);
  ASSERT_EQ(request.sampling_params().stop_size(), 1);
  EXPECT_EQ(request.sampling_params().stop(0), "\n");
  EXPECT_TRUE(request.sampling_params().include_stop_str_in_output());
  EXPECT_EQ(request.sampling_params().min_tokens(), 2);
  EXPECT_EQ(request.truncate_prompt_tokens(), 100);
  ASSERT_EQ(request.sampling_params().logit_bias_size(), 2);
  EXPECT_FLOAT_EQ(request.sampling_params().logit_bias().at(57025), -100.0f);
  EXPECT_FLOAT_EQ(request.sampling_params().logit_bias().at(3), 2.5f);
  EXPECT_FALSE(request.sampling_params().has_top_p());
  EXPECT_EQ(std::vector<int32_t>(request.sampling_params().allowed_token_ids().begin(),
                                 request.sampling_params().allowed_token_ids().end()),
            std::vector<int32_t>({4, 9}));
  ASSERT_EQ(request.sampling_params().bad_words_size(), 2);
  EXPECT_EQ(request.sampling_params().bad_words(1), " way");
  EXPECT_TRUE(request.echo());  // return_token_ids needs the prompt's ids
  EXPECT_EQ(body["choices"][0]["token_ids"], Json({7, 7}));  // Chunk's default ids
}

TEST_F(HttpServerTest, NeutralValuesOfUnimplementedFieldsPass) {
  service_.responses = {Chunk("x"), Complete(v1::FINISH_REASON_STOP, 1, 1)};
  Reply reply = Post("/v1/completions", {{"prompt", "x"},
                                         {"logit_bias", Json::object()},
                                         {"min_tokens", 0},
                                         {"include_stop_str_in_output", false},
                                         {"prompt_logprobs", nullptr},
                                         {"use_beam_search", false}});
  EXPECT_EQ(reply.status, 200u) << reply.body;
}

TEST_F(HttpServerTest, ServiceAssignedIdIsReturned) {
  service_.responses = {Chunk("x"), Complete(v1::FINISH_REASON_STOP, 1, 1)};
  Reply reply = Post("/v1/completions", {{"prompt", "hi"}});
  ASSERT_EQ(reply.status, 200u) << reply.body;
  EXPECT_EQ(reply.header("X-Request-Id"), "svc-1");
  EXPECT_EQ(reply.json()["id"], "cmpl-svc-1");
  EXPECT_EQ(reply.json()["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(service_.requests()[0].request_id(), "");
}

TEST_F(HttpServerTest, CompletionStreamWithUsage) {
  service_.responses = {Chunk("He"), Chunk("llo"), Complete(v1::FINISH_REASON_STOP, 4, 2)};
  Reply reply = Post("/v1/completions", {{"prompt", "hi"},
                                         {"max_tokens", 5},
                                         {"stream", true},
                                         {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(reply.status, 200u) << reply.body;
  EXPECT_EQ(reply.header(http::field::content_type), "text/event-stream");
  std::vector<std::string> data = SseData(reply.body);
  ASSERT_EQ(data.size(), 5u) << reply.body;
  EXPECT_EQ(data.back(), "[DONE]");
  std::string text;
  for (int i = 0; i < 2; ++i) {
    Json chunk = Json::parse(data[i]);
    EXPECT_EQ(chunk["object"], "text_completion");
    EXPECT_EQ(chunk["id"], "cmpl-svc-1");
    EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
    EXPECT_TRUE(chunk["usage"].is_null());
    text += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, "Hello");
  Json last = Json::parse(data[2]);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  Json usage = Json::parse(data[3]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2);
  EXPECT_EQ(usage["usage"]["total_tokens"], 6);
  EXPECT_EQ(service_.requests()[0].sampling_params().max_tokens(), 5);
}

TEST_F(HttpServerTest, StreamWithoutUsageHasNoUsageField) {
  service_.responses = {Chunk("a"), Complete(v1::FINISH_REASON_LENGTH, 1, 1)};
  Reply reply = Post("/v1/completions", {{"prompt", "hi"}, {"stream", true}});
  std::vector<std::string> data = SseData(reply.body);
  ASSERT_EQ(data.size(), 3u) << reply.body;
  EXPECT_EQ(data.back(), "[DONE]");
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(Json::parse(data[i]).contains("usage")) << data[i];
  EXPECT_EQ(Json::parse(data[1])["choices"][0]["finish_reason"], "length");
}

TEST_F(HttpServerTest, ChatStreamSendsRoleFirst) {
  service_.responses = {Chunk("Hi"), Chunk("!"), Complete(v1::FINISH_REASON_STOP, 9, 2)};
  Json messages = Json::array({{{"role", "system"}, {"content", "be brief"}},
                               {{"role", "user"},
                                {"content", Json::array({{{"type", "text"}, {"text", "a"}},
                                                         {{"type", "text"}, {"text", "b"}}})}}});
  Reply reply = Post("/v1/chat/completions",
                     {{"messages", messages}, {"stream", true}, {"max_completion_tokens", 8}});
  ASSERT_EQ(reply.status, 200u) << reply.body;
  std::vector<std::string> data = SseData(reply.body);
  ASSERT_EQ(data.size(), 5u) << reply.body;
  Json first = Json::parse(data[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["id"], "chatcmpl-svc-1");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(Json::parse(data[1])["choices"][0]["delta"]["content"], "Hi");
  EXPECT_EQ(Json::parse(data[2])["choices"][0]["delta"]["content"], "!");
  EXPECT_EQ(Json::parse(data[3])["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(data[4], "[DONE]");

  std::vector<tokenizer::ChatMessage> got = service_.chat_messages();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].role, "user");
  EXPECT_EQ(got[1].content, "a\nb");
  const v1::GenerateRequest request = service_.requests()[0];
  EXPECT_EQ(request.text(), "<system>be brief<user>a\nb<assistant>");
  EXPECT_EQ(request.sampling_params().max_tokens(), 8);
}

TEST_F(HttpServerTest, ChatWholeResponseDefaultsMaxTokensToTheContext) {
  service_.responses = {Chunk("Hi"), Complete(v1::FINISH_REASON_STOP, 5, 1)};
  Reply reply =
      Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "yo"}}}}});
  ASSERT_EQ(reply.status, 200u) << reply.body;
  Json body = reply.json();
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(body["choices"][0]["message"]["content"], "Hi");
  EXPECT_EQ(body["usage"]["total_tokens"], 6);
  // The whole context; the service clamps it to what the prompt leaves.
  EXPECT_EQ(service_.requests()[0].sampling_params().max_tokens(), 100);
}

// The default follows the service's context length as it is now: a replica with a shorter
// context joining lowers it, and a default cached from before would exceed it (every chat
// request without max_tokens was refused then).
TEST_F(HttpServerTest, ChatDefaultMaxTokensFollowsTheContextLength) {
  const Json chat = {{"messages", {{{"role", "user"}, {"content", "yo"}}}}};
  service_.responses = {Chunk("Hi"), Complete(v1::FINISH_REASON_STOP, 5, 1)};
  ASSERT_EQ(Post("/v1/chat/completions", chat).status, 200u);
  service_.context_length = 60;
  service_.responses = {Chunk("Hi"), Complete(v1::FINISH_REASON_STOP, 5, 1)};
  ASSERT_EQ(Post("/v1/chat/completions", chat).status, 200u);
  ASSERT_EQ(service_.requests().size(), 2u);
  EXPECT_EQ(service_.requests()[0].sampling_params().max_tokens(), 100);
  EXPECT_EQ(service_.requests()[1].sampling_params().max_tokens(), 60);
  const Reply models = Send(http::verb::get, "/v1/models");
  ASSERT_EQ(models.status, 200u);
  EXPECT_EQ(models.json()["data"][0]["max_model_len"], 60);
}

TEST_F(HttpServerTest, TokenIdPromptsReachTheServiceAsIds) {
  service_.responses = {Complete(v1::FINISH_REASON_STOP, 3, 0)};
  ASSERT_EQ(Post("/v1/completions", {{"prompt", {1, 2, 3}}}).status, 200u);
  ASSERT_EQ(Post("/v1/completions", {{"prompt", {{4, 5}}}}).status, 200u);
  ASSERT_EQ(Post("/v1/completions", {{"prompt", {"one"}}}).status, 200u);
  std::vector<v1::GenerateRequest> requests = service_.requests();
  ASSERT_EQ(requests.size(), 3u);
  ASSERT_TRUE(requests[0].has_input_ids());
  EXPECT_EQ(
      std::vector<int>(requests[0].input_ids().ids().begin(), requests[0].input_ids().ids().end()),
      (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(requests[1].input_ids().ids_size(), 2);
  EXPECT_EQ(requests[2].text(), "one");
}

TEST_F(HttpServerTest, RequestErrorsNameTheField) {
  ExpectError(Post("/v1/completions", {{"prompt", {"a", 5}}}), 400, "prompt[1]",
              "prompt[1] must be a string, as prompt[0] is");
  ExpectError(Post("/v1/completions", {{"prompt", Json::array({Json::array({1}), Json::array()})}}),
              400, "prompt[1]", "prompt[1] must not be empty");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"temperature", "hot"}}), 400,
              "temperature", "temperature must be a number, got \"hot\"");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 1.5}}), 400, "max_tokens",
              "max_tokens must be an integer");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 0}}), 400, "max_tokens",
              "max_tokens must be at least 1 (0 only with echo or prompt_logprobs");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"max_tokens", -1}, {"echo", true}}), 400,
              "max_tokens", "max_tokens must be an integer in [0, ");
  ExpectError(Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "yo"}}}},
                                            {"max_completion_tokens", 0}}),
              400, "max_completion_tokens", "max_completion_tokens must be an integer in [1, ");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"n", 0}}), 400, "n",
              "n must be an integer in [1, 128]");
  ExpectError(Post("/v1/completions", {{"prompt", {"a", "b", "c"}}, {"n", 50}}), 400, "n",
              "n = 50 choices for each of 3 prompts is 150; a request takes at most 128");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"n", 2}, {"best_of", 3}}), 400, "best_of",
              "best_of must equal n (2), got 3");
  // Fields that would change the output and that we do not implement are refused by name, for
  // both endpoints; their neutral values pass.
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"logit_bias", {{"tok", -100}}}}), 400,
              "logit_bias", "logit_bias keys must be token ids, got \"tok\"");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"logit_bias", {{"05", 1}}}}), 400,
              "logit_bias", "logit_bias keys must be token ids, got \"05\"");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"logit_bias", {{"5", 1e39}}}}), 400,
              "logit_bias[\"5\"]", "logit_bias[\"5\"] = 1e+39 is invalid: must be in [-100, 100]");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"logit_bias", {{"5", "big"}}}}), 400,
              "logit_bias[\"5\"]", "logit_bias[\"5\"] must be a number, got \"big\"");
  ExpectError(Post("/v1/chat/completions",
                   {{"messages", {{{"role", "user"}, {"content", "yo"}}}}, {"min_tokens", -1}}),
              400, "min_tokens", "min_tokens must be an integer in [0, ");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"truncate_prompt_tokens", -2}}), 400,
              "truncate_prompt_tokens", "truncate_prompt_tokens must be an integer in [-1, ");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"guided_regex", "[a-z]+\\1"}}), 400,
              "guided_regex", "guided_regex: backreferences are not supported (at offset 6)");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"guided_grammar", "root ::= x"}}), 400,
              "guided_grammar", "guided_grammar is not supported");
  ExpectError(Post("/v1/completions",
                   {{"prompt", "x"}, {"guided_json", {{"type", "object"}, {"minProperties", 1}}}}),
              400, "guided_json",
              "guided_json: schema.minProperties: this keyword is not supported");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"echo", "yes"}}), 400, "echo",
              "echo must be a boolean");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"bad_words", "no"}}), 400, "bad_words",
              "bad_words must be an array of strings");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"bad_words", {"a", 3}}}), 400,
              "bad_words[1]", "bad_words[1] must be a string");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"allowed_token_ids", {1, -1}}}), 400,
              "allowed_token_ids[1]", "allowed_token_ids[1] must be an integer in [0, ");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"allowed_token_ids", Json::array()}}), 400,
              "allowed_token_ids", "allowed_token_ids is empty");
  ExpectError(Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "yo"}}}},
                                            {"prompt_logprobs", -1}}),
              400, "prompt_logprobs", "prompt_logprobs must be an integer in [0, ");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"stop", {"a", "b", "c", "d", "e"}}}), 400,
              "stop", "at most 4");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"stream", "yes"}}), 400, "stream",
              "stream must be a boolean");
  ExpectError(Post("/v1/completions", {{"temperature", 1}}), 400, "prompt", "prompt is required");
  ExpectError(Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", 5}}}}}),
              400, "messages[0].content", "messages[0].content must be");
  ExpectError(Send(http::verb::post, "/v1/completions", "{\"prompt\": "), 400, "",
              "invalid JSON at byte");
  ExpectError(Send(http::verb::post, "/v1/completions", "[1]"), 400, "", "must be a JSON object");

  Reply model = Post("/v1/completions", {{"model", "gpt-4"}, {"prompt", "x"}});
  ExpectError(model, 400, "model", "gpt-4");
  EXPECT_EQ(model.json()["error"]["code"], "model_not_found");

  Reply media = Send(http::verb::post, "/v1/completions", "{}", {{"Content-Type", "text/plain"}});
  ExpectError(media, 400, "", "application/json");
  EXPECT_TRUE(service_.requests().empty());
}

// The service's validation names the GenerateRequest field it refused (a RequestFieldOf
// payload); the HTTP error names it as the OpenAI `param`, in the endpoint's spelling, and its
// message drops the gRPC "sampling_params." prefix.
TEST_F(HttpServerTest, ServiceFieldErrorsNameTheOpenAiParam) {
  auto field_error = [](const std::string& message, const std::string& field) {
    absl::Status status = absl::InvalidArgumentError(message);
    status.SetPayload(kRequestFieldPayload, absl::Cord(field));
    return status;
  };
  const Json chat = {{"messages", {{{"role", "user"}, {"content", "yo"}}}}};
  service_.responses = {};
  service_.status =
      field_error("sampling_params.temperature = -1 is invalid: must be >= 0", "temperature");
  for (bool stream : {false, true}) {
    ExpectError(Post("/v1/completions", {{"prompt", "x"}, {"stream", stream}}), 400, "temperature",
                "temperature = -1 is invalid");
    EXPECT_FALSE(absl::StrContains(
        Post("/v1/completions", {{"prompt", "x"}, {"stream", stream}}).body, "sampling_params"));
  }
  service_.status = field_error("text has 600 tokens; the model's context length is 100", "text");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}}), 400, "prompt", "prompt has 600 tokens");
  ExpectError(Post("/v1/chat/completions", chat), 400, "messages", "messages has 600 tokens");
  service_.status =
      field_error("sampling_params.logprobs = 30 is invalid: must be in [0, 20]", "logprobs");
  ExpectError(Post("/v1/completions", {{"prompt", "x"}}), 400, "logprobs", "logprobs = 30");
  ExpectError(Post("/v1/chat/completions", chat), 400, "top_logprobs", "top_logprobs = 30");
}

struct ServiceErrorCase {
  absl::Status status;
  unsigned http_status;
};

class ServiceErrorTest : public HttpServerTest,
                         public ::testing::WithParamInterface<ServiceErrorCase> {};

TEST_P(ServiceErrorTest, MapsToHttpStatus) {
  service_.responses = {};
  service_.status = GetParam().status;
  for (bool stream : {false, true}) {
    Reply reply = Post("/v1/completions", {{"prompt", "x"}, {"stream", stream}});
    ExpectError(reply, GetParam().http_status, "", std::string(GetParam().status.message()));
    EXPECT_EQ(reply.header(http::field::retry_after).empty(), GetParam().http_status != 429u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Codes, ServiceErrorTest,
    ::testing::Values(ServiceErrorCase{absl::InvalidArgumentError("top_p must be in (0, 1]"), 400},
                      ServiceErrorCase{absl::ResourceExhaustedError("queue full"), 429},
                      ServiceErrorCase{absl::UnavailableError("no healthy replica"), 503},
                      ServiceErrorCase{absl::DeadlineExceededError("too slow"), 504},
                      ServiceErrorCase{absl::CancelledError("aborted"), 499},
                      ServiceErrorCase{absl::InternalError("worker crashed"), 500}));

TEST_F(HttpServerTest, RetryAfterComesFromTheHint) {
  service_.status = absl::ResourceExhaustedError("128 requests queued; retry after 3s");
  Reply reply = Post("/v1/completions", {{"prompt", "x"}});
  EXPECT_EQ(reply.status, 429u);
  EXPECT_EQ(reply.header(http::field::retry_after), "3");
  EXPECT_EQ(reply.json()["error"]["code"], "rate_limit_exceeded");
}

TEST_F(HttpServerTest, ErrorAfterTheStreamStartedIsAnEvent) {
  service_.responses = {Chunk("partial")};
  service_.status = absl::UnavailableError("replica lost");
  Reply reply = Post("/v1/completions", {{"prompt", "x"}, {"stream", true}});
  ASSERT_EQ(reply.status, 200u);
  std::vector<std::string> data = SseData(reply.body);
  ASSERT_EQ(data.size(), 3u) << reply.body;
  EXPECT_EQ(Json::parse(data[0])["choices"][0]["text"], "partial");
  EXPECT_EQ(Json::parse(data[1])["error"]["message"], "replica lost");
  EXPECT_EQ(data[2], "[DONE]");
}

TEST_F(HttpServerTest, ClientDisconnectMidStreamCancels) {
  service_.responses = {Chunk("first")};
  service_.block = true;
  {
    tcp::socket socket = Connect();
    http::write(socket, MakeRequest(http::verb::post, "/v1/completions",
                                    Json{{"prompt", "x"}, {"stream", true}}.dump(), {}));
    // Wait for the first event, then go away.
    ASSERT_TRUE(ReadUntil(socket, "first"));
  }
  EXPECT_TRUE(service_.saw_cancel().WaitForNotificationWithTimeout(absl::Seconds(3)));
}

TEST_F(HttpServerTest, ClientDisconnectBeforeAnyOutputCancels) {
  service_.block = true;
  {
    tcp::socket socket = Connect();
    http::write(socket,
                MakeRequest(http::verb::post, "/v1/completions", Json{{"prompt", "x"}}.dump(), {}));
    ASSERT_TRUE(service_.started().WaitForNotificationWithTimeout(absl::Seconds(3)));
  }
  EXPECT_TRUE(service_.saw_cancel().WaitForNotificationWithTimeout(absl::Seconds(3)));
}

// Answers a call with "<prompt>/<seed>" (the prompt's text, or its first token id) as two chunks,
// then a finish whose usage counts the prompt's bytes (or ids) and one output token per chunk.
absl::Status EchoPromptAndSeed(const v1::GenerateRequest& request,
                               const std::function<bool(const v1::GenerateResponse&)>& send) {
  const std::string prompt =
      request.has_input_ids() ? std::to_string(request.input_ids().ids(0)) : request.text();
  const int prompt_tokens =
      request.has_input_ids() ? request.input_ids().ids_size() : static_cast<int>(prompt.size());
  std::vector<v1::GenerateResponse> messages = {
      Chunk(prompt + "/"), Chunk(std::to_string(request.sampling_params().seed())),
      Complete(v1::FINISH_REASON_LENGTH, prompt_tokens, 2)};
  messages.back().mutable_complete()->mutable_usage()->set_cached_tokens(1);
  for (v1::GenerateResponse& m : messages) {
    m.set_request_id(request.request_id());
    if (!send(m)) return absl::CancelledError("client went away");
  }
  return absl::OkStatus();
}

// n choices of a batch of prompts: one service call each, prompt by prompt, choice k of a
// prompt drawing with seed + k; the choices in OpenAI's order; each prompt's tokens counted once.
TEST_F(HttpServerTest, ChoicesOfABatchOfPromptsAreCallsOfTheirOwn) {
  service_.script = [](const v1::GenerateRequest& request, const CallContext&,
                       const std::function<bool(const v1::GenerateResponse&)>& send) {
    return EchoPromptAndSeed(request, send);
  };
  Reply reply =
      Post("/v1/completions", {{"prompt", {"ab", "cde"}}, {"n", 3}, {"best_of", 3}, {"seed", 40}},
           {{"X-Request-Id", "batch"}});
  ASSERT_EQ(reply.status, 200u) << reply.body;
  EXPECT_EQ(reply.header("X-Request-Id"), "batch");
  Json body = reply.json();
  EXPECT_EQ(body["id"], "cmpl-batch");
  ASSERT_EQ(body["choices"].size(), 6u) << reply.body;
  const std::vector<std::string> texts = {"ab/40", "ab/41", "ab/42", "cde/40", "cde/41", "cde/42"};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(body["choices"][i]["index"], i);
    EXPECT_EQ(body["choices"][i]["text"], texts[i]);
    EXPECT_EQ(body["choices"][i]["finish_reason"], "length");
  }
  EXPECT_EQ(body["usage"]["prompt_tokens"], 2 + 3);
  EXPECT_EQ(body["usage"]["completion_tokens"], 6 * 2);
  EXPECT_EQ(body["usage"]["total_tokens"], 5 + 12);
  EXPECT_EQ(body["usage"]["prompt_tokens_details"]["cached_tokens"], 2);

  std::vector<v1::GenerateRequest> requests = service_.requests();
  ASSERT_EQ(requests.size(), 6u);
  std::set<std::string> ids;
  for (const v1::GenerateRequest& r : requests) ids.insert(r.request_id());
  EXPECT_EQ(ids, (std::set<std::string>{"batch-0", "batch-1", "batch-2", "batch-3", "batch-4",
                                        "batch-5"}));
}

// Without a seed no choice gets one (each draws its own); without a client id the choices are
// named after one the server makes, which the response carries.
TEST_F(HttpServerTest, ChoicesWithoutSeedOrIdGetNoSeedAndOneId) {
  service_.script = [](const v1::GenerateRequest& request, const CallContext&,
                       const std::function<bool(const v1::GenerateResponse&)>& send) {
    return EchoPromptAndSeed(request, send);
  };
  Reply reply = Post("/v1/completions", {{"prompt", {7, 8}}, {"n", 2}});
  ASSERT_EQ(reply.status, 200u) << reply.body;
  const std::string id = reply.header("X-Request-Id");
  EXPECT_TRUE(absl::StartsWith(id, "http-")) << id;
  EXPECT_EQ(reply.json()["id"], "cmpl-" + id);
  EXPECT_EQ(reply.json()["usage"]["prompt_tokens"], 2);
  std::vector<v1::GenerateRequest> requests = service_.requests();
  ASSERT_EQ(requests.size(), 2u);
  std::set<std::string> ids;
  for (const v1::GenerateRequest& r : requests) {
    EXPECT_FALSE(r.sampling_params().has_seed());
    ids.insert(r.request_id());
  }
  EXPECT_EQ(ids, (std::set<std::string>{id + "-0", id + "-1"}));
}

// A service error about one prompt of a batch names that prompt.
TEST_F(HttpServerTest, BatchPromptErrorsNameThePrompt) {
  service_.script = [](const v1::GenerateRequest& request, const CallContext&,
                       const std::function<bool(const v1::GenerateResponse&)>& send) {
    if (request.text() == "long") {
      absl::Status status =
          absl::InvalidArgumentError("text has 600 tokens; the model's context length is 100");
      status.SetPayload(kRequestFieldPayload, absl::Cord("text"));
      return status;
    }
    return EchoPromptAndSeed(request, send);
  };
  for (bool stream : {false, true}) {
    ExpectError(Post("/v1/completions", {{"prompt", {"a", "b", "long"}}, {"stream", stream}}), 400,
                "prompt[2]", "prompt[2] has 600 tokens");
  }
  // One prompt keeps the plain name.
  ExpectError(Post("/v1/completions", {{"prompt", "long"}, {"n", 2}}), 400, "prompt",
              "prompt has 600 tokens");
}

// A streamed chat with two choices: both roles first, each chunk tagged with its choice, a finish
// chunk per choice, then one usage chunk for both and one [DONE].
TEST_F(HttpServerTest, ChatStreamOfTwoChoices) {
  service_.script = [](const v1::GenerateRequest& request, const CallContext&,
                       const std::function<bool(const v1::GenerateResponse&)>& send) {
    return EchoPromptAndSeed(request, send);
  };
  Reply reply = Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "yo"}}}},
                                              {"n", 2},
                                              {"seed", 5},
                                              {"stream", true},
                                              {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(reply.status, 200u) << reply.body;
  std::vector<std::string> data = SseData(reply.body);
  // 2 roles, 2 x (2 chunks + finish), usage, [DONE].
  ASSERT_EQ(data.size(), 10u) << reply.body;
  std::string text[2];
  int finishes[2] = {0, 0};
  for (size_t e = 0; e + 2 < data.size(); ++e) {
    Json chunk = Json::parse(data[e]);
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    EXPECT_TRUE(chunk["usage"].is_null());
    ASSERT_EQ(chunk["choices"].size(), 1u);
    const Json& choice = chunk["choices"][0];
    const int index = choice["index"].get<int>();
    ASSERT_TRUE(index == 0 || index == 1) << data[e];
    if (e < 2) {
      EXPECT_EQ(index, static_cast<int>(e));
      EXPECT_EQ(choice["delta"]["role"], "assistant");
      continue;
    }
    EXPECT_EQ(finishes[index], 0) << "a chunk after choice " << index << " finished";
    if (!choice["finish_reason"].is_null()) {
      ++finishes[index];
    } else {
      text[index] += choice["delta"]["content"].get<std::string>();
    }
  }
  const std::string prompt = "<user>yo<assistant>";
  EXPECT_EQ(text[0], prompt + "/5");
  EXPECT_EQ(text[1], prompt + "/6");
  EXPECT_EQ(finishes[0], 1);
  EXPECT_EQ(finishes[1], 1);
  Json usage = Json::parse(data[8]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], static_cast<int>(prompt.size()));
  EXPECT_EQ(usage["usage"]["completion_tokens"], 4);
  EXPECT_EQ(data[9], "[DONE]");
}

// A scripted call that has sent what it had: returns CANCELLED (counting it) once the call is
// cancelled, or DEADLINE_EXCEEDED after 5 s.
absl::Status WaitForCancel(const CallContext& context, std::atomic<int>& cancelled) {
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (absl::Now() < until) {
    if (context.cancelled != nullptr && context.cancelled->load()) {
      ++cancelled;
      return absl::CancelledError("cancelled");
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  return absl::DeadlineExceededError("never cancelled");
}

// One choice failing fails the response with its status, and the other calls are cancelled
// rather than left to run. Here every choice has sent a chunk before the failure, so a stream has
// started and shows them before the error.
TEST_F(HttpServerTest, OneFailingChoiceFailsTheResponseAndCancelsTheOthers) {
  std::atomic<int> cancelled{0};
  std::atomic<int> sent{0};
  service_.script = [&](const v1::GenerateRequest& request, const CallContext& context,
                        const std::function<bool(const v1::GenerateResponse&)>& send) {
    if (absl::EndsWith(request.request_id(), "-2")) {
      if (!send(Chunk("y"))) return absl::CancelledError("client went away");
      const absl::Time until = absl::Now() + absl::Seconds(5);
      while (sent.load() < 3 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
      return absl::ResourceExhaustedError("queue full; retry after 2s");
    }
    const bool delivered = send(Chunk("x"));
    ++sent;
    if (!delivered) {
      ++cancelled;
      return absl::CancelledError("client went away");
    }
    return WaitForCancel(context, cancelled);
  };
  for (bool stream : {false, true}) {
    cancelled = 0;
    sent = 0;
    Reply reply = Post("/v1/completions", {{"prompt", "x"}, {"n", 4}, {"stream", stream}},
                       {{"X-Request-Id", stream ? "s" : "w"}});
    if (stream) {
      ASSERT_EQ(reply.status, 200u) << reply.body;  // the others' chunks started the stream
      std::vector<std::string> data = SseData(reply.body);
      ASSERT_EQ(data.size(), 6u) << reply.body;  // four chunks, the error, [DONE]
      std::multiset<std::string> texts;
      for (int e = 0; e < 4; ++e) texts.insert(Json::parse(data[e])["choices"][0]["text"]);
      EXPECT_EQ(texts, (std::multiset<std::string>{"x", "x", "x", "y"}));
      EXPECT_EQ(Json::parse(data[data.size() - 2])["error"]["message"],
                "queue full; retry after 2s");
      EXPECT_EQ(data.back(), "[DONE]");
    } else {
      ExpectError(reply, 429, "", "queue full");
      EXPECT_EQ(reply.header(http::field::retry_after), "2");
      EXPECT_EQ(reply.header("X-Request-Id"), "w");
    }
    EXPECT_EQ(cancelled.load(), 3) << (stream ? "stream" : "whole");
  }
}

// A client that leaves a stream of several choices cancels every one of them.
TEST_F(HttpServerTest, ClientDisconnectCancelsEveryChoice) {
  std::atomic<int> cancelled{0};
  service_.script = [&](const v1::GenerateRequest&, const CallContext& context,
                        const std::function<bool(const v1::GenerateResponse&)>& send) {
    if (!send(Chunk("first"))) {
      ++cancelled;
      return absl::CancelledError("client went away");
    }
    return WaitForCancel(context, cancelled);
  };
  {
    tcp::socket socket = Connect();
    http::write(socket, MakeRequest(http::verb::post, "/v1/completions",
                                    Json{{"prompt", "x"}, {"n", 3}, {"stream", true}}.dump(), {}));
    ASSERT_TRUE(ReadUntil(socket, "first"));
  }
  const absl::Time until = absl::Now() + absl::Seconds(3);
  while (cancelled.load() < 3 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(cancelled.load(), 3);
}

// vLLM's /tokenize of a text or of a chat (rendered as the chat endpoint renders it), and
// /detokenize, with their errors naming the field.
TEST_F(HttpServerTest, TokenizeAndDetokenize) {
  Reply text = Post("/tokenize", {{"model", "mobius-test"}, {"prompt", "abc"}});
  ASSERT_EQ(text.status, 200u) << text.body;
  EXPECT_EQ(text.json(), Json({{"count", 3}, {"max_model_len", 100}, {"tokens", {1, 1, 1}}}));

  Reply chat = Post("/tokenize", {{"messages", {{{"role", "user"}, {"content", "yo"}}}},
                                  {"add_generation_prompt", false}});
  ASSERT_EQ(chat.status, 200u) << chat.body;
  EXPECT_EQ(chat.json()["count"], std::string("<user>yo").size());
  Reply prompted = Post("/tokenize", {{"messages", {{{"role", "user"}, {"content", "yo"}}}}});
  EXPECT_EQ(prompted.json()["count"], std::string("<user>yo<assistant>").size());
  EXPECT_TRUE(service_.chat_enable_thinking());
  ASSERT_EQ(Post("/tokenize", {{"messages", {{{"role", "user"}, {"content", "yo"}}}},
                               {"chat_template_kwargs", {{"enable_thinking", false}}}})
                .status,
            200u);
  EXPECT_FALSE(service_.chat_enable_thinking());
  ExpectError(Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "yo"}}}},
                                            {"chat_template_kwargs", {{"thinking", true}}}}),
              400, "chat_template_kwargs.thinking", "takes enable_thinking only");

  Reply back = Post("/detokenize", {{"tokens", {5, 6}}});
  ASSERT_EQ(back.status, 200u) << back.body;
  EXPECT_EQ(back.json(), Json({{"prompt", "5,6"}}));

  ExpectError(Post("/tokenize", Json::object()), 400, "prompt", "give either prompt");
  ExpectError(Post("/tokenize", {{"prompt", "a"}, {"messages", Json::array()}}), 400, "messages",
              "not both");
  ExpectError(Post("/tokenize", {{"prompt", 5}}), 400, "prompt", "prompt must be a string");
  ExpectError(Post("/tokenize", {{"prompt", "a"}, {"model", "other"}}), 400, "model", "other");
  ExpectError(Post("/tokenize", {{"prompt", "a"}, {"add_special_tokens", "no"}}), 400,
              "add_special_tokens", "must be a boolean");
  ExpectError(Post("/detokenize", {{"tokens", {1, -1}}}), 400, "tokens[1]",
              "tokens[1] must be an integer in [0, ");
  ExpectError(Post("/detokenize", {{"tokens", {1, 1000}}}), 400, "tokens",
              "tokens[1] = 1000 is not a token id");
  ExpectError(Post("/detokenize", Json::object()), 400, "tokens", "tokens is required");
  ExpectError(Send(http::verb::post, "/detokenize", "{}", {{"Content-Type", "text/plain"}}), 400,
              "", "application/json");
  Reply get = Send(http::verb::get, "/tokenize");
  EXPECT_EQ(get.status, 405u);
  EXPECT_EQ(get.header(http::field::allow), "POST");
}

// Chat with tools: the tools reach the prompt as the template's `tojson` writes them, and the
// model's <tool_call> blocks come back as OpenAI tool calls, whole and streamed.
const char kToolOutput[] =
    "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
    "</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";

Json ToolRequest() {
  return Json{{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
              {"tools",
               {{{"type", "function"},
                 {"function",
                  {{"name", "get_weather"},
                   {"parameters",
                    {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}}}};
}

// The output text in pieces of 5 bytes, then a stop.
std::vector<v1::GenerateResponse> InPieces(const std::string& text) {
  std::vector<v1::GenerateResponse> out;
  for (size_t at = 0; at < text.size(); at += 5) out.push_back(Chunk(text.substr(at, 5)));
  out.push_back(Complete(v1::FINISH_REASON_STOP, 9, static_cast<int>(out.size())));
  return out;
}

TEST_F(HttpServerTest, ChatToolCallsWhole) {
  service_.responses = InPieces(kToolOutput);
  Reply reply = Post("/v1/chat/completions", ToolRequest());
  ASSERT_EQ(reply.status, 200u) << reply.body;
  const Json choice = reply.json()["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["content"], "Checking.\n");
  const Json& calls = choice["message"]["tool_calls"];
  ASSERT_EQ(calls.size(), 2u) << reply.body;
  EXPECT_EQ(calls[0]["type"], "function");
  EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
  EXPECT_EQ(calls[0]["function"]["arguments"], "{\"city\": \"Paris\"}");
  EXPECT_EQ(calls[1]["function"]["name"], "now");
  for (const Json& call : calls) {
    const std::string id = call["id"];
    EXPECT_TRUE(absl::StartsWith(id, "call_") && id.size() == 29) << id;
  }
  EXPECT_NE(calls[0]["id"], calls[1]["id"]);
  // The tool as Python's json.dumps writes it, keys in the client's order (the Json of this test
  // sorts them, so "function" precedes "type" here).
  ASSERT_EQ(service_.chat_tools().size(), 1u);
  EXPECT_EQ(service_.chat_tools()[0],
            "{\"function\": {\"name\": \"get_weather\", \"parameters\": {\"properties\": "
            "{\"city\": {\"type\": \"string\"}}, \"type\": \"object\"}}, \"type\": \"function\"}");

  // parallel_tool_calls = false: the first call only.
  service_.responses = InPieces(kToolOutput);
  Json one = ToolRequest();
  one["parallel_tool_calls"] = false;
  Reply single = Post("/v1/chat/completions", one);
  EXPECT_EQ(single.json()["choices"][0]["message"]["tool_calls"].size(), 1u) << single.body;

  // tool_choice "none": no tools in the prompt, the text as it is.
  service_.responses = InPieces(kToolOutput);
  Json none = ToolRequest();
  none["tool_choice"] = "none";
  Reply text = Post("/v1/chat/completions", none);
  ASSERT_EQ(text.status, 200u) << text.body;
  EXPECT_EQ(text.json()["choices"][0]["message"]["content"], kToolOutput);
  EXPECT_FALSE(text.json()["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(text.json()["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(service_.chat_tools().empty());
}

// tool_choice "required" or a named function: the tools reach the prompt as for "auto", and the
// worker is asked to hold the output to one call block of that function (its arguments to its
// parameters, in the client's key order).
TEST_F(HttpServerTest, ChatForcedToolCalls) {
  const std::string body =
      R"({"messages": [{"role": "user", "content": "Weather?"}], "tools": [{"type": "function",)"
      R"( "function": {"name": "get_weather", "parameters": {"type": "object", "properties":)"
      R"( {"zone": {"type": "string"}, "city": {"type": "string"}}, "required": ["city"]}}},)"
      R"( {"type": "function", "function": {"name": "now"}}],)"
      R"( "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})";
  service_.responses = InPieces(
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}\n</tool_call>");
  Reply reply = Send(http::verb::post, "/v1/chat/completions", body);
  ASSERT_EQ(reply.status, 200u) << reply.body;
  EXPECT_EQ(reply.json()["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(reply.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "get_weather");
  EXPECT_EQ(service_.chat_tools().size(), 2u);
  std::vector<v1::GenerateRequest> requests = service_.requests();
  ASSERT_EQ(requests.size(), 1u);
  const v1::StructuredOutput& form = requests[0].sampling_params().structured_output();
  ASSERT_TRUE(form.has_tagged_json());
  EXPECT_EQ(form.tagged_json().begin(), "<tool_call>\n");
  EXPECT_EQ(form.tagged_json().end(), "\n</tool_call>");
  EXPECT_EQ(form.tagged_json().json_schema(),
            R"({"type":"object","required":["name","arguments"],"properties":{"name":)"
            R"({"const":"get_weather"},"arguments":{"type":"object","properties":{"zone":)"
            R"({"type":"string"},"city":{"type":"string"}},"required":["city"]}}})");

  // "required" with several tools: one call object per tool, told apart by the name, each
  // holding the arguments to its own function's parameters.
  Json required = ToolRequest();
  required["tools"].push_back({{"type", "function"}, {"function", {{"name", "now"}}}});
  required["tool_choice"] = "required";
  service_.responses =
      InPieces("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>");
  Reply any = Post("/v1/chat/completions", required);
  ASSERT_EQ(any.status, 200u) << any.body;
  const v1::StructuredOutput any_form =
      service_.requests().back().sampling_params().structured_output();
  // parallel_tool_calls (the default): one call or more, a line apart.
  EXPECT_EQ(any_form.tagged_json().max_blocks(), -1);
  EXPECT_EQ(any_form.tagged_json().separator(), "\n");
  EXPECT_EQ(any_form.tagged_json().json_schema(),
            R"({"anyOf":[{"type":"object","required":["name","arguments"],"properties":{"name":)"
            R"({"const":"get_weather"},"arguments":{"properties":{"city":{"type":"string"}},)"
            R"("type":"object"}}},{"type":"object","required":["name","arguments"],)"
            R"("properties":{"name":{"const":"now"},"arguments":{"type":"object"}}}]})");
  {
    absl::StatusOr<grammar::Grammar> g = grammar::TaggedJsonGrammar(
        any_form.tagged_json().begin(), any_form.tagged_json().json_schema(),
        any_form.tagged_json().end());
    ASSERT_TRUE(g.ok()) << g.status();
    grammar::GrammarMatcher call(*g);
    EXPECT_TRUE(call.FeedBytes(
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"));
    // get_weather's arguments hold its own properties only (now's take any object).
    grammar::GrammarMatcher crossed(*g);
    EXPECT_FALSE(
        crossed.FeedBytes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"zone\""));
  }
  Json single = required;
  single["parallel_tool_calls"] = false;
  service_.responses =
      InPieces("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>");
  ASSERT_EQ(Post("/v1/chat/completions", single).status, 200u);
  EXPECT_EQ(
      service_.requests().back().sampling_params().structured_output().tagged_json().max_blocks(),
      0);
  // Each tool's definitions keep their references, under a prefix of their own.
  Json with_defs = required;
  with_defs["tools"][1]["function"]["parameters"] = {
      {"type", "object"},
      {"properties",
       {{"at", {{"$ref", "#/$defs/When"}}},
        {"tag", {{"const", {{"$ref", "#/$defs/When"}}}}},  // data, kept as it is
        {"default", {{"$ref", "#/$defs/When"}}}}},         // a property named like a keyword
      {"required", {"at"}},
      {"$defs", {{"When", {{"type", "string"}}}}}};
  service_.responses =
      InPieces("<tool_call>\n{\"name\": \"now\", \"arguments\": {\"at\": \"x\"}}\n</tool_call>");
  ASSERT_EQ(Post("/v1/chat/completions", with_defs).status, 200u);
  const Json defs_schema = Json::parse(
      service_.requests().back().sampling_params().structured_output().tagged_json().json_schema());
  EXPECT_EQ(defs_schema["$defs"], Json({{"tools.1.When", {{"type", "string"}}}}));
  EXPECT_EQ(defs_schema["anyOf"][1]["properties"]["arguments"]["properties"]["at"]["$ref"],
            "#/$defs/tools.1.When");
  EXPECT_EQ(
      defs_schema["anyOf"][1]["properties"]["arguments"]["properties"]["tag"]["const"]["$ref"],
      "#/$defs/When");
  EXPECT_EQ(defs_schema["anyOf"][1]["properties"]["arguments"]["properties"]["default"]["$ref"],
            "#/$defs/tools.1.When");
  Json twice = required;
  twice["tools"][1]["function"]["name"] = "get_weather";
  ExpectError(Post("/v1/chat/completions", twice), 400, "tools[1].function.name",
              "tools[1].function.name \"get_weather\" repeats tools[0]'s");

  // A function without parameters still takes an arguments object.
  Json bare = required;
  bare["tool_choice"] = {{"type", "function"}, {"function", {{"name", "now"}}}};
  service_.responses =
      InPieces("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>");
  ASSERT_EQ(Post("/v1/chat/completions", bare).status, 200u);
  EXPECT_EQ(
      service_.requests().back().sampling_params().structured_output().tagged_json().json_schema(),
      R"({"type":"object","required":["name","arguments"],"properties":{"name":)"
      R"({"const":"now"},"arguments":{"type":"object"}}})");

  Json unknown = ToolRequest();
  unknown["tool_choice"] = {{"type", "function"}, {"function", {{"name", "fly"}}}};
  ExpectError(Post("/v1/chat/completions", unknown), 400, "tool_choice.function.name",
              "tool_choice names \"fly\", which is not among the tools");
  Json no_tools = {{"messages", {{{"role", "user"}, {"content", "x"}}}},
                   {"tool_choice", "required"}};
  ExpectError(Post("/v1/chat/completions", no_tools), 400, "tool_choice",
              "tool_choice \"required\" needs tools");
  Json both = ToolRequest();
  both["tool_choice"] = "required";
  both["response_format"] = {{"type", "json_object"}};
  ExpectError(Post("/v1/chat/completions", both), 400, "tool_choice",
              "a forced tool call already fixes the output's form");
  Json strange = ToolRequest();
  strange["tools"][0]["function"]["parameters"]["properties"]["city"]["pattern"] = "(?=A)";
  strange["tool_choice"] = "required";
  ExpectError(Post("/v1/chat/completions", strange), 400, "tools[0].function.parameters",
              "tools[0].function.parameters cannot be enforced for tool_choice: "
              "schema.properties.arguments.properties.city.pattern: lookaround assertions are "
              "not supported");
}

TEST_F(HttpServerTest, ChatToolCallsStreamed) {
  service_.responses = InPieces(kToolOutput);
  Json body = ToolRequest();
  body["stream"] = true;
  Reply reply = Post("/v1/chat/completions", body);
  ASSERT_EQ(reply.status, 200u) << reply.body;
  std::vector<std::string> data = SseData(reply.body);
  ASSERT_FALSE(data.empty());
  EXPECT_EQ(data.back(), "[DONE]");
  std::string content;
  std::vector<Json> calls;
  std::string finish;
  for (size_t e = 1; e + 1 < data.size(); ++e) {
    const Json delta = Json::parse(data[e])["choices"][0]["delta"];
    const Json reason = Json::parse(data[e])["choices"][0]["finish_reason"];
    if (reason.is_string()) finish = reason;
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (delta.contains("tool_calls")) {
      for (const Json& call : delta["tool_calls"]) calls.push_back(call);
    }
  }
  EXPECT_EQ(content, "Checking.\n");  // nothing of the blocks leaks into the content
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[1]["index"], 1);
  EXPECT_EQ(calls[0]["function"]["arguments"], "{\"city\": \"Paris\"}");
  EXPECT_EQ(calls[1]["function"]["name"], "now");
  EXPECT_TRUE(absl::StartsWith(calls[0]["id"].get<std::string>(), "call_"));
  EXPECT_EQ(finish, "tool_calls");
}

// Earlier tool turns render through the template: the assistant's calls and the tool results.
TEST_F(HttpServerTest, ChatToolTurnsReachTheRenderer) {
  service_.responses = {Chunk("21 degrees."), Complete(v1::FINISH_REASON_STOP, 9, 3)};
  Json body = ToolRequest();
  body["messages"].push_back(
      {{"role", "assistant"},
       {"content", nullptr},
       {"tool_calls",
        {{{"id", "call_1"},
          {"type", "function"},
          {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}}}}});
  body["messages"].push_back({{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "21"}});
  Reply reply = Post("/v1/chat/completions", body);
  ASSERT_EQ(reply.status, 200u) << reply.body;
  EXPECT_EQ(reply.json()["choices"][0]["message"]["content"], "21 degrees.");
  EXPECT_EQ(reply.json()["choices"][0]["finish_reason"], "stop");
  const std::vector<tokenizer::ChatMessage> messages = service_.chat_messages();
  ASSERT_EQ(messages.size(), 3u);
  ASSERT_EQ(messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(messages[1].tool_calls[0].name, "get_weather");
  EXPECT_EQ(messages[1].tool_calls[0].arguments, "{\"city\": \"Paris\"}");
  EXPECT_EQ(messages[2].role, "tool");
  EXPECT_EQ(messages[2].content, "21");
}

// vLLM's chat_template_kwargs.enable_thinking reaches the template.
TEST_F(HttpServerTest, ChatTemplateKwargsReachTheRenderer) {
  service_.responses = {Chunk("Hi"), Complete(v1::FINISH_REASON_STOP, 5, 1)};
  ASSERT_EQ(Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "yo"}}}},
                                          {"chat_template_kwargs", {{"enable_thinking", false}}}})
                .status,
            200u);
  EXPECT_FALSE(service_.chat_enable_thinking());
  service_.responses = {Chunk("Hi"), Complete(v1::FINISH_REASON_STOP, 5, 1)};
  ASSERT_EQ(
      Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "yo"}}}}}).status,
      200u);
  EXPECT_TRUE(service_.chat_enable_thinking());
  ExpectError(Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "yo"}}}},
                                            {"chat_template_kwargs", {{"enable_thinking", 0}}}}),
              400, "chat_template_kwargs.enable_thinking", "must be a boolean");
}

// A server with the reasoning parser: the <think> block becomes reasoning_content, whole and
// streamed, and the answer after it still goes through the tool-call parser.
class ReasoningServerTest : public HttpServerTest {
 protected:
  void SetUp() override {
    HttpServerOptions options;
    options.parse_reasoning = true;
    StartServer(options);
  }
};

// With thinking on, a chat's form holds after the reasoning block; with it off, from the start.
TEST_F(ReasoningServerTest, StructuredOutputWaitsForTheReasoning) {
  const Json format = {{"type", "json_object"}};
  service_.responses = InPieces("<think>\nok\n</think>\n\n{\"a\": 1}");
  Reply thinking =
      Post("/v1/chat/completions",
           {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"response_format", format}});
  ASSERT_EQ(thinking.status, 200u) << thinking.body;
  EXPECT_EQ(thinking.json()["choices"][0]["message"]["reasoning_content"], "ok");
  EXPECT_EQ(thinking.json()["choices"][0]["message"]["content"], "{\"a\": 1}");
  EXPECT_EQ(service_.requests().back().sampling_params().structured_output().reasoning_end(),
            "</think>");
  service_.responses = InPieces("{\"a\": 1}");
  Reply direct =
      Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "x"}}}},
                                    {"response_format", format},
                                    {"chat_template_kwargs", {{"enable_thinking", false}}}});
  ASSERT_EQ(direct.status, 200u) << direct.body;
  EXPECT_EQ(service_.requests().back().sampling_params().structured_output().reasoning_end(), "");
}

TEST_F(ReasoningServerTest, ThinkBlockIsReasoningContent) {
  const std::string output =
      "<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": "
      "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  service_.responses = InPieces(output);
  Reply whole = Post("/v1/chat/completions", ToolRequest());
  ASSERT_EQ(whole.status, 200u) << whole.body;
  const Json message = whole.json()["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "The user wants weather.");
  EXPECT_EQ(message["content"], "Checking.\n");
  ASSERT_EQ(message["tool_calls"].size(), 1u);
  EXPECT_EQ(whole.json()["choices"][0]["finish_reason"], "tool_calls");

  service_.responses = InPieces(output);
  Json body = ToolRequest();
  body["stream"] = true;
  Reply streamed = Post("/v1/chat/completions", body);
  ASSERT_EQ(streamed.status, 200u) << streamed.body;
  std::string reasoning, content;
  int calls = 0;
  for (const std::string& data : SseData(streamed.body)) {
    if (data == "[DONE]") continue;
    const Json delta = Json::parse(data)["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"];
    if (delta.contains("content")) content += delta["content"];
    if (delta.contains("tool_calls")) calls += static_cast<int>(delta["tool_calls"].size());
  }
  EXPECT_EQ(reasoning, "The user wants weather.");
  EXPECT_EQ(content, "Checking.\n");
  EXPECT_EQ(calls, 1);

  // An answer without a block: no reasoning (null), the text as content; completions untouched.
  service_.responses = InPieces("Just this.");
  Reply plain =
      Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "x"}}}}});
  EXPECT_TRUE(plain.json()["choices"][0]["message"]["reasoning_content"].is_null()) << plain.body;
  EXPECT_EQ(plain.json()["choices"][0]["message"]["content"], "Just this.");
  service_.responses = InPieces("<think>a</think>b");
  Reply completion = Post("/v1/completions", {{"prompt", "x"}});
  EXPECT_EQ(completion.json()["choices"][0]["text"], "<think>a</think>b");
}

TEST_F(HttpServerTest, ModelsHealthAndRouting) {
  Reply models = Send(http::verb::get, "/v1/models");
  ASSERT_EQ(models.status, 200u);
  Json list = models.json();
  EXPECT_EQ(list["object"], "list");
  ASSERT_EQ(list["data"].size(), 1u);
  EXPECT_EQ(list["data"][0]["id"], "mobius-test");
  EXPECT_EQ(list["data"][0]["object"], "model");
  EXPECT_EQ(list["data"][0]["owned_by"], "mobius");
  EXPECT_EQ(list["data"][0]["max_model_len"], 100);
  EXPECT_EQ(Send(http::verb::get, "/v1/models/mobius-test").status, 200u);
  EXPECT_EQ(Send(http::verb::get, "/v1/models/other").status, 404u);

  EXPECT_EQ(Send(http::verb::get, "/health").status, 200u);
  service_.ready = false;
  EXPECT_EQ(Send(http::verb::get, "/health").status, 503u);

  ExpectError(Send(http::verb::get, "/v2/nothing"), 404, "", "/v2/nothing");
  Reply wrong_method = Send(http::verb::get, "/v1/completions");
  ExpectError(wrong_method, 405, "", "GET");
  EXPECT_EQ(wrong_method.header(http::field::allow), "POST");
  EXPECT_EQ(Send(http::verb::post, "/health", "{}").status, 405u);
  EXPECT_EQ(Send(http::verb::get, "/metrics").status, 404u);  // no registry given
}

TEST_F(HttpServerTest, ModelsWithoutModelInfoOmitsLength) {
  service_.model_info_ok = false;
  Reply models = Send(http::verb::get, "/v1/models");
  ASSERT_EQ(models.status, 200u);
  EXPECT_FALSE(models.json()["data"][0].contains("max_model_len"));
}

TEST_F(HttpServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  service_.responses = {Chunk("a"), Complete(v1::FINISH_REASON_STOP, 1, 1)};
  tcp::socket socket = Connect();
  EXPECT_EQ(Send(socket, http::verb::get, "/health").status, 200u);
  Reply stream = Send(socket, http::verb::post, "/v1/completions",
                      Json{{"prompt", "x"}, {"stream", true}}.dump());
  EXPECT_EQ(SseData(stream.body).back(), "[DONE]");
  EXPECT_EQ(Send(socket, http::verb::post, "/v1/completions", Json{{"prompt", "x"}}.dump()).status,
            200u);
  EXPECT_EQ(Send(socket, http::verb::get, "/v1/models").status, 200u);
}

TEST_F(HttpServerTest, PipelinedRequestsAreAnsweredInOrder) {
  service_.responses = {Chunk("a"), Complete(v1::FINISH_REASON_STOP, 1, 1)};
  service_.delay = absl::Milliseconds(20);  // the second request arrives while the first runs
  tcp::socket socket = Connect();
  http::write(socket, MakeRequest(http::verb::post, "/v1/completions",
                                  Json{{"prompt", "x"}, {"stream", true}}.dump(),
                                  {{"X-Request-Id", "one"}}));
  http::write(socket, MakeRequest(http::verb::post, "/v1/completions", Json{{"prompt", "y"}}.dump(),
                                  {{"X-Request-Id", "two"}}));
  beast::flat_buffer buffer;
  for (const char* id : {"one", "two"}) {
    http::response<http::string_body> response;
    beast::error_code ec;
    http::read(socket, buffer, response, ec);
    ASSERT_FALSE(ec) << ec.message();
    EXPECT_EQ(response.result_int(), 200u);
    EXPECT_EQ(std::string(response["X-Request-Id"]), id);
  }
}

TEST_F(HttpServerTest, ExpectContinueGetsAnInterimResponse) {
  service_.responses = {Chunk("a"), Complete(v1::FINISH_REASON_STOP, 1, 1)};
  tcp::socket socket = Connect();
  const std::string body = Json{{"prompt", "x"}}.dump();
  http::request<http::string_body> request =
      MakeRequest(http::verb::post, "/v1/completions", body, {{"Expect", "100-continue"}});
  http::request_serializer<http::string_body> serializer(request);
  http::write_header(socket, serializer);
  beast::flat_buffer buffer;
  http::response<http::empty_body> interim;
  http::read(socket, buffer, interim);
  EXPECT_EQ(interim.result(), http::status::continue_);
  net::write(socket, net::buffer(body));
  http::response<http::string_body> response;
  http::read(socket, buffer, response);
  EXPECT_EQ(response.result_int(), 200u) << response.body();
}

TEST_F(HttpServerTest, Http10StreamEndsWithTheConnection) {
  service_.responses = {Chunk("a"), Complete(v1::FINISH_REASON_STOP, 1, 1)};
  tcp::socket socket = Connect();
  http::request<http::string_body> request = MakeRequest(
      http::verb::post, "/v1/completions", Json{{"prompt", "x"}, {"stream", true}}.dump(), {});
  request.version(10);
  http::write(socket, request);
  std::string all;
  char chunk[1024];
  beast::error_code ec;
  while (!ec) {
    size_t n = socket.read_some(net::buffer(chunk), ec);
    all.append(chunk, n);
  }
  EXPECT_EQ(ec, net::error::eof);
  EXPECT_TRUE(absl::StartsWith(all, "HTTP/1.0 200")) << all;
  EXPECT_FALSE(absl::StrContains(all, "chunked")) << all;
  EXPECT_TRUE(absl::EndsWith(all, "data: [DONE]\n\n")) << all;
}

TEST_F(HttpServerTest, ShutdownLetsStreamsFinishWithinGrace) {
  service_.responses = {Chunk("a"), Chunk("b"), Chunk("c"), Complete(v1::FINISH_REASON_STOP, 1, 3)};
  service_.delay = absl::Milliseconds(50);
  Reply reply;
  std::thread client([&] {
    reply = Post("/v1/completions", Json{{"prompt", "x"}, {"stream", true}});
  });
  ASSERT_TRUE(service_.started().WaitForNotificationWithTimeout(absl::Seconds(3)));
  server_->Shutdown(absl::Seconds(5));
  client.join();
  EXPECT_EQ(reply.status, 200u);
  EXPECT_EQ(SseData(reply.body).back(), "[DONE]");
  // No longer accepting.
  tcp::socket socket(ioc_);
  beast::error_code ec;
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), server_->port()), ec);
  EXPECT_TRUE(ec);
}

TEST_F(HttpServerTest, ShutdownAfterGraceCancelsRequests) {
  service_.block = true;
  std::thread client([&] {
    tcp::socket socket = Connect();
    http::write(socket,
                MakeRequest(http::verb::post, "/v1/completions", Json{{"prompt", "x"}}.dump(), {}));
    beast::flat_buffer buffer;
    http::response<http::string_body> response;
    beast::error_code ec;
    http::read(socket, buffer, response, ec);  // the connection is closed under it
  });
  ASSERT_TRUE(service_.started().WaitForNotificationWithTimeout(absl::Seconds(3)));
  const absl::Time start = absl::Now();
  server_->Shutdown(absl::Milliseconds(50));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  EXPECT_TRUE(service_.saw_cancel().HasBeenNotified());
  client.join();
}

class SmallBodyTest : public HttpServerTest {
 protected:
  void SetUp() override {
    HttpServerOptions options;
    options.max_body_bytes = 1024;
    options.metrics = &registry_;
    prometheus::BuildCounter()
        .Name("mobius_test_total")
        .Help("A test counter.")
        .Register(registry_)
        .Add({{"kind", "x"}})
        .Increment(3);
    StartServer(options);
  }
  prometheus::Registry registry_;
};

TEST_F(SmallBodyTest, BodyOverTheLimitIs413) {
  Reply reply = Post("/v1/completions", {{"prompt", std::string(4096, 'a')}});
  ExpectError(reply, 413, "", "1024 bytes");
  EXPECT_TRUE(service_.requests().empty());
}

TEST_F(SmallBodyTest, MetricsServesTheRegistry) {
  Reply reply = Send(http::verb::get, "/metrics");
  ASSERT_EQ(reply.status, 200u);
  EXPECT_TRUE(absl::StartsWith(reply.header(http::field::content_type), "text/plain"));
  EXPECT_TRUE(absl::StrContains(reply.body, "mobius_test_total{kind=\"x\"} 3")) << reply.body;
}

}  // namespace
}  // namespace mobius::router
