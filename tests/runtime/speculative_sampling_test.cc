// Speculative sampling stays exact (issue 6): with drafts from a distribution unlike the
// target's, the first token a step emits follows the target distribution (chi-square over many
// trials); the target distribution is RequestSampler::Distribution, which matches what Sample
// draws with penalties, temperature and truncations; greedy verdicts are "longest matching prefix
// plus one".
#include "worker/runtime/speculative_sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/sampler.h"

namespace mobius::worker {
namespace {

constexpr int kVocab = 8;
// Chi-square critical value at 7 degrees of freedom, p = 0.001: a correct sampler exceeds it once
// in a thousand runs (the seeds are fixed, so a run either passes or fails every time).
constexpr double kChi2Critical = 24.32;

double ChiSquare(const std::vector<int>& counts, const std::vector<double>& p, int trials) {
  double chi2 = 0;
  for (int v = 0; v < kVocab; ++v) {
    const double expected = p[v] * trials;
    if (expected < 1e-9) {
      if (counts[v] > 0) return 1e30;  // a token the target never emits
      continue;
    }
    chi2 += (counts[v] - expected) * (counts[v] - expected) / expected;
  }
  return chi2;
}

std::vector<double> Softmax(const std::vector<double>& logits) {
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) sum += p[i] = std::exp(logits[i]);
  for (double& x : p) x /= sum;
  return p;
}

TEST(SpeculativeSamplingTest, FirstEmittedTokenFollowsTheTarget) {
  const std::vector<double> p0 = Softmax({2.0, 0.5, -1.0, 1.5, 0.0, -0.5, 1.0, -2.0});
  const std::vector<double> p1 = Softmax({0.0, 1.0, 0.0, -1.0, 2.0, 0.0, 0.5, 0.0});
  const std::vector<double> p2 = Softmax({1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0});
  // Drafts from a distribution far from the target: most proposals are rejected.
  const std::vector<double> q0 = Softmax({-2.0, 1.0, 2.0, -1.0, 0.5, 1.5, -0.5, 1.0});
  const std::vector<double> q1 = Softmax({1.0, 0.0, 2.0, 0.0, -1.0, 0.0, 0.0, 1.0});
  for (int k = 1; k <= 2; ++k) {
    const std::vector<std::vector<double>> q = {q0, q1};
    const std::vector<std::vector<double>> p = {p0, p1, p2};
    std::mt19937_64 rng(1234 + k), draft_rng(99 + k);
    constexpr int kTrials = 40000;
    std::vector<int> first(kVocab, 0), drafted(kVocab, 0);
    int accepted_total = 0;
    for (int trial = 0; trial < kTrials; ++trial) {
      std::vector<int32_t> drafts;
      for (int i = 0; i < k; ++i) {
        std::discrete_distribution<int32_t> d(q[i].begin(), q[i].end());
        drafts.push_back(d(draft_rng));
      }
      const DraftVerdict v =
          VerifyDrafts(drafts, std::span(q).first(k), std::span(p).first(k + 1), rng);
      ASSERT_LE(v.accepted, k);
      ++first[v.accepted > 0 ? drafts[0] : v.next];
      ++drafted[drafts[0]];
      accepted_total += v.accepted;
    }
    const double chi2 = ChiSquare(first, p0, kTrials);
    std::printf("k=%d: chi-square %.2f (critical %.2f), mean accepted %.3f\n", k, chi2,
                kChi2Critical, static_cast<double>(accepted_total) / kTrials);
    EXPECT_LT(chi2, kChi2Critical) << "k " << k;
    // The test has power: the drafts themselves do not follow the target.
    EXPECT_GT(ChiSquare(drafted, p0, kTrials), 100 * kChi2Critical);
  }
}

TEST(SpeculativeSamplingTest, GreedyIsLongestMatchingPrefixPlusOne) {
  auto one_hot = [](int t) {
    std::vector<double> v(kVocab, 0.0);
    v[t] = 1.0;
    return v;
  };
  std::mt19937_64 rng(7);
  const std::vector<std::vector<double>> p = {one_hot(3), one_hot(5), one_hot(1), one_hot(6)};
  const std::vector<std::vector<double>> q = {one_hot(3), one_hot(5), one_hot(2)};
  const std::vector<int32_t> drafts = {3, 5, 2};
  const DraftVerdict v = VerifyDrafts(drafts, q, p, rng);
  EXPECT_EQ(v.accepted, 2);
  EXPECT_EQ(v.next, 1);  // the target's token where the draft went wrong
  const std::vector<int32_t> all_right = {3, 5, 1};
  const std::vector<std::vector<double>> q_right = {one_hot(3), one_hot(5), one_hot(1)};
  const DraftVerdict bonus = VerifyDrafts(all_right, q_right, p, rng);
  EXPECT_EQ(bonus.accepted, 3);
  EXPECT_EQ(bonus.next, 6);  // the bonus token
}

// The engine verifies greedy requests' drafts from the argmax of each row alone (taken on the
// device): the same verdicts as the sampler's rule over the full rows, ties included.
TEST(SpeculativeSamplingTest, GreedyDraftsFromArgmaxMatchTheSamplersRule) {
  SamplingParams greedy;
  greedy.temperature = 0;
  RequestSampler sampler(greedy, 1);
  ASSERT_TRUE(sampler.ArgmaxOnly());
  std::mt19937 gen(11);
  std::uniform_int_distribution<int> small(0, 3);  // few distinct logits: many ties
  const int vocab = 50, k = 4;
  int accepted_total = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> rows(static_cast<size_t>(k + 1) * vocab);
    for (float& x : rows) x = static_cast<float>(small(gen));
    std::vector<int32_t> argmax(k + 1);
    for (int j = 0; j <= k; ++j) {
      const float* row = rows.data() + j * vocab;
      argmax[j] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
    }
    // Drafts that follow the argmaxes for a random number of positions, then stray.
    const int right = trial % (k + 1);
    std::vector<int32_t> drafts(k);
    for (int j = 0; j < k; ++j) drafts[j] = j < right ? argmax[j] : (argmax[j] + 1) % vocab;
    std::vector<float> copy = rows;
    const DraftVerdict full = VerifyDraftsWithSampler(drafts, copy, sampler, TokenHistory{});
    const DraftVerdict fast = VerifyGreedyDrafts(drafts, argmax);
    EXPECT_EQ(fast.accepted, full.accepted) << "trial " << trial;
    EXPECT_EQ(fast.next, full.next) << "trial " << trial;
    EXPECT_EQ(fast.accepted, right) << "trial " << trial;
    accepted_total += fast.accepted;
  }
  EXPECT_GT(accepted_total, 0);
}

