#include "worker/runtime/speculative_decoder.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/model/fixture_util.h"
#include "worker/runtime/mtp_drafter.h"
#include "worker/runtime/sampler.h"

namespace mobius::worker {
namespace {

constexpr int kNewTokens = 20;

// Proposes the target's own greedy continuation (known in advance), except that draft position
// `wrong_at` (if >= 0) is replaced by a different token, so that acceptance stops there.
class OracleDrafter : public Drafter {
 public:
  OracleDrafter(std::vector<std::vector<int32_t>> prompts,
                std::vector<std::vector<int32_t>> continuations, int wrong_at, int vocab)
      : prompts_(std::move(prompts)),
        continuations_(std::move(continuations)),
        wrong_at_(wrong_at),
        vocab_(vocab) {}
  absl::Status Draft(std::span<const DraftRequest> requests,
                     std::vector<std::vector<int32_t>>& drafts) override {
    drafts.assign(requests.size(), {});
    for (size_t r = 0; r < requests.size(); ++r) {
      const DraftRequest& q = requests[r];
      const std::vector<int32_t>& c = continuations_[q.sequence];
      // Generated tokens so far, including the pending one.
      const size_t generated = q.context.size() - prompts_[q.sequence].size();
      for (int p = 0; p < q.k && generated + p < c.size(); ++p) {
        const int32_t t = c[generated + p];
        drafts[r].push_back(p == wrong_at_ ? (t + 1) % vocab_ : t);
      }
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<std::vector<int32_t>> continuations_;
  int wrong_at_;
  int vocab_;
};

// Proposes tokens the target almost never chooses: every step rolls back.
class WrongDrafter : public Drafter {
 public:
  explicit WrongDrafter(int vocab) : vocab_(vocab) {}
  absl::Status Draft(std::span<const DraftRequest> requests,
                     std::vector<std::vector<int32_t>>& drafts) override {
    drafts.assign(requests.size(), {});
    for (size_t r = 0; r < requests.size(); ++r) {
      for (int p = 0; p < requests[r].k; ++p) {
        drafts[r].push_back((requests[r].context.back() + 7 * (p + 1)) % vocab_);
      }
    }
    return absl::OkStatus();
  }

 private:
  int vocab_;
};

class SpeculativeDecoderTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string dir = testing::FixtureModelDir(GetParam());
    backend_ = kernels::CreateCpuBackend(1);
    model_ = testing::LoadFixtureModel(dir, *backend_);
    ASSERT_NE(model_, nullptr);
    ASSERT_TRUE(model_->CreateCaches(16, 256, /*block_size=*/4).ok());
    const testing::ModelReference ref = testing::LoadReference(dir);
    ASSERT_FALSE(ref.prompts.empty());
    prompts_ = ref.prompts;
    vocab_ = model_->config().vocab_size;
    // The plain greedy outputs (no drafts) are the reference every speculative run must match.
    WrongDrafter unused(vocab_);
    SpeculativeDecoder plain(*model_, unused);
    ASSERT_TRUE(plain.Generate(Requests(0), expected_).ok());
    ASSERT_EQ(plain.stats().verify_steps, 0);
  }

