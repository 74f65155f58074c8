#include "worker/runtime/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
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

// TokenHistory keeps each seen token's output count beside it, in first-seen order.
TEST(SamplerTest, HistoryCountsFollowSeenTokens) {
  TokenHistory history;
  const std::vector<int32_t> prompt = {7, 3, 7, -1};
  history.AddPrompt(prompt);
  history.AddOutput(3);
  history.AddOutput(11);
  history.AddOutput(3);
  history.AddOutput(-4);
  EXPECT_EQ(history.seen(), (std::vector<int32_t>{7, 3, 11}));
  EXPECT_EQ(history.counts(), (std::vector<int32_t>{0, 2, 1}));
  EXPECT_TRUE(history.InPrompt(7));
  EXPECT_FALSE(history.InPrompt(11));
  EXPECT_EQ(history.OutputCount(3), 2);
  EXPECT_EQ(history.OutputCount(7), 0);
  EXPECT_EQ(history.OutputCount(500), 0);
}

// A structured-output mask bans exactly the tokens whose bit is clear, and every token past its
// last word; beside allowed_token_ids a token must pass both. Words that allow everything,
// nothing and some, and a row that ends inside a word.
TEST(SamplerTest, AllowedMaskBansEveryOtherToken) {
  constexpr int kVocab = 300;  // 4 words and 44 tokens of a fifth
  std::vector<float> row(kVocab);
  for (int t = 0; t < kVocab; ++t) row[t] = 0.01f * t;
  for (const size_t words : {5u, 3u}) {  // a mask over the row, and one 108 tokens short
    std::vector<uint64_t> mask = {~uint64_t{0}, 0, 0x8000000000000001ULL, 0xf0f0f0f0f0f0f0f0ULL,
                                  ~uint64_t{0}};
    mask.resize(words);
    const std::vector<int32_t> allowed = {0, 5, 64, 128, 191, 200, 299, 400};
    for (const bool with_list : {false, true}) {
      kernels::LogitPenalties p;
      p.allowed_mask = mask;
      if (with_list) p.allowed_tokens = allowed;
      ASSERT_TRUE(p.Active());
      std::vector<float> got = row;
      kernels::ApplyLogitPenalties(got, p);
      for (int t = 0; t < kVocab; ++t) {
        bool keep = static_cast<size_t>(t / 64) < mask.size() && (mask[t / 64] >> (t % 64) & 1);
        if (with_list) keep &= std::find(allowed.begin(), allowed.end(), t) != allowed.end();
        EXPECT_EQ(got[t], keep ? row[t] : -std::numeric_limits<float>::infinity())
            << "words " << words << " list " << with_list << " token " << t;
      }
    }
  }
}

