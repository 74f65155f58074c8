// Several choices in one OpenAI request (`n`, batches of prompts) through real processes: a
// mobius-worker of the intern-s2-mobius-tiny fixture behind a mobius-router. Each choice must be
// exactly what a request of its own gives: choice k of a prompt sampled with seed + k, greedy
// choices equal to `mobius generate`. Outputs are read from the `logprobs` token labels, since
// the fixture has no tokenizer.
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "tests/e2e/serving_deployment.h"
#include "tests/util/http_client.h"

namespace mobius::testing {
namespace {

using Json = nlohmann::json;
namespace http = boost::beast::http;

constexpr int kMaxTokens = 8;

// The ids of a whole completion choice, from its logprob labels ("token_id:N").
std::vector<int32_t> ChoiceTokens(const Json& choice) {
  std::vector<int32_t> ids;
  for (const Json& label : choice["logprobs"]["tokens"]) {
    int32_t id = -1;
    const std::string s = label.get<std::string>();
    EXPECT_TRUE(s.rfind("token_id:", 0) == 0 && absl::SimpleAtoi(s.substr(9), &id)) << s;
    ids.push_back(id);
  }
  return ids;
}

Json Completion(int port, const Json& body) {
  const HttpReply reply = HttpCall(port, http::verb::post, "/v1/completions", body.dump());
  EXPECT_EQ(reply.status, 200) << reply.body;
  return Json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
}

Json SampledBody(const Json& prompt, int n, uint64_t seed) {
  return Json{{"prompt", prompt},   {"n", n},        {"seed", seed},
              {"temperature", 1.0}, {"logprobs", 0}, {"max_tokens", kMaxTokens}};
}

TEST(OpenAiChoicesTest, EachChoiceIsTheRequestItStandsFor) {
  Deployment d({.workers = 1, .worker_flags = {"--max-model-len=256"}});
  ASSERT_TRUE(d.ready());
  const std::vector<int32_t> prompt = {5, 36, 67, 98};
  constexpr uint64_t kSeed = 11;

  // n = 3, sampled: choice k is the request with seed + k on its own.
  const Json three = Completion(d.http_port(), SampledBody(prompt, 3, kSeed));
  ASSERT_EQ(three["choices"].size(), 3u) << three.dump();
  std::vector<std::vector<int32_t>> sampled;
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(three["choices"][k]["index"], k);
    sampled.push_back(ChoiceTokens(three["choices"][k]));
    ASSERT_EQ(sampled.back().size(), static_cast<size_t>(kMaxTokens)) << three.dump();
    const Json alone = Completion(d.http_port(), SampledBody(prompt, 1, kSeed + k));
    EXPECT_EQ(sampled.back(), ChoiceTokens(alone["choices"][0])) << "choice " << k;
  }
  // Different seeds draw differently (8 draws at temperature 1 over 2048 tokens).
  EXPECT_NE(sampled[0], sampled[1]);
  EXPECT_NE(sampled[1], sampled[2]);
  EXPECT_EQ(three["usage"]["prompt_tokens"], static_cast<int>(prompt.size()));
  EXPECT_EQ(three["usage"]["completion_tokens"], 3 * kMaxTokens);

  // The same request streamed: the same choices, each chunk tagged with its own.
  Json streamed_body = SampledBody(prompt, 3, kSeed);
  streamed_body["stream"] = true;
  SseStream stream(d.http_port(), "/v1/completions", streamed_body.dump());
  ASSERT_EQ(stream.status(), 200);
  std::vector<std::vector<int32_t>> streamed(3);
  bool done = false;
  while (std::optional<std::string> data = stream.Next()) {
    if (*data == "[DONE]") {
      done = true;
      continue;
    }
    const Json chunk = Json::parse(*data, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(chunk.contains("error")) << *data;
    const int index = chunk["choices"][0]["index"].get<int>();
    ASSERT_TRUE(index >= 0 && index < 3) << *data;
    AppendChunkTokens(chunk, streamed[index]);
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(streamed, sampled);

  // A batch of two prompts, greedy: each choice is `mobius generate`'s output for its prompt.
  const std::vector<int32_t> other = {1000, 7, 2047};
  const Json batch = Completion(
      d.http_port(),
      Json{{"prompt", {prompt, other}}, {"temperature", 0}, {"logprobs", 0}, {"max_tokens", 8}});
  ASSERT_EQ(batch["choices"].size(), 2u) << batch.dump();
  EXPECT_EQ(ChoiceTokens(batch["choices"][0]), MobiusGenerate(prompt, kMaxTokens));
  EXPECT_EQ(ChoiceTokens(batch["choices"][1]), MobiusGenerate(other, kMaxTokens));
  EXPECT_EQ(batch["usage"]["prompt_tokens"], static_cast<int>(prompt.size() + other.size()));
  EXPECT_TRUE(d.WaitWorkerIdle(0, 2000));
}

}  // namespace
}  // namespace mobius::testing