  std::vector<SpeculativeRequest> Requests(int spec_tokens, bool mixed = false) const {
    std::vector<SpeculativeRequest> r;
    for (size_t i = 0; i < prompts_.size(); ++i) {
      const bool speculate = !mixed || i % 2 == 0;
      SpeculativeRequest request;
      request.prompt = prompts_[i];
      request.max_new_tokens = kNewTokens;
      request.spec_tokens = speculate ? spec_tokens : 0;
      r.push_back(std::move(request));
    }
    return r;
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<HybridModel> model_;
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<std::vector<int32_t>> expected_;
  int vocab_ = 0;
};

TEST_P(SpeculativeDecoderTest, RejectedDraftsRollBackExactly) {
  for (int k = 1; k <= 4; ++k) {
    WrongDrafter drafter(vocab_);
    SpeculativeDecoder spec(*model_, drafter);
    std::vector<std::vector<int32_t>> out;
    ASSERT_TRUE(spec.Generate(Requests(k), out).ok());
    EXPECT_EQ(out, expected_) << "k=" << k;
    EXPECT_GT(spec.stats().rollback_steps, 0) << "k=" << k;
    EXPECT_EQ(model_->state_slots()->free_slots(), 16);
  }
}

TEST_P(SpeculativeDecoderTest, AcceptedDraftsEmitSeveralTokensPerStep) {
  for (int k = 1; k <= 4; ++k) {
    OracleDrafter drafter(prompts_, expected_, /*wrong_at=*/-1, vocab_);
    SpeculativeDecoder spec(*model_, drafter);
    std::vector<std::vector<int32_t>> out;
    ASSERT_TRUE(spec.Generate(Requests(k), out).ok());
    EXPECT_EQ(out, expected_) << "k=" << k;
    EXPECT_EQ(spec.stats().rollback_steps, 0) << "k=" << k;
    EXPECT_DOUBLE_EQ(spec.stats().AcceptanceRate(0), 1.0) << "k=" << k;
    EXPECT_GT(spec.stats().MeanAcceptedLength(), 1.0 + 0.5 * k) << "k=" << k;
  }
}

TEST_P(SpeculativeDecoderTest, PartialAcceptanceRollsBackToTheLastAcceptedToken) {
  const int k = 4;
  for (int wrong_at = 0; wrong_at < k; ++wrong_at) {
    OracleDrafter drafter(prompts_, expected_, wrong_at, vocab_);
    SpeculativeDecoder spec(*model_, drafter);
    std::vector<std::vector<int32_t>> out;
    ASSERT_TRUE(spec.Generate(Requests(k), out).ok());
    EXPECT_EQ(out, expected_) << "wrong_at=" << wrong_at;
    EXPECT_GT(spec.stats().rollback_steps, 0);
    EXPECT_EQ(spec.stats().accepted[wrong_at], 0) << "wrong_at=" << wrong_at;
    if (wrong_at > 0) {
      EXPECT_DOUBLE_EQ(spec.stats().AcceptanceRate(0), 1.0);
    }
  }
}

TEST_P(SpeculativeDecoderTest, MixedBatchOfSpeculatingAndPlainSequences) {
  OracleDrafter drafter(prompts_, expected_, /*wrong_at=*/2, vocab_);
  SpeculativeDecoder spec(*model_, drafter);
  std::vector<std::vector<int32_t>> out;
  ASSERT_TRUE(spec.Generate(Requests(3, /*mixed=*/true), out).ok());
  EXPECT_EQ(out, expected_);
  EXPECT_GT(spec.stats().verify_steps, 0);
}

// The MTP head's h_prev: ForwardOptions::hidden_out holds the rows the logits are made from.
TEST_P(SpeculativeDecoderTest, HiddenOutIsWhatTheLogitsComeFrom) {
  for (LogitsMode mode : {LogitsMode::kAllTokens, LogitsMode::kLastToken}) {
    SequenceCache cache;
    ASSERT_TRUE(model_->StartSequence(cache).ok());
    std::vector<SequenceStep> batch = {{prompts_[0], &cache}};
    std::vector<float> logits, hidden;
    ForwardOptions options;
    options.logits = mode;
    options.hidden_out = &hidden;
    ASSERT_TRUE(model_->Forward(batch, options, logits).ok());
    model_->ReleaseSequence(cache);
    const int64_t H = model_->config().hidden_size;
    const int64_t rows = mode == LogitsMode::kAllTokens ? prompts_[0].size() : 1;
    ASSERT_EQ(hidden.size(), static_cast<size_t>(rows * H));
    ASSERT_EQ(logits.size(), static_cast<size_t>(rows * vocab_));
    const kernels::Tensor& lm_head = model_->weights().lm_head;
    std::vector<float> w(static_cast<size_t>(lm_head.numel()));
    backend_->CopyToHostF32(lm_head, w.data());
    std::vector<float> recomputed(logits.size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t v = 0; v < vocab_; ++v) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) acc += double{hidden[r * H + h]} * w[v * H + h];
        recomputed[r * vocab_ + v] = static_cast<float>(acc);
      }
    }
    EXPECT_LT(testing::RelativeError(recomputed.data(), logits.data(), logits.size()), 1e-4);
  }
}