// The penalties' arithmetic, step by step, including the repetition penalty's two directions.
TEST(SamplerTest, LogitPenaltiesFormula) {
  std::vector<float> logits = {2.0f, -2.0f, 1.0f, 0.5f};
  const std::vector<int32_t> tokens = {0, 1, 3, 9};  // 9 is outside the row: ignored
  const std::vector<int32_t> counts = {0, 3, 1, 4};
  // (Fields assigned one by one: an aggregate initializer that leaves the rest default warns.)
  kernels::LogitPenalties p;
  p.repetition = 1.25f;
  p.frequency = 0.5f;
  p.presence = 0.25f;
  p.tokens = tokens;
  p.counts = counts;
  ASSERT_TRUE(p.Active());
  kernels::ApplyLogitPenalties(logits, p);
  EXPECT_FLOAT_EQ(logits[0], 2.0f / 1.25f);
  EXPECT_FLOAT_EQ(logits[1], -2.0f * 1.25f - (0.5f * 3 + 0.25f));
  EXPECT_FLOAT_EQ(logits[2], 1.0f);
  EXPECT_FLOAT_EQ(logits[3], 0.5f / 1.25f - (0.5f + 0.25f));
  kernels::LogitPenalties neutral;  // counts, but no penalty
  neutral.tokens = tokens;
  neutral.counts = counts;
  EXPECT_FALSE(neutral.Active());
  kernels::LogitPenalties no_tokens;  // a penalty, but no counts
  no_tokens.repetition = 1.5f;
  EXPECT_FALSE(no_tokens.Active());
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

// The engine's device path (Penalties and Backend::PenalizeRows, Rule and NextUniform for
// Backend::SampleRows, then Backend::TopLogitsRows and TopLogprobs) gives what Sample gives from
// the same stream, here through the backend's host defaults (the CPU backend's).
TEST(SamplerTest, BackendPartsReproduceSample) {
  kernels::CpuBackend backend(1);
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int vocab = 3000;
  std::vector<SamplingParams> cases(11);
  cases[0].temperature = 0;
  cases[1].temperature = 0.8f;
  cases[2].top_p = 0.9f;
  cases[3].top_k = 20;
  cases[3].temperature = 1.2f;
  cases[4].min_p = 0.05f;
  cases[4].logprobs = 0;  // the chosen token's logprob alone
  cases[5].top_k = 40;
  cases[5].top_p = 0.95f;
  cases[5].min_p = 0.01f;
  // Penalties, greedy and sampled.
  cases[6].temperature = 0;
  cases[6].repetition_penalty = 1.3f;
  cases[7].frequency_penalty = 0.7f;
  cases[7].presence_penalty = 0.4f;
  cases[8].top_p = 0.9f;
  cases[8].repetition_penalty = 0.8f;
  cases[8].frequency_penalty = -0.3f;
  cases[8].logprobs = 0;
  // Top-n logprobs, with penalties and without, greedy and sampled.
  cases[9].temperature = 0.7f;
  cases[9].logprobs = 5;
  cases[9].repetition_penalty = 1.2f;
  cases[10].temperature = 0;
  cases[10].logprobs = 20;
  for (size_t c = 0; c < cases.size(); ++c) {
    cases[c].seed = 100 + c;
    RequestSampler host(cases[c], 1), device(cases[c], 1);
    TokenHistory history;
    const std::vector<int32_t> prompt = {5, 17, 5, 2999, 40};
    history.AddPrompt(prompt);
    for (int step = 0; step < 20; ++step) {
      std::vector<float> row(vocab);
      for (float& x : row) x = normal(gen);
      row[40] = 9.0f;          // a seen token the draw would take unpenalised
      row[7] = row[8] = 8.0f;  // a tie among the best: the lower id first
      std::vector<float> copy = row;
      const SampledToken expected = host.Sample(copy, history);
      auto logits = backend.Allocate(kernels::DType::kF32, {1, vocab});
      ASSERT_TRUE(logits.ok());
      backend.CopyFromHost(row.data(), kernels::DType::kF32, *logits);
      const kernels::SamplingRule rule = device.Rule();
      const kernels::LogitPenalties penalties = device.Penalties(history);
      const double u = device.NextUniform();
      backend.PenalizeRows(*logits, std::span<const kernels::LogitPenalties>(&penalties, 1));
      std::vector<kernels::DrawnToken> drawn(1);
      backend.SampleRows(*logits, std::span<const kernels::SamplingRule>(&rule, 1),
                         std::span<const double>(&u, 1), {}, drawn);
      EXPECT_EQ(drawn[0].token, expected.token) << "case " << c << " step " << step;
      EXPECT_FLOAT_EQ(drawn[0].logprob, expected.logprob) << "case " << c << " step " << step;
      const int32_t n = device.TopLogprobCount();
      EXPECT_EQ(static_cast<size_t>(n), expected.top.size()) << "case " << c;
      if (n > 0) {
        const int32_t chosen = drawn[0].token;
        std::vector<kernels::TokenLogit> top(static_cast<size_t>(n));
        float drawn_logit = 0;
        backend.TopLogitsRows(*logits, std::span<const int32_t>(&n, 1),
                              std::span<const int32_t>(&chosen, 1), top,
                              std::span<float>(&drawn_logit, 1));
        const std::vector<TokenLogprob> got = device.TopLogprobs(drawn[0], drawn_logit, top);
        ASSERT_EQ(got.size(), expected.top.size()) << "case " << c;
        for (size_t j = 0; j < got.size(); ++j) {
          EXPECT_EQ(got[j].token, expected.top[j].token) << "case " << c << " step " << step;
          EXPECT_EQ(got[j].logprob, expected.top[j].logprob) << "case " << c << " step " << step;
        }
      }
      history.AddOutput(expected.token);
    }
  }
}

// TopLogits: the n best by logit, ties to the lower id, whatever order they come in; NaN is
// never ranked, and ranks past the rankable logits get token -1.
// The penalties of a verify step's rows (one shared list, each row's drafted tokens) are those
// of the history with drafts[0, j) added as output, row by row: the same penalised bits, the two
// lists disjoint. Drafts: duplicates, negative, outside the vocabulary, seen in the prompt only,
// seen in the output, never seen; every penalty alone and together.
TEST(SamplerTest, VerifyPenaltiesAreTheHistoryWithTheDraftsBefore) {
  std::mt19937 gen(21);
  const int vocab = 40;
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  int listed_rows = 0;
  for (int trial = 0; trial < 300; ++trial) {
    SamplingParams params;
    params.repetition_penalty = trial % 4 == 0 ? 1.0f : 1.3f;
    params.frequency_penalty = trial % 4 == 1 ? 0.0f : 0.4f;
    params.presence_penalty = trial % 4 == 2 ? 0.0f : 0.7f;
    // Biases, and min_tokens whose ban ends within or after the drafts.
    if (trial % 3 == 1) params.logit_bias = {{3, 2.5f}, {11, -100.0f}};
    params.min_tokens = trial % 8;
    params.stop_token_ids = {9};
    const std::vector<int32_t> eos = {5};
    RequestSampler sampler(params, 1, eos);
    TokenHistory history;
    std::vector<int32_t> prompt(5);
    for (int32_t& t : prompt) t = token(gen);
    history.AddPrompt(prompt);
    for (int i = 0; i < trial % 6; ++i) history.AddOutput(token(gen));
    std::vector<int32_t> drafts(4);
    for (int32_t& x : drafts) x = token(gen);
    if (trial % 3 == 0) drafts[2] = drafts[0];
    if (trial % 5 == 0) drafts[1] = -1;
    if (trial % 7 == 0) drafts[3] = vocab + 2;
    if (trial % 2 == 0) drafts[0] = prompt[trial % 5];
    RequestSampler::VerifyPenaltyLists lists;
    const std::vector<kernels::LogitPenalties> rows =
        sampler.VerifyPenalties(history, drafts, lists);
    ASSERT_EQ(rows.size(), drafts.size() + 1);
    TokenHistory seen = history;
    for (size_t j = 0; j <= drafts.size(); ++j) {
      for (int32_t t : rows[j].tokens) {
        EXPECT_EQ(std::count(rows[j].shared_tokens.begin(), rows[j].shared_tokens.end(), t), 0)
            << "trial " << trial << " row " << j << " token " << t;
      }
      std::vector<float> logits(vocab);
      for (float& x : logits) x = normal(gen);
      std::vector<float> want = logits, got = logits;
      kernels::ApplyLogitPenalties(want, sampler.Penalties(seen));
      kernels::ApplyLogitPenalties(got, rows[j]);
      for (int t = 0; t < vocab; ++t) {
        EXPECT_EQ(std::bit_cast<uint32_t>(got[t]), std::bit_cast<uint32_t>(want[t]))
            << "trial " << trial << " row " << j << " token " << t;
      }
      listed_rows += !rows[j].tokens.empty();
      if (j < drafts.size()) seen.AddOutput(drafts[j]);
    }
  }
  EXPECT_GT(listed_rows, 300);
}

// logit_bias moves the tokens' logits after the penalties; min_tokens bans the stop tokens (EOS
// unless ignore_eos, and stop_token_ids) until the output is that long.
TEST(SamplerTest, LogitBiasAndMinTokens) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.5f};  // argmax 1, then 2
  SamplingParams p;
  p.temperature = 0;
  EXPECT_TRUE(RequestSampler(p, 1).ArgmaxOnly());
  p.logit_bias = {{0, 2.5f}};  // 3.5 beats 3.0
  EXPECT_FALSE(RequestSampler(p, 1).ArgmaxOnly());
  EXPECT_EQ(SampleOnce(p, logits).token, 0);
  p.logit_bias = {{1, -100.0f}};
  EXPECT_EQ(SampleOnce(p, logits).token, 2);

  p.logit_bias.clear();
  p.min_tokens = 2;
  p.stop_token_ids = {2};
  const std::vector<int32_t> eos = {1};
  RequestSampler sampler(p, 1, eos);
  EXPECT_FALSE(sampler.ArgmaxOnly());
  TokenHistory history;
  std::vector<float> row = logits;
  EXPECT_EQ(sampler.Sample(row, history).token, 0);  // 1 (EOS) and 2 (stop) banned
  EXPECT_EQ(row[1], -std::numeric_limits<float>::infinity());
  history.AddOutput(0);
  row = logits;
  EXPECT_EQ(sampler.Sample(row, history).token, 0);  // one output token: still banned
  history.AddOutput(0);
  row = logits;
  EXPECT_EQ(sampler.Sample(row, history).token, 1);  // two: the ban is over
  // ignore_eos: only the request's own stop tokens are banned.
  p.ignore_eos = true;
  RequestSampler no_eos(p, 1, eos);
  row = logits;
  EXPECT_EQ(no_eos.Sample(row, TokenHistory{}).token, 1);
  // Sampled draws never pick a banned token either.
  p.ignore_eos = false;
  p.temperature = 1.0f;
  RequestSampler sampled(p, 7, eos);
  for (int i = 0; i < 200; ++i) {
    row = logits;
    const int32_t t = sampled.Sample(row, TokenHistory{}).token;
    EXPECT_TRUE(t == 0 || t == 3) << t;
  }
}

