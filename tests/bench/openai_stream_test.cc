// The OpenAI stream recorder with chosen arrival times (vLLM's timing rules: every event with
// non-empty choices is a chunk; usage gives the counts), its failures, the request bodies, error
// bodies and --base-url parsing.
#include "bench/serve/openai_stream.h"

#include <chrono>

#include "bench/serve/http_connection.h"
#include "common/json_parse.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mobius::bench {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Clock = OpenAiStreamRecorder::Clock;

constexpr double kTol = 1e-9;
const Clock::time_point kSent{};

Clock::time_point At(int ms) { return kSent + std::chrono::milliseconds(ms); }

TEST(OpenAiStreamRecorderTest, TimesChunksAndTakesCountsFromUsage) {
  OpenAiStreamRecorder recorder(kSent);
  ASSERT_TRUE(
      recorder.OnBytes("data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n", At(100)).ok());
  // One event split across two reads is timed when it is complete.
  ASSERT_TRUE(recorder.OnBytes("data: {\"choices\":[{\"te", At(140)).ok());
  ASSERT_TRUE(recorder.OnBytes("xt\":\"b\"}]}\n\n", At(150)).ok());
  // The final finish_reason event (empty text) is a chunk too, as in vLLM; the usage event
  // (empty choices) is not.
  ASSERT_TRUE(recorder
                  .OnBytes("data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n"
                           "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,"
                           "\"completion_tokens\":2}}\n\ndata: [DONE]\n\n",
                           At(200))
                  .ok());
  RequestOutcome o = recorder.Finish(absl::OkStatus(), /*prompt_len=*/99);
  ASSERT_TRUE(o.success) << o.error;
  EXPECT_NEAR(o.ttft_s, 0.1, kTol);
  ASSERT_EQ(o.itl_s.size(), 2u);
  EXPECT_NEAR(o.itl_s[0], 0.05, kTol);
  EXPECT_NEAR(o.itl_s[1], 0.05, kTol);
  EXPECT_NEAR(o.latency_s, 0.2, kTol);
  EXPECT_EQ(o.output_tokens, 2);
  EXPECT_EQ(o.prompt_tokens, 4);
}

TEST(OpenAiStreamRecorderTest, WithoutUsageChunksCountAndThePromptLengthIsTheWorkloads) {
  OpenAiStreamRecorder recorder(kSent);
  ASSERT_TRUE(recorder
                  .OnBytes("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n"
                           "data: {\"choices\":[{\"delta\":{\"content\":\"y\"}}]}\n\n",
                           At(30))
                  .ok());
  ASSERT_TRUE(recorder.OnBytes("data: [DONE]\n\n", At(40)).ok());
  RequestOutcome o = recorder.Finish(absl::OkStatus(), 7);
  ASSERT_TRUE(o.success);
  EXPECT_EQ(o.output_tokens, 2);
  EXPECT_EQ(o.prompt_tokens, 7);
  EXPECT_THAT(o.itl_s, ElementsAre(0.0));  // two events in one read: one arrival time
}

TEST(OpenAiStreamRecorderTest, ErrorEventFailsTheRequestWithTheServersMessage) {
  OpenAiStreamRecorder recorder(kSent);
  ASSERT_TRUE(recorder.OnBytes("data: {\"choices\":[{\"text\":\"a\"}]}\n\n", At(10)).ok());
  absl::Status s = recorder.OnBytes(
      "data: {\"error\":{\"message\":\"failed after 1 output tokens\",\"type\":\"x\"}}\n\n",
      At(20));
  ASSERT_FALSE(s.ok());
  RequestOutcome o = recorder.Finish(s, 1);
  EXPECT_FALSE(o.success);
  EXPECT_EQ(o.error, "error event: failed after 1 output tokens");
}

TEST(OpenAiStreamRecorderTest, MalformedEventsFail) {
  for (const char* body : {"data: {not json\n\n", "data: [1, 2]\n\n"}) {
    OpenAiStreamRecorder recorder(kSent);
    absl::Status s = recorder.OnBytes(body, At(1));
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << body;
    EXPECT_THAT(recorder.Finish(s, 1).error, HasSubstr("malformed SSE event")) << body;
  }
}