// The MTP head drafts (random mtp.* weights in the fixture: most drafts are rejected, so rollback
// runs nearly every step) and greedy outputs stay those of plain decoding, alone and in a batch
// where only some requests speculate.
TEST_P(SpeculativeDecoderTest, MtpDraftsKeepGreedyOutputsIdentical) {
  if (!model_->weights().mtp.has_value()) {
    // qwen3next-tiny has no mtp.* tensors: the drafter says so instead of running without them.
    absl::StatusOr<std::unique_ptr<MtpDrafter>> none = MtpDrafter::Create(*model_, 16, 256);
    EXPECT_TRUE(absl::IsFailedPrecondition(none.status())) << none.status();
    return;
  }
  for (int k = 1; k <= 4; ++k) {
    for (bool mixed : {false, true}) {
      absl::StatusOr<std::unique_ptr<MtpDrafter>> drafter = MtpDrafter::Create(*model_, 16, 256);
      ASSERT_TRUE(drafter.ok()) << drafter.status();
      SpeculativeDecoder spec(*model_, **drafter);
      std::vector<std::vector<int32_t>> out;
      ASSERT_TRUE(spec.Generate(Requests(k, mixed), out).ok());
      EXPECT_EQ(out, expected_) << "k=" << k << " mixed=" << mixed;
      EXPECT_GT(spec.stats().verify_steps, 0);
      EXPECT_GT(spec.stats().proposed[k - 1], 0);
      EXPECT_EQ(model_->state_slots()->free_slots(), 16);
      EXPECT_EQ((*drafter)->head().state_slots()->free_slots(), 16) << "head sequences leaked";
      std::printf("[mtp] %s k=%d mixed=%d: acceptance %.3f, mean accepted length %.3f\n",
                  GetParam().c_str(), k, mixed, spec.stats().AcceptanceRate(0),
                  spec.stats().MeanAcceptedLength());
    }
  }
}

// The head's cache: a prompt observed in one step or position by position gives the same first
// draft and output, and drafting leaves the head where it was (drafting twice gives the same).
TEST_P(SpeculativeDecoderTest, MtpHeadCacheIsPositionExact) {
  if (!model_->weights().mtp.has_value()) GTEST_SKIP() << "no mtp.* tensors in this fixture";
  const std::vector<int32_t>& prompt = prompts_[2];
  const std::vector<float> hidden = testing::PromptHiddenStates(*model_, prompt);
  const int64_t H = model_->config().hidden_size;
  ASSERT_EQ(hidden.size(), prompt.size() * H);
  const int32_t next = 5;

  auto one_step = MtpDrafter::Create(*model_, 2, 64);
  auto stepwise = MtpDrafter::Create(*model_, 2, 64);
  ASSERT_TRUE(one_step.ok() && stepwise.ok());
  const TargetStep whole{0, 0, prompt, hidden, next};
  ASSERT_TRUE((*one_step)->Observe(std::span(&whole, 1)).ok());
  for (size_t p = 0; p < prompt.size(); ++p) {
    const int32_t after = p + 1 < prompt.size() ? prompt[p + 1] : next;
    const TargetStep single{0, static_cast<int>(p), std::span(prompt).subspan(p, 1),
                            std::span<const float>(hidden).subspan(p * H, H), after};
    ASSERT_TRUE((*stepwise)->Observe(std::span(&single, 1)).ok());
  }
  std::vector<int32_t> context = prompt;
  context.push_back(next);
  const DraftRequest request{0, context, 4};
  std::vector<std::vector<int32_t>> a, b, again;
  ASSERT_TRUE((*one_step)->Draft(std::span(&request, 1), a).ok());
  ASSERT_TRUE((*stepwise)->Draft(std::span(&request, 1), b).ok());
  ASSERT_TRUE((*one_step)->Draft(std::span(&request, 1), again).ok());
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].size(), 4u);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, again);
}