// allowed_token_ids: every other token is -infinity, so neither greedy nor sampled draws leave
// the set; the logprobs are those of the restricted distribution.
TEST(SamplerTest, AllowedTokensRestrictTheDraw) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.5f};
  SamplingParams p;
  p.temperature = 0;
  p.allowed_token_ids = {3, 0, 3};  // unsorted, repeated
  p.logprobs = 0;
  RequestSampler greedy(p, 1);
  EXPECT_FALSE(greedy.ArgmaxOnly());
  std::vector<float> row = logits;
  const SampledToken t = greedy.Sample(row, TokenHistory{});
  EXPECT_EQ(t.token, 0);
  EXPECT_EQ(row[1], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(row[3], 0.5f);
  // log-softmax over {1.0, 0.5}
  EXPECT_NEAR(t.logprob, 1.0 - std::log(std::exp(1.0) + std::exp(0.5)), 1e-6);
  p.temperature = 1.0f;
  RequestSampler sampled(p, 9);
  int drawn[4] = {};
  for (int i = 0; i < 400; ++i) {
    row = logits;
    ++drawn[sampled.Sample(row, TokenHistory{}).token];
  }
  EXPECT_EQ(drawn[1] + drawn[2], 0);
  EXPECT_GT(drawn[0], drawn[3]);
  EXPECT_GT(drawn[3], 0);
}