TEST(OpenAiStreamRecorderTest, StreamsThatEndEarlyFail) {
  {
    OpenAiStreamRecorder recorder(kSent);
    ASSERT_TRUE(recorder.OnBytes("data: {\"choices\":[{\"text\":\"a\"}]}\n\n", At(1)).ok());
    EXPECT_EQ(recorder.Finish(absl::OkStatus(), 1).error, "stream ended without data: [DONE]");
  }
  {
    OpenAiStreamRecorder recorder(kSent);
    ASSERT_TRUE(recorder.OnBytes("data: {\"choices\":[{\"te", At(1)).ok());
    EXPECT_EQ(recorder.Finish(absl::OkStatus(), 1).error, "stream cut in the middle of an event");
  }
  {
    OpenAiStreamRecorder recorder(kSent);
    ASSERT_TRUE(recorder.OnBytes("data: [DONE]\n\n", At(1)).ok());
    EXPECT_EQ(recorder.Finish(absl::OkStatus(), 1).error, "stream had no chunk with choices");
  }
  {
    OpenAiStreamRecorder recorder(kSent);
    EXPECT_EQ(recorder.Finish(absl::UnavailableError("read response body: end of stream"), 1).error,
              "read response body: end of stream");
  }
}

TEST(OpenAiRequestBodyTest, CompletionsWithTokenIdsIsGreedyIgnoresEosAndStreamsUsage) {
  BenchRequest r;
  r.prompt_ids = {5, 6, 7};
  r.prompt_len = 3;
  r.output_len = 9;
  auto body = ParseJson(OpenAiRequestBody(r, OpenAiEndpoint::kCompletions, "tiny"));
  ASSERT_TRUE(body.ok());
  EXPECT_EQ((*body)["prompt"], nlohmann::json({5, 6, 7}));
  EXPECT_EQ((*body)["max_tokens"], 9);
  EXPECT_EQ((*body)["model"], "tiny");
  EXPECT_EQ((*body)["temperature"], 0.0);
  EXPECT_EQ((*body)["ignore_eos"], true);
  EXPECT_EQ((*body)["stream"], true);
  EXPECT_EQ((*body)["stream_options"]["include_usage"], true);
}

TEST(OpenAiRequestBodyTest, ChatSendsOneUserMessageAndNoModelWhenUnknown) {
  BenchRequest r;
  r.is_text = true;
  r.prompt_text = "the of and";
  r.output_len = 4;
  auto body = ParseJson(OpenAiRequestBody(r, OpenAiEndpoint::kChatCompletions, ""));
  ASSERT_TRUE(body.ok());
  EXPECT_EQ((*body)["messages"],
            nlohmann::json::parse(R"([{"role": "user", "content": "the of and"}])"));
  EXPECT_EQ((*body)["max_completion_tokens"], 4);
  EXPECT_FALSE(body->contains("model"));
  EXPECT_FALSE(body->contains("response_format"));
}

TEST(OpenAiRequestBodyTest, JsonSchemaGoesOutAsResponseFormat) {
  BenchRequest r;
  r.prompt_ids = {5};
  r.output_len = 2;
  r.json_schema = R"({"type": "array", "items": {"type": "string"}})";
  for (OpenAiEndpoint endpoint : {OpenAiEndpoint::kCompletions, OpenAiEndpoint::kChatCompletions}) {
    auto body = ParseJson(OpenAiRequestBody(r, endpoint, "tiny"));
    ASSERT_TRUE(body.ok());
    EXPECT_EQ((*body)["response_format"]["type"], "json_schema");
    EXPECT_EQ((*body)["response_format"]["json_schema"]["schema"],
              nlohmann::json::parse(r.json_schema));
    EXPECT_TRUE((*body)["response_format"]["json_schema"]["name"].is_string());
  }
}

TEST(OpenAiErrorMessageTest, ErrorObjectOrTheBodyCut) {
  EXPECT_EQ(OpenAiErrorMessage(R"({"error": {"message": "bad top_p", "type": "x"}})"), "bad top_p");
  EXPECT_EQ(OpenAiErrorMessage("plain text"), "plain text");
  EXPECT_EQ(OpenAiErrorMessage(std::string(500, 'x')).size(), 203u);
}

TEST(ParseBaseUrlTest, HostPortAndPrefix) {
  auto url = ParseBaseUrl("http://127.0.0.1:8000");
  ASSERT_TRUE(url.ok());
  EXPECT_EQ(url->host, "127.0.0.1");
  EXPECT_EQ(url->port, "8000");
  EXPECT_EQ(url->path_prefix, "");
  url = ParseBaseUrl("http://example.com/proxy/");
  ASSERT_TRUE(url.ok());
  EXPECT_EQ(url->port, "80");
  EXPECT_EQ(url->path_prefix, "/proxy");
  url = ParseBaseUrl("http://[::1]:9000");
  ASSERT_TRUE(url.ok());
  EXPECT_EQ(url->host, "::1");
  EXPECT_EQ(url->port, "9000");
  for (const char* bad : {"https://x:1", "localhost:8000", "http://:80", "http://x:0",
                          "http://x:99999", "http://x:port", "http://[::1"}) {
    auto r = ParseBaseUrl(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("--base-url")) << bad;
  }
}

}  // namespace
}  // namespace mobius::bench