// A draft vocabulary (--spec-token-map) restricts drafts to its tokens and never changes
// outputs: a map that holds the whole-vocabulary drafts gives those drafts (the argmax over a
// subset holding the overall argmax is the same token, step after chained step), a map without
// them gives other drafts from the map, and greedy generation is identical either way.
TEST_P(SpeculativeDecoderTest, DraftVocabularyRestrictsDraftsNotOutputs) {
  if (!model_->weights().mtp.has_value()) GTEST_SKIP() << "no mtp.* tensors in this fixture";
  const std::vector<int32_t>& prompt = prompts_[2];
  const std::vector<float> hidden = testing::PromptHiddenStates(*model_, prompt);
  const int32_t next = 5;
  std::vector<int32_t> context = prompt;
  context.push_back(next);
  auto drafts_with = [&](DraftVocabulary vocabulary) {
    std::vector<std::vector<int32_t>> drafts;
    auto drafter = MtpDrafter::Create(*model_, 2, 64, std::move(vocabulary));
    EXPECT_TRUE(drafter.ok()) << drafter.status();
    if (!drafter.ok()) return std::vector<int32_t>();
    const TargetStep whole{0, 0, prompt, hidden, next};
    EXPECT_TRUE((*drafter)->Observe(std::span(&whole, 1)).ok());
    const DraftRequest request{0, context, 4};
    EXPECT_TRUE((*drafter)->Draft(std::span(&request, 1), drafts).ok());
    return drafts.size() == 1 ? drafts[0] : std::vector<int32_t>();
  };
  auto parse = [&](const std::vector<int32_t>& ids) {
    std::string text;
    for (int32_t id : ids) text += std::to_string(id) + "\n";
    auto v = DraftVocabulary::Parse(text, vocab_, "test map");
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *std::move(v) : DraftVocabulary();
  };
  const std::vector<int32_t> whole = drafts_with(DraftVocabulary());
  ASSERT_EQ(whole.size(), 4u);

  std::vector<int32_t> every(vocab_);
  for (int i = 0; i < vocab_; ++i) every[i] = vocab_ - 1 - i;  // listed in reverse: sorted
  EXPECT_EQ(drafts_with(parse(every)), whole);

  std::vector<int32_t> holding(whole.begin(), whole.end());
  for (int i = 1; i < vocab_; i += 3) {
    if (std::find(holding.begin(), holding.end(), i) == holding.end()) holding.push_back(i);
  }
  ASSERT_LT(static_cast<int>(holding.size()), vocab_);
  EXPECT_EQ(drafts_with(parse(holding)), whole);

  std::vector<int32_t> lacking;
  for (int i = 0; i < vocab_; ++i) {
    if (std::find(whole.begin(), whole.end(), i) == whole.end() && i % 2 == 0) lacking.push_back(i);
  }
  const std::vector<int32_t> restricted = drafts_with(parse(lacking));
  ASSERT_EQ(restricted.size(), 4u);
  for (int32_t t : restricted) {
    EXPECT_TRUE(std::find(lacking.begin(), lacking.end(), t) != lacking.end())
        << "draft " << t << " is not in the map";
  }

  for (const auto* ids : {&holding, &lacking}) {
    auto drafter = MtpDrafter::Create(*model_, 16, 256, parse(*ids));
    ASSERT_TRUE(drafter.ok()) << drafter.status();
    SpeculativeDecoder spec(*model_, **drafter);
    std::vector<std::vector<int32_t>> out;
    ASSERT_TRUE(spec.Generate(Requests(4), out).ok());
    EXPECT_EQ(out, expected_) << (ids == &holding ? "holding" : "lacking");
    EXPECT_GT(spec.stats().verify_steps, 0);
  }
}