// VerifyDraftsWithSampler is VerifyDrafts with q one-hot at the drafts and p the sampler's
// distributions (each row seeing the drafts before it): the same verdicts from the same stream,
// for sampled requests with truncation and penalties, drafts accepted or not.
TEST(SpeculativeSamplingTest, SamplerVerificationIsTheGeneralRule) {
  SamplingParams params;
  params.temperature = 0.9f;
  params.top_p = 0.9f;
  params.presence_penalty = 0.3f;
  params.seed = 77;
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  const int vocab = 64, k = 3;
  TokenHistory history;
  history.AddPrompt(std::vector<int32_t>{3, 9, 9, 17});
  int accepted = 0, rejected = 0;
  RequestSampler fast(params, 1), general(params, 1);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<float> rows(static_cast<size_t>(k + 1) * vocab);
    for (float& x : rows) x = normal(gen);
    std::vector<int32_t> drafts(k);
    for (int j = 0; j < k; ++j) {  // mostly the row's best token, sometimes not
      const float* row = rows.data() + j * vocab;
      drafts[j] = trial % 4 == 0 ? (j * 7 + trial) % vocab
                                 : static_cast<int32_t>(std::max_element(row, row + vocab) - row);
    }
    std::vector<float> copy = rows;
    const DraftVerdict got = VerifyDraftsWithSampler(drafts, copy, fast, history);
    std::vector<std::vector<double>> p(k + 1), q(k);
    TokenHistory seen = history;
    for (int j = 0; j <= k; ++j) {
      p[j] = general.Distribution(std::span<float>(rows).subspan(j * vocab, vocab), seen);
      if (j < k) {
        q[j].assign(vocab, 0.0);
        q[j][drafts[j]] = 1.0;
        seen.AddOutput(drafts[j]);
      }
    }
    const DraftVerdict want = VerifyDrafts(drafts, q, p, general.rng());
    EXPECT_EQ(got.accepted, want.accepted) << "trial " << trial;
    EXPECT_EQ(got.next, want.next) << "trial " << trial;
    accepted += got.accepted;
    rejected += got.accepted < k;
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
}