// Structured output's per-step mask applies beside logit_bias and allowed_token_ids: a token
// must pass both, and the draws and logprobs are those of allowed_token_ids holding the
// intersection (the grammar allows 0, 1, 2, 3; with the ids, 0, 2, 3). Tokens past the mask's
// last word are not allowed.
TEST(SamplerTest, ConstrainedStepsDrawFromTheMaskAndTheAllowedIds) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.5f, 2.5f};
  SamplingParams p;
  p.logprobs = 2;
  p.logit_bias = {{4, 1.0f}};
  p.allowed_token_ids = {0, 2, 3, 4};
  SamplingParams intersection = p;
  intersection.allowed_token_ids = {0, 2, 3};
  p.structured_output.kind = grammar::StructuredOutputSpec::Kind::kJsonObject;
  for (float temperature : {0.0f, 1.0f}) {
    p.temperature = temperature;
    intersection.temperature = temperature;
    RequestSampler masked(p, 5), listed(intersection, 5);
    EXPECT_FALSE(masked.ArgmaxOnly());
    for (int i = 0; i < 50; ++i) {
      masked.ConstrainNext({0b01111});
      std::vector<float> a = logits, b = logits;
      const SampledToken x = masked.Sample(a, TokenHistory{});
      const SampledToken y = listed.Sample(b, TokenHistory{});
      ASSERT_EQ(x.token, y.token);
      EXPECT_TRUE(x.token == 0 || x.token == 2 || x.token == 3) << x.token;
      EXPECT_FLOAT_EQ(x.logprob, y.logprob);
      ASSERT_EQ(x.top.size(), y.top.size());
      for (size_t k = 0; k < x.top.size(); ++k) EXPECT_EQ(x.top[k].token, y.top[k].token);
      if (temperature == 0) {
        EXPECT_EQ(x.token, 2);  // 1 and 4 (the larger logits) are out
      }
    }
  }
  // A mask of one word over a 70-token row: tokens 64..69 are not allowed.
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.structured_output.kind = grammar::StructuredOutputSpec::Kind::kJsonObject;
  RequestSampler wide(greedy, 1);
  std::vector<float> row(70, 0.0f);
  row[66] = 5.0f;
  row[7] = 1.0f;
  wide.ConstrainNext({uint64_t{1} << 7 | uint64_t{1} << 9});
  EXPECT_EQ(wide.Sample(row, TokenHistory{}).token, 7);
  EXPECT_EQ(row[66], -std::numeric_limits<float>::infinity());
  // Before any mask, a constrained request's draw allows nothing (no silent "unrestricted").
  RequestSampler unmasked(greedy, 1);
  EXPECT_FALSE(unmasked.Penalties(TokenHistory{}).allowed_mask.empty());
}

