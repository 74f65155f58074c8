// The engine against the reference fixtures: logits of a single forward, greedy generation with
// caches, ragged batches, and chunked prefill, on the fp32 CPU backend.
#include <algorithm>
#include <span>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/model/fixture_util.h"

namespace mobius::testing {
namespace {

using worker::ForwardOptions;
using worker::HybridModel;
using worker::LogitsMode;
using worker::SequenceCache;
using worker::SequenceStep;

constexpr double kTolerance = 1e-3;

int32_t Argmax(const float* row, int n) { return std::max_element(row, row + n) - row; }

class FixtureModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = FixtureModelDir(GetParam());
    backend_ = kernels::CreateCpuBackend(1);
    model_ = LoadFixtureModel(dir_, *backend_);
    ASSERT_NE(model_, nullptr);
    ref_ = LoadReference(dir_);
    ASSERT_EQ(ref_.prompts.size(), 4u);
    ASSERT_EQ(ref_.logits.size(), 4u);
    vocab_ = model_->config().vocab_size;
    ASSERT_TRUE(model_->CreateCaches(/*max_sequences=*/4, /*max_tokens=*/256).ok());
  }

  // Prefills `prompt` in chunks of `chunk` tokens, returning the logits of every position.
  std::vector<float> Prefill(SequenceCache& seq, const std::vector<int32_t>& prompt, size_t chunk,
                             ForwardOptions options = {}) {
    options.logits = LogitsMode::kAllTokens;
    std::vector<float> all, logits;
    for (size_t b = 0; b < prompt.size(); b += chunk) {
      SequenceStep step{std::span(prompt).subspan(b, std::min(chunk, prompt.size() - b)), &seq};
      absl::Status s = model_->Forward(std::span(&step, 1), options, logits);
      EXPECT_TRUE(s.ok()) << s;
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  }

  // Greedy continuation of `n` tokens after a prefill whose last logits row is `last`.
  std::vector<int32_t> Decode(SequenceCache& seq, const float* last, int n) {
    std::vector<int32_t> out;
    std::vector<float> logits;
    for (int i = 0; i < n; ++i) {
      out.push_back(Argmax(last, vocab_));
      if (i + 1 == n) break;
      SequenceStep step{std::span(&out.back(), 1), &seq};
      absl::Status s = model_->Forward(std::span(&step, 1), {}, logits);
      EXPECT_TRUE(s.ok()) << s;
      last = logits.data();
    }
    return out;
  }

  std::string dir_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<HybridModel> model_;
  ModelReference ref_;
  int vocab_ = 0;
};

TEST_P(FixtureModelTest, PromptLogitsMatchReference) {
  for (size_t p = 0; p < ref_.prompts.size(); ++p) {
    SequenceCache seq;
    ASSERT_TRUE(model_->StartSequence(seq).ok());
    std::vector<float> logits = Prefill(seq, ref_.prompts[p], ref_.prompts[p].size());
    ASSERT_EQ(logits.size(), ref_.logits[p].size());
    EXPECT_LT(RelativeError(logits.data(), ref_.logits[p].data(), logits.size()), kTolerance)
        << "prompt " << p;
    model_->ReleaseSequence(seq);
  }
}

TEST_P(FixtureModelTest, RecurrentPrefillMatchesReference) {
  ForwardOptions options;
  options.delta_rule = kernels::DeltaRuleAlgorithm::kRecurrent;
  const auto& prompt = ref_.prompts[3];
  SequenceCache seq;
  ASSERT_TRUE(model_->StartSequence(seq).ok());
  std::vector<float> logits = Prefill(seq, prompt, prompt.size(), options);
  EXPECT_LT(RelativeError(logits.data(), ref_.logits[3].data(), logits.size()), kTolerance);
}

TEST_P(FixtureModelTest, ChunkedPrefillOfFiveTokensMatchesReference) {
  for (size_t p = 0; p < ref_.prompts.size(); ++p) {
    SequenceCache seq;
    ASSERT_TRUE(model_->StartSequence(seq).ok());
    std::vector<float> logits = Prefill(seq, ref_.prompts[p], 5);
    ASSERT_EQ(logits.size(), ref_.logits[p].size());
    EXPECT_LT(RelativeError(logits.data(), ref_.logits[p].data(), logits.size()), kTolerance)
        << "prompt " << p;
    model_->ReleaseSequence(seq);
  }
}

TEST_P(FixtureModelTest, GreedyDecodeMatchesReference) {
  for (const auto& [index, expected] : ref_.greedy) {
    for (size_t chunk : {ref_.prompts[index].size(), size_t{5}}) {
      SequenceCache seq;
      ASSERT_TRUE(model_->StartSequence(seq).ok());
      std::vector<float> logits = Prefill(seq, ref_.prompts[index], chunk);
      std::vector<int32_t> tokens =
          Decode(seq, logits.data() + logits.size() - vocab_, static_cast<int>(expected.size()));
      EXPECT_EQ(tokens, expected) << "prompt " << index << ", prefill chunk " << chunk;
      model_->ReleaseSequence(seq);
    }
  }
}

// The three generation prompts run together: one ragged prefill step, then ragged decode steps
// with one token per sequence.
TEST_P(FixtureModelTest, RaggedBatchMatchesReference) {
  const size_t n = ref_.greedy.size();
  std::vector<SequenceCache> seqs(n);
  std::vector<SequenceStep> steps;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(model_->StartSequence(seqs[i]).ok());
    steps.push_back({ref_.prompts[ref_.greedy[i].first], &seqs[i]});
  }
  ForwardOptions all;
  all.logits = LogitsMode::kAllTokens;
  std::vector<float> logits;
  ASSERT_TRUE(model_->Forward(steps, all, logits).ok());