// The device form of a verify (the engine's on a backend that samples): the uniforms peeked
// from the stream, every row checked at once (kernels::CheckDraft with the penalties counting
// the drafts before it), VerdictFromChecks, then the stream consumed. The same verdicts as
// VerifyDraftsWithSampler row by row, and the stream left where it leaves it; for truncating,
// penalised and greedy rules, drafts outside the vocabulary, accepted and rejected drafts.
TEST(SpeculativeSamplingTest, CheckedRowsReproduceTheSamplersVerify) {
  std::mt19937 gen(9);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  const int vocab = 64, k = 4;
  TokenHistory history;
  history.AddPrompt(std::vector<int32_t>{3, 9, 17});
  history.AddOutput(9);
  int accepted = 0, rejected = 0;
  for (int c = 0; c < 5; ++c) {
    SamplingParams params;
    params.seed = 100 + c;
    params.temperature = c == 4 ? 0.0f : 0.7f + 0.2f * c;
    if (c == 1) params.top_k = 6;
    if (c == 2) params.top_p = 0.8f;
    if (c == 3) params.min_p = 0.1f;
    if (c % 2 == 0) params.frequency_penalty = 0.5f;
    if (c == 3) params.repetition_penalty = 1.3f;
    if (c == 4) params.logprobs = 0;  // greedy but not ArgmaxOnly: the full rule
    RequestSampler host(params, 1), device(params, 1);
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<float> rows(static_cast<size_t>(k + 1) * vocab);
      for (float& x : rows) x = normal(gen);
      std::vector<int32_t> drafts(k);
      for (int j = 0; j < k; ++j) {
        const float* row = rows.data() + j * vocab;
        const int32_t best = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
        drafts[j] = trial % 5 == 0 ? (j * 13 + trial) % vocab : trial % 7 == 0 ? vocab + j : best;
      }
      if (trial % 3 == 0) drafts[1] = drafts[0];  // a draft that counts twice in the penalties
      std::vector<float> copy = rows;
      const DraftVerdict want = VerifyDraftsWithSampler(drafts, copy, host, history);
      const std::vector<double> u = PeekVerifyUniforms(device.rng(), k);
      std::vector<kernels::DrawnToken> checks(k + 1);
      RequestSampler::VerifyPenaltyLists lists;
      const std::vector<kernels::LogitPenalties> penalties =
          device.VerifyPenalties(history, drafts, lists);
      for (int j = 0; j <= k; ++j) {
        std::span<float> row = std::span<float>(rows).subspan(j * vocab, vocab);
        kernels::ApplyLogitPenalties(row, penalties[j]);
        checks[j] = kernels::CheckDraft(row, device.Rule(), j < k ? drafts[j] : kernels::kNoDraft,
                                        VerifyRowUniform(u, j, k));
      }
      const DraftVerdict got = VerdictFromChecks(drafts, u, checks);
      ConsumeVerifyUniforms(device.rng(), got, k);
      EXPECT_EQ(got.accepted, want.accepted) << "case " << c << " trial " << trial;
      EXPECT_EQ(got.next, want.next) << "case " << c << " trial " << trial;
      EXPECT_EQ(device.rng(), host.rng()) << "case " << c << " trial " << trial;
      accepted += got.accepted;
      rejected += got.accepted < k;
    }
  }
  EXPECT_GT(accepted, 100);
  EXPECT_GT(rejected, 100);
}

// Distribution is what Sample draws from, sampling parameters included.
TEST(SpeculativeSamplingTest, DistributionMatchesSampleWithSamplingParameters) {
  SamplingParams params;
  params.temperature = 0.8f;
  params.top_p = 0.9f;
  params.top_k = 6;
  params.repetition_penalty = 1.3f;
  params.presence_penalty = 0.2f;
  TokenHistory history;
  const std::vector<int32_t> prompt = {1, 4};
  history.AddPrompt(prompt);
  history.AddOutput(2);
  const std::vector<float> logits = {1.0f, 2.0f, 1.5f, 0.2f, 1.8f, -0.5f, 0.9f, 0.1f};
  RequestSampler sampler(params, 5);
  std::vector<float> row = logits;
  const std::vector<double> dist = sampler.Distribution(row, history);
  double total = 0;
  for (double x : dist) total += x;
  EXPECT_NEAR(total, 1.0, 1e-9);
  constexpr int kTrials = 40000;
  std::vector<int> counts(kVocab, 0);
  for (int i = 0; i < kTrials; ++i) {
    std::vector<float> r = logits;
    ++counts[sampler.Sample(r, history).token];
  }
  const double chi2 = ChiSquare(counts, dist, kTrials);
  std::printf("Sample vs Distribution: chi-square %.2f\n", chi2);
  EXPECT_LT(chi2, kChi2Critical);
  // Truncation removed some tokens entirely.
  int zeros = 0;
  for (double x : dist) zeros += x == 0.0;
  EXPECT_GE(zeros, 2);
}

}  // namespace
}  // namespace mobius::worker