// bad_words: a word's last token is banned where the output ends with the rest of it (a one-token
// word always), from the output only (not the prompt), and per row of a verify step as of the
// drafts before it.
TEST(SamplerTest, BadWordsBanTheirLastTokenAfterTheirPrefix) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.5f, 0.0f};  // argmax 1, then 2, 0
  SamplingParams p;
  p.temperature = 0;
  p.bad_words = {{4, 1}, {0, 2}, {3}};
  RequestSampler sampler(p, 1);
  EXPECT_FALSE(sampler.ArgmaxOnly());
  TokenHistory history;
  history.AddPrompt(std::vector<int32_t>{4});  // the prompt does not count
  std::vector<float> row = logits;
  EXPECT_EQ(sampler.Sample(row, history).token, 1);
  EXPECT_EQ(row[3], -std::numeric_limits<float>::infinity());  // one-token word: always
  EXPECT_EQ(row[2], 2.0f);
  history.AddOutput(4);  // "4 1" would complete: 1 banned
  row = logits;
  EXPECT_EQ(sampler.Sample(row, history).token, 2);
  history.AddOutput(0);  // "0 2" would complete: 2 banned, 1 free again
  row = logits;
  EXPECT_EQ(sampler.Sample(row, history).token, 1);
  row = logits;
  history.AddOutput(2);
  EXPECT_EQ(sampler.Sample(row, history).token, 1);

  // A verify step after output [4] with drafts [0, 2]: row 0 follows [4] (bans 1), row 1
  // follows [4, 0] (bans 2), row 2 follows [4, 0, 2] (bans only 3); every row bans 3.
  TokenHistory before;
  before.AddOutput(4);
  RequestSampler::VerifyPenaltyLists lists;
  const std::vector<int32_t> drafts = {0, 2};
  const std::vector<kernels::LogitPenalties> rows = sampler.VerifyPenalties(before, drafts, lists);
  ASSERT_EQ(rows.size(), 3u);
  const int expected_banned[3] = {1, 2, -1};
  for (size_t j = 0; j < rows.size(); ++j) {
    std::vector<float> r = logits;
    kernels::ApplyLogitPenalties(r, rows[j]);
    for (int v = 0; v < 5; ++v) {
      const bool banned = v == 3 || v == expected_banned[j];
      EXPECT_EQ(r[v] == -std::numeric_limits<float>::infinity(), banned) << "row " << j << " " << v;
    }
  }
  // The single-row penalties (the device path's) agree with what Sample applied.
  std::vector<float> r = logits;
  kernels::ApplyLogitPenalties(r, sampler.Penalties(before));
  EXPECT_EQ(r[1], -std::numeric_limits<float>::infinity());
}

