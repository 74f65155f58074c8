#include "worker/runtime/speculative_decoder.h"

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/model/fixture_util.h"

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
  std::vector<int32_t> Draft(int sequence, std::span<const int32_t> context, int k) override {
    const std::vector<int32_t>& c = continuations_[sequence];
    const size_t generated = context.size() - prompts_[sequence].size();  // incl. the pending one
    std::vector<int32_t> d;
    for (int p = 0; p < k && generated + p < c.size(); ++p) {
      const int32_t t = c[generated + p];
      d.push_back(p == wrong_at_ ? (t + 1) % vocab_ : t);
    }
    return d;
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
  std::vector<int32_t> Draft(int, std::span<const int32_t> context, int k) override {
    std::vector<int32_t> d;
    for (int p = 0; p < k; ++p) d.push_back((context.back() + 7 * (p + 1)) % vocab_);
    return d;
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
      r.push_back({prompts_[i], kNewTokens, speculate ? spec_tokens : 0});
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
    EXPECT_GT(spec.stats().recompute_steps, 0) << "k=" << k;
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
    EXPECT_EQ(spec.stats().recompute_steps, 0) << "k=" << k;
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
    EXPECT_GT(spec.stats().recompute_steps, 0);
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

INSTANTIATE_TEST_SUITE_P(Fixtures, SpeculativeDecoderTest,
                         ::testing::ValuesIn(testing::kFixtureModels), testing::FixtureParamName);

}  // namespace
}  // namespace mobius::worker
