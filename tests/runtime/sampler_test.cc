#include "worker/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

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

// The kept set of top-k / top-p / min-p, as a full sort of the vocabulary defines it: sorted by
// logit (ties: lower id), cut by top-k, then kept while p >= min_p * p_max until the mass reaches
// top_p of the total (of the top-k, or of every token). Distribution() must keep exactly that
// set with those probabilities, though it no longer sorts the whole vocabulary.
std::vector<double> ReferenceDistribution(const SamplingParams& params, std::vector<float> logits) {
  const int vocab = static_cast<int>(logits.size());
  const float t = params.temperature;
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp((x - max_logit) / t);
  const float log_z = static_cast<float>(std::log(sum));
  std::vector<int32_t> order(vocab);
  for (int i = 0; i < vocab; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  if (params.top_k > 0 && params.top_k < vocab) order.resize(params.top_k);
  std::vector<double> p(order.size());
  double total = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    p[i] = std::exp((logits[order[i]] - max_logit) / t - log_z);
    total += p[i];
  }
  size_t n = 0;
  double cumulative = 0;
  for (; n < order.size(); ++n) {
    if (n > 0 && p[n] < params.min_p * p[0]) break;
    cumulative += p[n];
    if (cumulative >= params.top_p * total) {
      ++n;
      break;
    }
  }
  n = std::max<size_t>(n, 1);
  double kept = 0;
  for (size_t i = 0; i < n; ++i) kept += p[i];
  std::vector<double> dist(vocab, 0.0);
  for (size_t i = 0; i < n; ++i) dist[order[i]] = p[i] / kept;
  return dist;
}

TEST(SamplerTest, TruncationKeepsWhatAFullSortKeeps) {
  std::mt19937 rng(11);
  // Release-sized rows: a few large logits over a wide tail, as a language model's; and ties.
  const int vocab = 151936;
  std::normal_distribution<float> tail(0.0f, 2.5f);
  for (int row = 0; row < 6; ++row) {
    std::vector<float> logits(vocab);
    for (float& x : logits) x = tail(rng);
    for (int i = 0; i < 40; ++i) logits[rng() % vocab] = 12.0f + i % 7;  // repeated values: ties
    for (float temperature : {0.3f, 1.0f, 1.7f}) {
      for (auto [top_k, top_p, min_p] :
           std::vector<std::tuple<int, float, float>>{{0, 0.9f, 0.0f},
                                                      {0, 0.5f, 0.0f},
                                                      {0, 1.0f, 0.05f},
                                                      {0, 0.95f, 0.01f},
                                                      {0, 0.999f, 0.0f},
                                                      {50, 0.9f, 0.0f},
                                                      {0, 1.0f, 0.0f},
                                                      {7, 1.0f, 0.2f}}) {
        SamplingParams params;
        params.temperature = temperature;
        params.top_k = top_k;
        params.top_p = top_p;
        params.min_p = min_p;
        const std::vector<double> want = ReferenceDistribution(params, logits);
        std::vector<float> work = logits;
        const std::vector<double> got = RequestSampler(params, 1).Distribution(work, {});
        ASSERT_EQ(got.size(), want.size());
        int kept_want = 0, kept_got = 0;
        double worst = 0;
        // Tokens of negligible mass are not counted: summed in sorted order they stop changing
        // the double total, so the full sort's rule at top_p = 1 stops before them.
        for (int v = 0; v < vocab; ++v) {
          kept_want += want[v] > 1e-15;
          kept_got += got[v] > 1e-15;
          // Both sides exponentiate in float and normalise differently (a float log-sum against
          // a double sum): a few 1e-7 apart relative, and anything apart below 1e-15.
          worst = std::max(worst, std::fabs(got[v] - want[v]) / (want[v] + 1e-9));
        }
        EXPECT_EQ(kept_got, kept_want) << "T " << temperature << " top_k " << top_k << " top_p "
                                       << top_p << " min_p " << min_p;
        EXPECT_LT(worst, 3e-6) << "T " << temperature << " top_k " << top_k;
      }
    }
  }
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

// The engine's device path (DeviceRule, NextUniform, then Backend::SampleRows) draws what Sample
// draws from the same stream, here through the backend's host default (the CPU backend's).
TEST(SamplerTest, DeviceRuleAndNextUniformReproduceSample) {
  kernels::CpuBackend backend(1);
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int vocab = 3000;
  std::vector<SamplingParams> cases(6);
  cases[0].temperature = 0;
  cases[1].temperature = 0.8f;
  cases[2].top_p = 0.9f;
  cases[3].top_k = 20;
  cases[3].temperature = 1.2f;
  cases[4].min_p = 0.05f;
  cases[4].logprobs = 0;  // the chosen token's logprob: still on the device
  cases[5].top_k = 40;
  cases[5].top_p = 0.95f;
  cases[5].min_p = 0.01f;
  for (size_t c = 0; c < cases.size(); ++c) {
    cases[c].seed = 100 + c;
    RequestSampler host(cases[c], 1), device(cases[c], 1);
    ASSERT_TRUE(device.DeviceRule().has_value()) << "case " << c;
    for (int step = 0; step < 20; ++step) {
      std::vector<float> row(vocab);
      for (float& x : row) x = normal(gen);
      std::vector<float> copy = row;
      const SampledToken expected = host.Sample(copy, {});
      auto logits = backend.Allocate(kernels::DType::kF32, {1, vocab});
      ASSERT_TRUE(logits.ok());
      backend.CopyFromHost(row.data(), kernels::DType::kF32, *logits);
      const kernels::SamplingRule rule = *device.DeviceRule();
      const double u = device.NextUniform();
      std::vector<kernels::DrawnToken> drawn(1);
      backend.SampleRows(*logits, std::span<const kernels::SamplingRule>(&rule, 1),
                         std::span<const double>(&u, 1), drawn);
      EXPECT_EQ(drawn[0].token, expected.token) << "case " << c << " step " << step;
      EXPECT_FLOAT_EQ(drawn[0].logprob, expected.logprob) << "case " << c << " step " << step;
    }
  }
  // Penalties and top-n logprobs need the host.
  SamplingParams penalised;
  penalised.presence_penalty = 0.5f;
  EXPECT_FALSE(RequestSampler(penalised, 1).DeviceRule().has_value());
  SamplingParams top_n;
  top_n.logprobs = 2;
  EXPECT_FALSE(RequestSampler(top_n, 1).DeviceRule().has_value());
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
