// Structured output through real processes: a mobius-worker of the intern-s2-mobius-tiny fixture
// (random weights: its preferences are arbitrary, so any well-formed output shows the
// grammar's work) with the Qwen3 tokenizer's first 2048 ids as its vocabulary (the 256 bytes and
// the first merges), behind a mobius-router with the same tokenizer. Prompts are token ids (the
// router's encodings would reach ids past the fixture's vocabulary).
#include <regex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/e2e/serving_deployment.h"
#include "tests/util/http_client.h"

namespace mobius::testing {
namespace {

using Json = nlohmann::json;
namespace http = boost::beast::http;

std::string Tokenizer() { return std::string(MOBIUS_FIXTURES_DIR) + "/tokenizer-qwen3"; }

Json Post(int port, const char* path, const Json& body, int expected_status = 200) {
  const HttpReply reply = HttpCall(port, http::verb::post, path, body.dump());
  EXPECT_EQ(reply.status, expected_status) << reply.body;
  return Json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
}

TEST(OpenAiStructuredOutputTest, OutputsHoldTheirForm) {
  Deployment d({.workers = 1,
                .worker_flags = {"--max-model-len=512", "--tokenizer=" + Tokenizer()},
                .router_flags = {"--tokenizer=" + Tokenizer()}});
  ASSERT_TRUE(d.ready());
  const std::vector<int32_t> prompt = {5, 36, 67, 98};
  // Properties declared out of alphabetical order: generated in the declared order.
  const std::string schema_text = R"({"type": "object", "properties": {
      "zeta": {"type": "string", "maxLength": 5}, "count": {"type": "integer", "minimum": 1, "maximum": 9},
      "mode": {"enum": ["fast", "slow"]}}, "required": ["zeta", "count", "mode"]})";
  for (int seed = 0; seed < 3; ++seed) {
    // The body as text, so that the schema's key order is the client's.
    const std::string body = R"({"prompt": [5, 36, 67, 98], "max_tokens": 300, "seed": )" +
                             std::to_string(seed) + R"(, "temperature": )" +
                             (seed == 0 ? "0" : "1") +
                             R"(, "response_format": {"type": "json_schema", "json_schema":)"
                             R"( {"name": "r", "schema": )" +
                             schema_text + "}}}";
    const HttpReply reply = HttpCall(d.http_port(), http::verb::post, "/v1/completions", body);
    ASSERT_EQ(reply.status, 200) << reply.body;
    const Json response = Json::parse(reply.body, nullptr, false);
    const Json& choice = response["choices"][0];
    EXPECT_EQ(choice["finish_reason"], "stop") << response.dump();
    const std::string text = choice["text"].get<std::string>();
    const Json value = Json::parse(text, nullptr, false);
    ASSERT_TRUE(value.is_object()) << text;
    ASSERT_TRUE(value["zeta"].is_string()) << text;
    ASSERT_TRUE(value["count"].is_number_integer()) << text;
    EXPECT_GE(value["count"].get<int>(), 1) << text;
    EXPECT_LE(value["count"].get<int>(), 9) << text;
    EXPECT_TRUE(value["mode"] == "fast" || value["mode"] == "slow") << text;
    EXPECT_LT(text.find("\"zeta\""), text.find("\"count\"")) << text;
  }

  // vLLM's guided_choice, streamed.
  const HttpReply streamed = HttpCall(
      d.http_port(), http::verb::post, "/v1/completions",
      Json{{"prompt", prompt}, {"guided_choice", {"red", "green", "blue"}}, {"stream", true}}
          .dump());
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  std::string text;
  for (size_t at = streamed.body.find("data: "); at != std::string::npos;
       at = streamed.body.find("data: ", at + 6)) {
    const size_t end = streamed.body.find("\n\n", at);
    const Json event = Json::parse(streamed.body.substr(at + 6, end - at - 6), nullptr, false);
    if (event.is_object() && event.contains("choices") && !event["choices"].empty()) {
      text += event["choices"][0].value("text", "");
    }
  }
  EXPECT_TRUE(text == "red" || text == "green" || text == "blue") << streamed.body;

  // vLLM's guided_regex: the whole text matches.
  const Json regex = Post(d.http_port(), "/v1/completions",
                          {{"prompt", prompt},
                           {"max_tokens", 40},
                           {"temperature", 1},
                           {"seed", 3},
                           {"guided_regex", "(red|green|blue)-[0-9]{2,3}"}});
  const std::string code = regex["choices"][0]["text"].get<std::string>();
  EXPECT_TRUE(std::regex_match(code, std::regex("(red|green|blue)-[0-9]{2,3}"))) << regex.dump();

  // A schema outside the subset is refused before any worker sees it, with its location.
  const Json refused =
      Post(d.http_port(), "/v1/completions",
           {{"prompt", prompt},
            {"guided_json", {{"type", "object"}, {"properties", {{"n", {{"multipleOf", 2}}}}}}}},
           400);
  EXPECT_EQ(refused["error"]["param"], "guided_json") << refused.dump();
  EXPECT_NE(refused["error"]["message"].get<std::string>().find("schema.properties.n.multipleOf"),
            std::string::npos)
      << refused.dump();
}

TEST(OpenAiStructuredOutputTest, AWorkerWithoutATokenizerRefusesWithTheReason) {
  Deployment d({.workers = 1});
  ASSERT_TRUE(d.ready());
  const HttpReply reply =
      HttpCall(d.http_port(), http::verb::post, "/v1/completions",
               Json{{"prompt", {5, 36}}, {"response_format", {{"type", "json_object"}}}}.dump());
  EXPECT_EQ(reply.status, 400);  // FAILED_PRECONDITION: invalid_request_error
  EXPECT_NE(reply.body.find("--tokenizer"), std::string::npos) << reply.body;
}

}  // namespace
}  // namespace mobius::testing
