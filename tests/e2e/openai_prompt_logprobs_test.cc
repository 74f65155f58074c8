// Prompt scoring through real processes (a mobius-worker of the intern-s2-mobius-tiny fixture
// behind a mobius-router): /v1/completions with echo, logprobs and prompt_logprobs, the way
// evaluation harnesses score a continuation (echo, logprobs, max_tokens 0). A greedy
// continuation, appended to its prompt and scored, must come back as the argmax (rank 1) of each
// of its positions with the logprob the generation reported for it. The fixture has no
// tokenizer, so tokens are "token_id:N" labels and the echoed text is empty. return_token_ids
// gives the same ids as the labels.
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

std::string Label(int32_t id) { return "token_id:" + std::to_string(id); }

Json Completion(int port, const Json& body) {
  const HttpReply reply = HttpCall(port, http::verb::post, "/v1/completions", body.dump());
  EXPECT_EQ(reply.status, 200) << reply.body;
  return Json::parse(reply.body, nullptr, /*allow_exceptions=*/false);
}

TEST(OpenAiPromptLogprobsTest, AScoredContinuationIsWhatGenerationReported) {
  Deployment d({.workers = 1, .worker_flags = {"--max-model-len=256"}});
  ASSERT_TRUE(d.ready());
  const std::vector<int32_t> prompt = {5, 36, 67, 98};

  // The greedy continuation, with each token's logprob (the temperature-1 log-softmax), and the
  // ids of prompt and output (return_token_ids).
  const Json generated = Completion(d.http_port(), Json{{"prompt", prompt},
                                                        {"temperature", 0},
                                                        {"logprobs", 0},
                                                        {"max_tokens", 2},
                                                        {"return_token_ids", true}});
  const Json& out = generated["choices"][0]["logprobs"];
  EXPECT_EQ(generated["choices"][0]["prompt_token_ids"], Json(prompt));
  ASSERT_EQ(out["tokens"].size(), 2u) << generated.dump();
  std::vector<int32_t> continued = prompt;
  std::vector<double> generated_logprobs;
  for (int k = 0; k < 2; ++k) {
    int32_t id = -1;
    ASSERT_TRUE(absl::SimpleAtoi(out["tokens"][k].get<std::string>().substr(9), &id));
    continued.push_back(id);
    generated_logprobs.push_back(out["token_logprobs"][k].get<double>());
  }
  EXPECT_EQ(generated["choices"][0]["token_ids"],
            Json(std::vector<int32_t>(continued.begin() + prompt.size(), continued.end())));

  // Scored: echo, logprobs 2, max_tokens 0 (the prompt alone comes back).
  const Json scoring{{"prompt", continued}, {"echo", true}, {"logprobs", 2}, {"max_tokens", 0}};
  const Json scored = Completion(d.http_port(), scoring);
  const Json& choice = scored["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_EQ(scored["usage"]["completion_tokens"], 0);
  EXPECT_EQ(scored["usage"]["prompt_tokens"], static_cast<int>(continued.size()));
  const Json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), continued.size()) << scored.dump();
  for (size_t k = 0; k < continued.size(); ++k) EXPECT_EQ(lp["tokens"][k], Label(continued[k]));
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t k = 1; k < continued.size(); ++k) {
    EXPECT_TRUE(lp["token_logprobs"][k].is_number()) << k;
    EXPECT_LE(lp["top_logprobs"][k].size(), 3u) << k;  // two alternatives and the token
  }
  // The continuation's positions: their token is the argmax, with the generation's logprob.
  const Json& prompt_logprobs = choice["prompt_logprobs"];
  ASSERT_EQ(prompt_logprobs.size(), continued.size()) << scored.dump();
  EXPECT_TRUE(prompt_logprobs[0].is_null());
  for (int k = 0; k < 2; ++k) {
    const size_t at = prompt.size() + k;
    EXPECT_NEAR(lp["token_logprobs"][at].get<double>(), generated_logprobs[k], 1e-4) << k;
    const Json& entry = prompt_logprobs[at][std::to_string(continued[at])];
    EXPECT_EQ(entry["rank"], 1) << prompt_logprobs[at].dump();
    EXPECT_NEAR(entry["logprob"].get<double>(), generated_logprobs[k], 1e-4) << k;
    EXPECT_EQ(entry["decoded_token"], Label(continued[at]));
  }
  // Every entry holds its token and its top 2 (logprobs 2 sets prompt_logprobs 2 under echo).
  for (size_t k = 1; k < continued.size(); ++k) {
    const Json& entry = prompt_logprobs[k];
    EXPECT_TRUE(entry.contains(std::to_string(continued[k]))) << entry.dump();
    EXPECT_GE(entry.size(), 2u);
    EXPECT_LE(entry.size(), 3u);
    EXPECT_NEAR(entry[std::to_string(continued[k])]["logprob"].get<double>(),
                lp["token_logprobs"][k].get<double>(), 1e-6);
  }

  // Streamed: one event with the same prompt entries, then the finish.
  Json streamed_body = scoring;
  streamed_body["stream"] = true;
  SseStream stream(d.http_port(), "/v1/completions", streamed_body.dump());
  ASSERT_EQ(stream.status(), 200);
  std::vector<Json> events;
  while (std::optional<std::string> data = stream.Next()) {
    if (*data == "[DONE]") break;
    events.push_back(Json::parse(*data, nullptr, /*allow_exceptions=*/false));
  }
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0]["choices"][0]["logprobs"], lp);
  EXPECT_EQ(events[0]["choices"][0]["prompt_logprobs"], prompt_logprobs);
  EXPECT_EQ(events[1]["choices"][0]["finish_reason"], "length");

  // Echo while generating: the prompt's entries, then the same greedy continuation.
  const Json echoed = Completion(d.http_port(), Json{{"prompt", prompt},
                                                     {"echo", true},
                                                     {"temperature", 0},
                                                     {"logprobs", 0},
                                                     {"max_tokens", 2}});
  const Json& all = echoed["choices"][0]["logprobs"]["tokens"];
  ASSERT_EQ(all.size(), continued.size()) << echoed.dump();
  for (size_t k = 0; k < continued.size(); ++k) EXPECT_EQ(all[k], Label(continued[k]));
  EXPECT_EQ(echoed["usage"]["completion_tokens"], 2);
  EXPECT_TRUE(d.WaitWorkerIdle(0, 2000));
}

}  // namespace
}  // namespace mobius::testing
