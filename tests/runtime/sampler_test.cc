#include "worker/runtime/sampler.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mobius::worker {
namespace {

using ::testing::HasSubstr;

SampledToken SampleOnce(const SamplingParams& params, std::vector<float> logits,
                        const TokenHistory& history = {}, uint64_t seed = 1) {
  RequestSampler sampler(params, seed);
  return sampler.Sample(logits, history);
}

TEST(SamplerTest, GreedyPicksArgmax) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(SampleOnce(p, {0.1f, 3.0f, -1.0f, 2.9f}).token, 1);
}

TEST(SamplerTest, TruncationsReduceToArgmax) {
  const std::vector<float> logits = {0.5f, 0.1f, 0.4f, 0.45f};
  for (int trial = 0; trial < 50; ++trial) {
    SamplingParams k;
    k.top_k = 1;
    EXPECT_EQ(SampleOnce(k, logits, {}, trial).token, 0);
    SamplingParams top_p;
    top_p.top_p = 0.01f;
    EXPECT_EQ(SampleOnce(top_p, logits, {}, trial).token, 0);
    SamplingParams min_p;
    min_p.min_p = 0.99f;
    EXPECT_EQ(SampleOnce(min_p, logits, {}, trial).token, 0);
  }
}

TEST(SamplerTest, SeedMakesSamplingReproducible) {
  SamplingParams p;
  p.seed = 1234;
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[i] = std::sin(i * 0.7f);
  RequestSampler a(p, 1), b(p, 999);  // the request's seed wins over the fallback
  std::vector<int32_t> sa, sb;
  for (int i = 0; i < 64; ++i) {
    std::vector<float> la = logits, lb = logits;
    sa.push_back(a.Sample(la, {}).token);
    sb.push_back(b.Sample(lb, {}).token);
  }
  EXPECT_EQ(sa, sb);
  p.seed = 1235;
  RequestSampler c(p, 1);
  std::vector<int32_t> sc;
  for (int i = 0; i < 64; ++i) {
    std::vector<float> l = logits;
    sc.push_back(c.Sample(l, {}).token);
  }
  EXPECT_NE(sa, sc);
}

TEST(SamplerTest, EmpiricalDistributionMatchesSoftmaxAtTemperature) {
  const std::vector<float> logits = {1.0f, 0.0f, -0.5f, 2.0f};
  SamplingParams p;
  p.temperature = 0.7f;
  p.seed = 42;
  RequestSampler sampler(p, 0);
  std::vector<int> counts(4);
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = logits;
    ++counts[sampler.Sample(l, {}).token];
  }
  double z = 0;
  for (float x : logits) z += std::exp(x / 0.7);
  double chi2 = 0;
  for (int t = 0; t < 4; ++t) {
    const double expected = n * std::exp(logits[t] / 0.7) / z;
    chi2 += (counts[t] - expected) * (counts[t] - expected) / expected;
  }
  EXPECT_LT(chi2, 16.3);  // chi-square, 3 degrees of freedom, p = 0.001
}

TEST(SamplerTest, PenaltiesApplyToSeenTokens) {
  SamplingParams p;
  p.temperature = 0;
  TokenHistory history;
  const std::vector<int32_t> prompt = {0};
  history.AddPrompt(prompt);
  p.repetition_penalty = 2.0f;
  EXPECT_EQ(SampleOnce(p, {2.0f, 1.9f}, history).token, 1);  // 2.0 / 2 < 1.9
  p.repetition_penalty = 1.0f;
  EXPECT_EQ(SampleOnce(p, {2.0f, 1.9f}, history).token, 0);  // prompt alone: no frequency
  history.AddOutput(0);
  history.AddOutput(0);
  p.frequency_penalty = 0.06f;  // 2.0 - 0.12 < 1.9
  EXPECT_EQ(SampleOnce(p, {2.0f, 1.9f}, history).token, 1);
  p.frequency_penalty = 0;
  p.presence_penalty = 0.2f;
  EXPECT_EQ(SampleOnce(p, {2.0f, 1.9f}, history).token, 1);
}

TEST(SamplerTest, LogprobsAreNormalisedAndSorted) {
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 3;
  const std::vector<float> logits = {0.3f, 2.0f, -1.0f, 1.5f, 0.0f};
  SampledToken s = SampleOnce(p, logits);
  ASSERT_EQ(s.top.size(), 3u);
  EXPECT_EQ(s.top[0].token, 1);
  EXPECT_EQ(s.top[1].token, 3);
  EXPECT_EQ(s.top[2].token, 0);
  EXPECT_FLOAT_EQ(s.logprob, s.top[0].logprob);
  double z = 0;
  for (float x : logits) z += std::exp(x);
  EXPECT_NEAR(s.logprob, 2.0 - std::log(z), 1e-5);
}

TEST(SamplingParamsTest, ValidateNamesTheField) {
  SamplingParams p;
  EXPECT_TRUE(p.Validate(10).ok());
  p.top_p = 0;
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("top_p"));
  p = {};
  p.temperature = -1;
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("temperature"));
  p = {};
  p.stop_token_ids = {10};
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("stop_token_ids"));
  p = {};
  p.repetition_penalty = 0;
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("repetition_penalty"));
}

}  // namespace
}  // namespace mobius::worker