TEST(SamplerTest, TopLogitsOrder) {
  const std::vector<float> logits = {1.0f, 3.0f, -INFINITY, 3.0f, 2.0f, 0.5f, 3.0f, NAN};
  std::vector<kernels::TokenLogit> top(5);
  kernels::TopLogits(logits, 5, top);
  const std::vector<int32_t> expected = {1, 3, 6, 4, 0};
  for (size_t j = 0; j < top.size(); ++j) {
    EXPECT_EQ(top[j].token, expected[j]) << j;
    EXPECT_EQ(top[j].logit, logits[expected[j]]) << j;
  }
  std::vector<kernels::TokenLogit> all(8);
  kernels::TopLogits(logits, 8, all);
  EXPECT_EQ(all[6].token, 2);   // -inf last of the rankable
  EXPECT_EQ(all[7].token, -1);  // NaN is not ranked
  // TopLogprobs stops at the first unranked entry.
  SamplingParams p;
  p.logprobs = 8;
  const RequestSampler sampler(p, 1);
  const kernels::DrawnToken drawn{1, -0.5f};
  const std::vector<TokenLogprob> logprobs = sampler.TopLogprobs(drawn, 3.0f, all);
  ASSERT_EQ(logprobs.size(), 7u);
  EXPECT_EQ(logprobs[0].token, 1);
  EXPECT_FLOAT_EQ(logprobs[0].logprob, -0.5f);
  EXPECT_FLOAT_EQ(logprobs[3].logprob, -0.5f + (2.0f - 3.0f));
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
  p = {};
  p.logit_bias = {{10, 1.0f}};
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("logit_bias names token 10"));
  p.logit_bias = {{3, 101.0f}};
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("logit_bias[3] = 101"));
  p = {};
  p.min_tokens = 17;
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("min_tokens"));
  p = {};
  p.allowed_token_ids = {1, 10};
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("allowed_token_ids[1] = 10"));
  p = {};
  p.bad_words = {{1}, {}};
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("bad_words[1] has 0 tokens"));
  p.bad_words = {{1, 12}};
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("bad_words[0] holds token 12"));
  p.bad_words.assign(kMaxBadWords + 1, {1});
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("bad_words has 129 entries"));
  p = {};
  p.prompt_logprobs = 21;
  EXPECT_THAT(p.Validate(10).message(), HasSubstr("prompt_logprobs"));
}

}  // namespace
}  // namespace mobius::worker