// Sampling stays exact: the joint distribution of the first two sampled tokens (t1 from the
// prefill, t2 from the first verify step) with speculation matches the target's, p(t1) p(t2|t1)
// computed by plain forwards. The drafter proposes the target's likeliest t2, so drafts are
// accepted often and rejected often (both branches of the rule run).
TEST_P(SpeculativeDecoderTest, SampledTokensFollowTheTargetDistribution) {
  model_->DropCaches();
  constexpr int kBatch = 300, kTrials = 3000;
  ASSERT_TRUE(model_->CreateCaches(2 * kBatch, 16, /*block_size=*/4).ok());
  SamplingParams params;
  params.temperature = 1.0f;
  params.top_k = 4;
  const std::vector<int32_t>& prompt = prompts_[0];  // one token: cheap prefills
  auto target = [&](const std::vector<int32_t>& tokens) {
    SequenceCache cache;
    EXPECT_TRUE(model_->StartSequence(cache).ok());
    std::vector<SequenceStep> batch = {{tokens, &cache}};
    std::vector<float> logits;
    EXPECT_TRUE(model_->Forward(batch, ForwardOptions{}, logits).ok());
    model_->ReleaseSequence(cache);
    return RequestSampler(params, 0).Distribution(logits, TokenHistory{});
  };
  const std::vector<double> p1 = target(prompt);
  std::map<int32_t, std::vector<double>> p2;
  std::map<int32_t, int32_t> likeliest;
  for (int32_t t = 0; t < vocab_; ++t) {
    if (p1[t] == 0) continue;
    std::vector<int32_t> tokens = prompt;
    tokens.push_back(t);
    p2[t] = target(tokens);
    likeliest[t] =
        static_cast<int32_t>(std::max_element(p2[t].begin(), p2[t].end()) - p2[t].begin());
  }
  ASSERT_EQ(p2.size(), 4u);

  class LikeliestDrafter : public Drafter {
   public:
    explicit LikeliestDrafter(const std::map<int32_t, int32_t>& m) : m_(m) {}
    absl::Status Draft(std::span<const DraftRequest> requests,
                       std::vector<std::vector<int32_t>>& drafts) override {
      drafts.assign(requests.size(), {});
      for (size_t r = 0; r < requests.size(); ++r) {
        auto it = m_.find(requests[r].context.back());
        const int32_t d = it == m_.end() ? 0 : it->second;
        drafts[r].assign(requests[r].k, d);
      }
      return absl::OkStatus();
    }

   private:
    const std::map<int32_t, int32_t>& m_;
  };
  // Chi-square critical values at p = 0.001 for 1..20 degrees of freedom.
  constexpr double kCritical[] = {10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32,
                                  26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12,
                                  37.70, 39.25, 40.79, 42.31, 43.82, 45.31};
  // k = 0 (plain sampling) checks the test's own expectation; each k draws its own seeds.
  for (int k : {0, 1, 2}) {
    LikeliestDrafter drafter(likeliest);
    SpeculativeDecoder spec(*model_, drafter);
    std::map<std::pair<int32_t, int32_t>, int> counts;
    for (int first = 0; first < kTrials; first += kBatch) {
      std::vector<SpeculativeRequest> requests(kBatch);
      for (int r = 0; r < kBatch; ++r) {
        requests[r].prompt = prompt;
        requests[r].max_new_tokens = 2 + k;  // room for k drafts after t1 (no more steps)
        requests[r].spec_tokens = k;
        requests[r].params = params;
        requests[r].seed = static_cast<uint64_t>(k * 1000003 + first + r + 1);
      }
      std::vector<std::vector<int32_t>> out;
      ASSERT_TRUE(spec.Generate(requests, out).ok());
      for (const auto& o : out) ++counts[{o[0], o[1]}];
    }
    double chi2 = 0;
    int cells = 0;
    for (const auto& [t1, dist] : p2) {
      for (int32_t t2 = 0; t2 < vocab_; ++t2) {
        const double expected = kTrials * p1[t1] * dist[t2];
        const int observed = counts.count({t1, t2}) ? counts[{t1, t2}] : 0;
        if (expected == 0) {
          EXPECT_EQ(observed, 0) << "t1=" << t1 << " t2=" << t2 << " is outside the target";
          continue;
        }
        ++cells;
        chi2 += (observed - expected) * (observed - expected) / expected;
      }
    }
    ASSERT_GE(cells, 2);
    ASSERT_LE(cells - 1, 20);
    const double rate = spec.stats().AcceptanceRate(0);
    std::printf(
        "[spec sampling] %s k=%d: chi-square %.2f over %d cells (critical %.2f), "
        "first-draft acceptance %.3f\n",
        GetParam().c_str(), k, chi2, cells, kCritical[cells - 2], rate);
    EXPECT_LT(chi2, kCritical[cells - 2]) << "k=" << k;
    if (k > 0) {
      EXPECT_GT(rate, 0.05) << "drafts should be accepted sometimes";
      EXPECT_LT(rate, 0.95) << "drafts should be rejected sometimes";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SpeculativeDecoderTest,
                         ::testing::ValuesIn(testing::kFixtureModels), testing::FixtureParamName);

}  // namespace
}  // namespace mobius::worker