  std::vector<std::vector<int32_t>> generated(n);
  size_t row = 0;
  for (size_t i = 0; i < n; ++i) {
    const int p = ref_.greedy[i].first;
    const size_t len = ref_.prompts[p].size();
    EXPECT_LT(RelativeError(logits.data() + row * vocab_, ref_.logits[p].data(), len * vocab_),
              kTolerance)
        << "prompt " << p << " in a ragged batch";
    row += len;
    generated[i].push_back(Argmax(logits.data() + (row - 1) * vocab_, vocab_));
  }
  const size_t steps_to_run = ref_.greedy[0].second.size();
  for (size_t t = 1; t < steps_to_run; ++t) {
    steps.clear();
    for (size_t i = 0; i < n; ++i) {
      steps.push_back({std::span(&generated[i].back(), 1), &seqs[i]});
    }
    ASSERT_TRUE(model_->Forward(steps, {}, logits).ok());
    for (size_t i = 0; i < n; ++i) {
      generated[i].push_back(Argmax(logits.data() + i * vocab_, vocab_));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(generated[i], ref_.greedy[i].second) << "prompt " << ref_.greedy[i].first;
  }
}

// A mixed step: one sequence prefills a chunk while others decode.
TEST_P(FixtureModelTest, MixedPrefillAndDecodeStepMatchesReference) {
  const auto& [p0, expected0] = ref_.greedy[0];
  const auto& [p2, expected2] = ref_.greedy[2];
  SequenceCache a, b;
  ASSERT_TRUE(model_->StartSequence(a).ok());
  ASSERT_TRUE(model_->StartSequence(b).ok());
  std::vector<float> logits = Prefill(a, ref_.prompts[p0], ref_.prompts[p0].size());
  std::vector<int32_t> gen_a = {Argmax(logits.data() + logits.size() - vocab_, vocab_)};
  // b prefills in chunks of 7 while a decodes one token per step.
  const auto& prompt_b = ref_.prompts[p2];
  std::vector<float> b_logits;
  for (size_t begin = 0; begin < prompt_b.size(); begin += 7) {
    std::vector<SequenceStep> steps = {
        {std::span(&gen_a.back(), 1), &a},
        {std::span(prompt_b).subspan(begin, std::min<size_t>(7, prompt_b.size() - begin)), &b}};
    ASSERT_TRUE(model_->Forward(steps, {}, logits).ok());
    gen_a.push_back(Argmax(logits.data(), vocab_));
    b_logits.assign(logits.begin() + vocab_, logits.end());
  }
  std::vector<int32_t> gen_b = Decode(b, b_logits.data(), static_cast<int>(expected2.size()));
  EXPECT_EQ(gen_b, expected2);
  const size_t k = std::min(gen_a.size(), expected0.size());
  EXPECT_EQ(std::vector<int32_t>(gen_a.begin(), gen_a.begin() + k),
            std::vector<int32_t>(expected0.begin(), expected0.begin() + k));
}

TEST_P(FixtureModelTest, ExpertCountsOfTheWrongLayerCountAreRejected) {
  SequenceCache seq;
  ASSERT_TRUE(model_->StartSequence(seq).ok());
  std::vector<int32_t> tokens = {1, 2};
  SequenceStep step{tokens, &seq};
  std::vector<std::vector<int64_t>> expert_tokens;  // empty: the caller forgot to size it
  ForwardOptions options;
  options.expert_tokens = &expert_tokens;
  std::vector<float> logits;
  absl::Status s = model_->Forward(std::span(&step, 1), options, logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("expert_tokens has 0 layers"), std::string_view::npos) << s;
  EXPECT_EQ(seq.num_tokens, 0);
  expert_tokens.resize(model_->config().num_hidden_layers);
  ASSERT_TRUE(model_->Forward(std::span(&step, 1), options, logits).ok());
  EXPECT_EQ(seq.num_tokens, 2);
}

TEST_P(FixtureModelTest, SequenceTwiceInOneStepIsRejectedWithoutChangingState) {
  SequenceCache seq, other;
  ASSERT_TRUE(model_->StartSequence(seq).ok());
  ASSERT_TRUE(model_->StartSequence(other).ok());
  std::vector<int32_t> first = {1, 2}, second = {3};
  std::vector<SequenceStep> steps = {{first, &seq}, {second, &other}, {second, &seq}};
  std::vector<float> logits;
  absl::Status s = model_->Forward(steps, {}, logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("sequences 0 and 2 share state slot"), std::string_view::npos) << s;
  EXPECT_EQ(seq.num_tokens, 0);
  EXPECT_EQ(other.num_tokens, 0);
  // Each once: accepted, with the logits of the same step on fresh sequences (so the rejected
  // call changed no state).
  steps.pop_back();
  ASSERT_TRUE(model_->Forward(steps, {}, logits).ok());
  EXPECT_EQ(seq.num_tokens, 2);
  SequenceCache fresh, fresh_other;
  ASSERT_TRUE(model_->StartSequence(fresh).ok());
  ASSERT_TRUE(model_->StartSequence(fresh_other).ok());
  std::vector<SequenceStep> fresh_steps = {{first, &fresh}, {second, &fresh_other}};
  std::vector<float> fresh_logits;
  ASSERT_TRUE(model_->Forward(fresh_steps, {}, fresh_logits).ok());
  EXPECT_EQ(logits, fresh_logits);
}

// A step that writes its DeltaNet states to another slot (SequenceStep::state_out_slot, as a
// speculative verify step does) gives the in-place step's logits, leaves the states there that
// the in-place step would have left, and keeps its own slot as it was before the step.
TEST_P(FixtureModelTest, StepWritesStatesToItsOutSlot) {
  HybridModel& model = *model_;
  const std::vector<int32_t>& prompt = ref_.prompts[3];
  ASSERT_GE(prompt.size(), 20u);
  const auto head = std::span(prompt).first(10), verify = std::span(prompt).subspan(10, 5),
             rest = std::span(prompt).subspan(15);
  ForwardOptions all;
  all.logits = LogitsMode::kAllTokens;
  auto run = [&](SequenceStep step, std::vector<float>& logits) {
    absl::Status s = model.Forward(std::span(&step, 1), all, logits);
    EXPECT_TRUE(s.ok()) << s;
  };
  // In place, chunk by chunk.
  SequenceCache plain;
  ASSERT_TRUE(model.StartSequence(plain).ok());
  std::vector<float> plain_head, plain_verify, plain_rest;
  run({head, &plain}, plain_head);
  run({verify, &plain}, plain_verify);
  run({rest, &plain}, plain_rest);

  SequenceCache seq, spare;
  ASSERT_TRUE(model.StartSequence(seq).ok());
  ASSERT_TRUE(model.StartSequence(spare).ok());
  std::vector<float> logits;
  run({head, &seq}, logits);
  run({verify, &seq, spare.state_slot}, logits);
  EXPECT_EQ(logits, plain_verify);
  EXPECT_EQ(seq.num_tokens, 15);
  // The step only read seq's own slot: run there again, it gives the same logits.
  seq.num_tokens = 10;
  run({verify, &seq}, logits);
  EXPECT_EQ(logits, plain_verify);
  // Now seq's slot was advanced in place too; the spare slot holds the same states, so the rest
  // of the prompt continues from either.
  std::swap(seq.state_slot, spare.state_slot);
  run({rest, &seq}, logits);
  EXPECT_EQ(logits, plain_rest);
  for (SequenceCache* c : {&plain, &seq, &spare}) model.ReleaseSequence(*c);
}

TEST_P(FixtureModelTest, OutSlotsThatCollideAreRejectedWithoutChangingState) {
  SequenceCache seq, other, spare;
  ASSERT_TRUE(model_->StartSequence(seq).ok());
  ASSERT_TRUE(model_->StartSequence(other).ok());
  ASSERT_TRUE(model_->StartSequence(spare).ok());
  std::vector<int32_t> first = {1, 2}, second = {3};
  std::vector<float> logits;
  auto rejected = [&](std::vector<SequenceStep> steps, const std::string& message) {
    absl::Status s = model_->Forward(steps, {}, logits);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(message), std::string_view::npos) << s;
    EXPECT_EQ(seq.num_tokens, 0);
    EXPECT_EQ(other.num_tokens, 0);
  };
  const int slots = model_->state_slots()->num_slots();
  rejected({{first, &seq, slots}},
           absl::StrFormat("state_out_slot %d outside the %d state slots", slots, slots));
  rejected({{first, &seq, other.state_slot}, {second, &other}},
           absl::StrFormat("sequence 0: state_out_slot %d is also used by sequence 1",
                           other.state_slot));
  rejected({{first, &seq, spare.state_slot}, {second, &other, spare.state_slot}},
           absl::StrFormat("sequence 1: state_out_slot %d is also used by sequence 0",
                           spare.state_slot));
  // Its own slot is in place.
  std::vector<SequenceStep> own = {{first, &seq, seq.state_slot}};
  ASSERT_TRUE(model_->Forward(own, {}, logits).ok());
  EXPECT_EQ(seq.num_tokens, 2);
}

TEST_P(FixtureModelTest, TokenOutsideVocabularyIsRejectedWithoutChangingState) {
  SequenceCache seq;
  ASSERT_TRUE(model_->StartSequence(seq).ok());
  std::vector<int32_t> bad = {1, vocab_, 2};
  SequenceStep step{bad, &seq};
  std::vector<float> logits;
  absl::Status s = model_->Forward(std::span(&step, 1), {}, logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(std::to_string(vocab_)), std::string_view::npos) << s;
  EXPECT_EQ(seq.num_tokens, 0);
  std::vector<int32_t> negative = {-1};
  step.tokens = negative;
  EXPECT_EQ(model_->Forward(std::span(&step, 1), {}, logits).code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureModelTest, ::testing::ValuesIn(kFixtureModels),
                         FixtureParamName);

}  // namespace
}  // namespace mobius::testing
