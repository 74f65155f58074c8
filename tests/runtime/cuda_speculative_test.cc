// Speculative decoding on the CUDA backend (bf16): greedy outputs with the MTP head's drafts are
// the outputs without them, for the decoder alone and inside the engine's continuous batching,
// with every draft rejected (the fixture's random head) and with every draft accepted (drafts
// copied from the plain run). Skipped without a GPU.
//
// "The same" in bf16 means: the same tokens until the two runs part at a position where the
// plain run's choice is a near-tie: a top-2 logit gap under 1e-1 of the largest logit, the size
// of this backend's own bf16 error on these fixtures (cuda_fixture_test: 7.9e-2 relative for a
// one-token prompt of intern-s2-mobius-tiny against the fp32 reference; the README's 2e-2 is
// not met by bf16 here, nor by Hugging Face's bf16 run). After that their contexts differ. The
// verify step runs a sequence's k
// + 1 tokens through the multi-token kernels (chunked delta rule, prefill attention, GEMMs of more
// rows) where plain decoding runs one token; in bf16 those round differently, and the random tiny
// fixtures have near-ties that flip under such differences. Plain decoding alone does the same: the
// whole-prompt prefill of the decoder and the engine's 16-token prefill chunks already disagree on
// one fixture prompt (seen on the H200). Bit-identical outputs need batch-invariant kernels.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/model/fixture_util.h"
#include "worker/runtime/engine.h"
#include "worker/runtime/mtp_drafter.h"
#include "worker/runtime/speculative_decoder.h"

namespace mobius::worker {
namespace {

constexpr int kNewTokens = 20;
constexpr float kNearTie = 1e-1f;  // see the file comment

// GPU hosts often lack a debugger: a crash prints its stack (symbolized when not stripped).
const bool kCrashStacks = [] {
  absl::InitializeSymbolizer("/proc/self/exe");
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions());
  return true;
}();

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Proposes the plain run's own continuation: every draft is accepted when the verify step
// computes what plain decoding computed.
class CopyDrafter : public Drafter {
 public:
  CopyDrafter(const std::vector<std::vector<int32_t>>& prompts,
              const std::vector<std::vector<int32_t>>& outputs)
      : prompts_(prompts), outputs_(outputs) {}
  absl::Status Draft(std::span<const DraftRequest> requests,
                     std::vector<std::vector<int32_t>>& drafts) override {
    drafts.assign(requests.size(), {});
    for (size_t r = 0; r < requests.size(); ++r) {
      const DraftRequest& q = requests[r];
      for (size_t p = 0; p < prompts_.size(); ++p) {
        if (q.context.size() <= prompts_[p].size() ||
            !std::equal(prompts_[p].begin(), prompts_[p].end(), q.context.begin())) {
          continue;
        }
        const size_t generated = q.context.size() - prompts_[p].size();
        for (int j = 0; j < q.k && generated + j < outputs_[p].size(); ++j) {
          drafts[r].push_back(outputs_[p][generated + j]);
        }
        break;
      }
    }
    return absl::OkStatus();
  }

 private:
  const std::vector<std::vector<int32_t>>& prompts_;
  const std::vector<std::vector<int32_t>>& outputs_;
};

class CudaSpeculativeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    auto backend = kernels::CreateCudaBackend(0);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    const std::string dir = testing::FixtureModelDir("intern-s2-mobius-tiny");
    model_ = testing::LoadFixtureModel(dir, *backend_);
    ASSERT_NE(model_, nullptr);
    prompts_ = testing::LoadReference(dir).prompts;
  }
  // The plain run's top-2 logit gap at each of its tokens, relative to the largest |logit| there
  // (logits from one forward over prompt i + plain).
  std::vector<float> RelativeGaps(size_t i, const std::vector<int32_t>& plain) {
    std::vector<int32_t> tokens = prompts_[i];
    tokens.insert(tokens.end(), plain.begin(), plain.end());
    SequenceCache cache;
    EXPECT_TRUE(model_->StartSequence(cache).ok());
    std::vector<SequenceStep> batch = {{tokens, &cache}};
    ForwardOptions options;
    options.logits = LogitsMode::kAllTokens;
    std::vector<float> logits;
    EXPECT_TRUE(model_->Forward(batch, options, logits).ok());
    model_->ReleaseSequence(cache);
    EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }))
        << "prompt " << i << ": non-finite logits";
    const int V = model_->config().vocab_size;
    std::vector<float> gaps;
    for (size_t j = 0; j < plain.size(); ++j) {
      const float* row = logits.data() + (prompts_[i].size() - 1 + j) * V;
      std::vector<float> sorted(row, row + V);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      float max_abs = 0;
      for (int v = 0; v < V; ++v) max_abs = std::max(max_abs, std::fabs(row[v]));
      gaps.push_back((sorted[0] - sorted[1]) / max_abs);
    }
    return gaps;
  }
  // Expects `got` to follow `plain` token for token until a position where the plain run's
  // choice is a near-tie (top-2 gap under kNearTie of the largest logit): there the two may part,
  // and after it their contexts differ. Returns the tokens that were identical.
  size_t ExpectSameUntilNearTie(const std::vector<std::vector<int32_t>>& got,
                                const std::vector<std::vector<int32_t>>& plain,
                                const std::string& what) {
    size_t identical = 0;
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_EQ(got[i].size(), plain[i].size()) << what << " prompt " << i;
      const size_t same =
          std::mismatch(got[i].begin(), got[i].end(), plain[i].begin(), plain[i].end()).first -
          got[i].begin();
      identical += same;
      if (same == std::min(got[i].size(), plain[i].size())) {
        std::printf("[cuda spec] %s prompt %zu: identical (%zu tokens)\n", what.c_str(), i, same);
        continue;
      }
      const float gap = RelativeGaps(i, plain[i])[same];
      std::printf(
          "[cuda spec] %s prompt %zu: identical for %zu tokens, then a near-tie? gap %.2e\n",
          what.c_str(), i, same, gap);
      EXPECT_LT(gap, kNearTie) << what << " prompt " << i << ": outputs part at token " << same
                               << " where the plain run's choice was decisive";
    }
    return identical;
  }

  std::vector<SpeculativeRequest> Requests(int k, bool mixed) const {
    std::vector<SpeculativeRequest> r;
    for (size_t i = 0; i < prompts_.size(); ++i) {
      SpeculativeRequest q;
      q.prompt = prompts_[i];
      q.max_new_tokens = kNewTokens;
      q.spec_tokens = mixed && i % 2 == 1 ? 0 : k;
      r.push_back(q);
    }
    return r;
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<HybridModel> model_;
  std::vector<std::vector<int32_t>> prompts_;
};

TEST_F(CudaSpeculativeTest, MtpDraftsKeepGreedyOutputsIdentical) {
  ASSERT_TRUE(model_->CreateCaches(16, 256).ok());
  auto none = MtpDrafter::Create(*model_, 8, 256);
  ASSERT_TRUE(none.ok()) << none.status();
  SpeculativeDecoder plain(*model_, **none);
  std::vector<std::vector<int32_t>> expected;
  ASSERT_TRUE(plain.Generate(Requests(0, false), expected).ok());
  size_t identical = 0;
  for (int k = 1; k <= 4; ++k) {
    for (bool mixed : {false, true}) {
      auto drafter = MtpDrafter::Create(*model_, 8, 256);
      ASSERT_TRUE(drafter.ok()) << drafter.status();
      SpeculativeDecoder spec(*model_, **drafter);
      std::vector<std::vector<int32_t>> out;
      ASSERT_TRUE(spec.Generate(Requests(k, mixed), out).ok());
      identical +=
          ExpectSameUntilNearTie(out, expected, "k=" + std::to_string(k) + (mixed ? " mixed" : ""));
      EXPECT_GT(spec.stats().rollback_steps, 0);
    }
  }
  // Drafts that are the plain outputs: accepted, and still the same outputs.
  CopyDrafter copy(prompts_, expected);
  SpeculativeDecoder accepting(*model_, copy);
  std::vector<std::vector<int32_t>> out;
  ASSERT_TRUE(accepting.Generate(Requests(4, true), out).ok());
  identical += ExpectSameUntilNearTie(out, expected, "copy drafts");
  // Most tokens must agree, or the near-tie allowance would be carrying the test.
  EXPECT_GT(identical, 9 * prompts_.size() * kNewTokens / 2);
  std::printf("[cuda spec] copy drafts: acceptance at position 0 %.3f, mean length %.2f\n",
              accepting.stats().AcceptanceRate(0), accepting.stats().MeanAcceptedLength());
  EXPECT_GT(accepting.stats().AcceptanceRate(0), 0.9);
}

// Verify steps where every sequence carries the same number of drafts are recorded as CUDA
// graphs and replayed (with the kept state inputs of the replay feeding the rollback): the same
// tokens as running every verify step op by op, with all drafts rejected (MTP head) and all
// accepted (copied drafts).
TEST_F(CudaSpeculativeTest, RecordedVerifyStepsMatchOpByOpSteps) {
  ASSERT_TRUE(model_->CreateCaches(16, 256).ok());
  auto run = [&](int capture, Drafter& drafter, int k) {
    model_->SetDecodeCapture(capture);
    SpeculativeDecoder decoder(*model_, drafter);
    std::vector<std::vector<int32_t>> out;
    EXPECT_TRUE(decoder.Generate(Requests(k, false), out).ok());
    return out;
  };
  auto mtp = MtpDrafter::Create(*model_, 8, 256);
  ASSERT_TRUE(mtp.ok()) << mtp.status();
  const auto op_by_op = run(0, **mtp, 3);
  const auto recorded = run(256, **mtp, 3);
  EXPECT_EQ(recorded, op_by_op);
  EXPECT_GT(model_->num_recorded_steps(4), 0) << "no verify step of 3 drafts was recorded";
  CopyDrafter copy(prompts_, op_by_op);
  const auto copied_op_by_op = run(0, copy, 4);
  const auto copied_recorded = run(256, copy, 4);
  EXPECT_EQ(copied_recorded, copied_op_by_op);
  EXPECT_GT(model_->num_recorded_steps(5), 0) << "no verify step of 4 drafts was recorded";
  model_->SetDecodeCapture(0);
}

// Sets MOBIUS_MTP_HEAD_GRAPHS for a scope (unset with nullptr: the default) and restores the
// caller's value after it.
class ScopedHeadGraphsEnv {
 public:
  ScopedHeadGraphsEnv() {
    const char* env = std::getenv(kName);
    if (env != nullptr) saved_ = env;
  }
  ~ScopedHeadGraphsEnv() {
    if (saved_.has_value()) {
      setenv(kName, saved_->c_str(), 1);
    } else {
      unsetenv(kName);
    }
  }
  void Set(const char* value) {
    if (value != nullptr) {
      setenv(kName, value, 1);
    } else {
      unsetenv(kName);
    }
  }

 private:
  static constexpr const char* kName = "MOBIUS_MTP_HEAD_GRAPHS";
  std::optional<std::string> saved_;
};

// The head observes `prompt` (its hidden states; the target's next token 5), then drafts 4 tokens
// after it in each of three rounds: every round's drafts.
std::vector<std::vector<std::vector<int32_t>>> DraftRounds(MtpDrafter& mtp,
                                                           const std::vector<int32_t>& prompt,
                                                           const std::vector<float>& hidden) {
  const TargetStep whole{0, 0, prompt, hidden, /*next=*/5};
  EXPECT_TRUE(mtp.Observe(std::span(&whole, 1)).ok());
  std::vector<int32_t> context = prompt;
  context.push_back(5);
  const DraftRequest request{0, context, 4};
  std::vector<std::vector<std::vector<int32_t>>> rounds(3);
  for (auto& drafts : rounds) EXPECT_TRUE(mtp.Draft(std::span(&request, 1), drafts).ok());
  return rounds;
}

// The MTP head's one-token draft steps recorded as CUDA graphs (the default;
// MOBIUS_MTP_HEAD_GRAPHS=0 runs them op by op). The drafts themselves are compared (the target's
// outputs do not depend on them): after observing a prompt, Draft chains three one-token head
// steps; the first Draft records them and the later ones replay, and every round must draft what
// the head run op by op drafts. The fixture's head is random, so a wrong input or output row
// changes its argmax.
TEST_F(CudaSpeculativeTest, RecordedMtpHeadStepsMatchOpByOpSteps) {
  ASSERT_TRUE(model_->CreateCaches(16, 256).ok());
  model_->SetDecodeCapture(256);
  const std::vector<int32_t>& prompt = prompts_[2];
  const std::vector<float> hidden = testing::PromptHiddenStates(*model_, prompt);
  ASSERT_FALSE(hidden.empty());
  ScopedHeadGraphsEnv env;
  auto rounds = [&](bool record_head, int* head_graphs) {
    env.Set(record_head ? nullptr : "0");  // the default records
    auto mtp = MtpDrafter::Create(*model_, 2, 256);
    std::vector<std::vector<std::vector<int32_t>>> drafts;
    EXPECT_TRUE(mtp.ok()) << mtp.status();
    if (!mtp.ok()) return drafts;
    drafts = DraftRounds(**mtp, prompt, hidden);
    *head_graphs = (*mtp)->head().num_decode_graphs();
    return drafts;
  };
  int op_by_op_graphs = 0, recorded_graphs = 0;
  const auto op_by_op = rounds(false, &op_by_op_graphs);
  const auto recorded = rounds(true, &recorded_graphs);
  ASSERT_EQ(op_by_op.size(), 3u);
  ASSERT_EQ(op_by_op[0].size(), 1u);
  EXPECT_EQ(op_by_op[0][0].size(), 4u);
  EXPECT_EQ(recorded, op_by_op);
  EXPECT_EQ(op_by_op_graphs, 0);
  EXPECT_GT(recorded_graphs, 0) << "no head step was recorded";
  model_->SetDecodeCapture(0);
}

// A draft vocabulary on the GPU: the head's lm_head is a bf16 copy of the map's rows, gathered
// once, and its one-token steps are recorded with the narrower logits. A map that holds the
// whole-vocabulary drafts gives those drafts; one that lacks them gives drafts from the map;
// greedy outputs with the latter stay those of plain decoding.
TEST_F(CudaSpeculativeTest, DraftVocabularyRestrictsRecordedHeadDrafts) {
  ASSERT_TRUE(model_->CreateCaches(16, 256).ok());
  model_->SetDecodeCapture(256);
  const std::vector<int32_t>& prompt = prompts_[2];
  const std::vector<float> hidden = testing::PromptHiddenStates(*model_, prompt);
  ASSERT_FALSE(hidden.empty());
  const int vocab = model_->config().vocab_size;
  auto parse = [&](const std::vector<int32_t>& ids) {
    std::string text;
    for (int32_t id : ids) text += std::to_string(id) + " ";
    auto v = DraftVocabulary::Parse(text, vocab, "test map");
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *std::move(v) : DraftVocabulary();
  };
  // Three rounds of four drafts (the first from the observe step, three recorded head steps).
  auto rounds = [&](DraftVocabulary vocabulary, int* head_graphs) {
    std::vector<int32_t> drafts;
    auto mtp = MtpDrafter::Create(*model_, 2, 256, std::move(vocabulary));
    EXPECT_TRUE(mtp.ok()) << mtp.status();
    if (!mtp.ok()) return drafts;
    for (const auto& d : DraftRounds(**mtp, prompt, hidden)) {
      if (d.size() == 1) drafts.insert(drafts.end(), d[0].begin(), d[0].end());
    }
    *head_graphs = (*mtp)->head().num_decode_graphs();
    return drafts;
  };
  int graphs = 0;
  const std::vector<int32_t> whole = rounds(DraftVocabulary(), &graphs);
  ASSERT_EQ(whole.size(), 12u);
  std::vector<int32_t> holding(whole.begin(), whole.end());
  std::sort(holding.begin(), holding.end());
  holding.erase(std::unique(holding.begin(), holding.end()), holding.end());
  const size_t drafted = holding.size();
  for (int i = 1; i < vocab; i += 5) {
    if (!std::binary_search(holding.begin(), holding.begin() + drafted, i)) holding.push_back(i);
  }
  EXPECT_EQ(rounds(parse(holding), &graphs), whole);
  EXPECT_GT(graphs, 0) << "no head step was recorded";
  std::vector<int32_t> lacking;
  for (int i = 0; i < vocab; i += 2) {
    if (std::find(whole.begin(), whole.end(), i) == whole.end()) lacking.push_back(i);
  }
  const std::vector<int32_t> restricted = rounds(parse(lacking), &graphs);
  ASSERT_EQ(restricted.size(), 12u);
  for (int32_t t : restricted) {
    EXPECT_TRUE(std::find(lacking.begin(), lacking.end(), t) != lacking.end())
        << "draft " << t << " is not in the map";
  }
  model_->SetDecodeCapture(0);

  auto none = MtpDrafter::Create(*model_, 8, 256);
  ASSERT_TRUE(none.ok()) << none.status();
  SpeculativeDecoder plain(*model_, **none);
  std::vector<std::vector<int32_t>> expected;
  ASSERT_TRUE(plain.Generate(Requests(0, false), expected).ok());
  auto mapped = MtpDrafter::Create(*model_, 8, 256, parse(lacking));
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  SpeculativeDecoder spec(*model_, **mapped);
  std::vector<std::vector<int32_t>> out;
  ASSERT_TRUE(spec.Generate(Requests(4, false), out).ok());
  const size_t identical = ExpectSameUntilNearTie(out, expected, "draft vocabulary");
  EXPECT_GT(identical, prompts_.size() * kNewTokens / 2);
  EXPECT_GT(spec.stats().verify_steps, 0);
}

// The production default: the target's verify steps and the head's one-token draft steps both
// recorded (the head takes the target's --cuda-graph-max-batch when the drafter is made). They
// share the backend's capture pool, so a head replay overwrites the target's last replay; the
// rollback must read the kept state inputs before the head runs. One sequence (a head step
// records at one token only) whose random-head drafts are mostly rejected: the same tokens as
// with nothing recorded, and both kinds of recording must have happened.
TEST_F(CudaSpeculativeTest, RecordedTargetAndHeadStepsMatchOpByOpSteps) {
  ASSERT_TRUE(model_->CreateCaches(16, 256).ok());
  ScopedHeadGraphsEnv env;
  env.Set(nullptr);
  auto run = [&](int capture, int* head_graphs, int64_t* rollbacks) {
    model_->SetDecodeCapture(capture);
    std::vector<std::vector<int32_t>> out;
    auto mtp = MtpDrafter::Create(*model_, 8, 256);
    EXPECT_TRUE(mtp.ok()) << mtp.status();
    if (!mtp.ok()) return out;
    SpeculativeDecoder decoder(*model_, **mtp);
    std::vector<SpeculativeRequest> requests = Requests(3, false);
    requests.erase(requests.begin() + 1, requests.end());
    EXPECT_TRUE(decoder.Generate(requests, out).ok());
    *head_graphs = (*mtp)->head().num_decode_graphs();
    *rollbacks = decoder.stats().rollback_steps;
    return out;
  };
  int op_by_op_graphs = 0, recorded_graphs = 0;
  int64_t op_by_op_rollbacks = 0, recorded_rollbacks = 0;
  const auto op_by_op = run(0, &op_by_op_graphs, &op_by_op_rollbacks);
  const auto recorded = run(256, &recorded_graphs, &recorded_rollbacks);
  ASSERT_EQ(op_by_op.size(), 1u);
  EXPECT_FALSE(op_by_op[0].empty());
  EXPECT_EQ(recorded, op_by_op);
  EXPECT_EQ(op_by_op_graphs, 0);
  EXPECT_GT(recorded_graphs, 0) << "no head step was recorded";
  EXPECT_GT(model_->num_recorded_steps(4), 0) << "no verify step of 3 drafts was recorded";
  EXPECT_GT(recorded_rollbacks, 0) << "no rollback read a recorded step's kept inputs";
  EXPECT_EQ(recorded_rollbacks, op_by_op_rollbacks);
  model_->SetDecodeCapture(0);
}

// The engine with MTP speculation (k = 3, chunked prefill beside verify steps, one request
// decoding without drafts) gives the engine's own outputs without speculation.
TEST_F(CudaSpeculativeTest, EngineWithMtpMatchesEngineWithout) {
  auto run = [&](int k, std::vector<std::vector<int32_t>>& outputs) {
    std::unique_ptr<MtpDrafter> drafter;
    EngineOptions options;
    options.scheduler.max_num_seqs = 4;
    options.scheduler.max_tokens_per_step = 16;
    options.max_model_len = 256;
    if (k > 0) {
      auto made = MtpDrafter::Create(*model_, 4, 260);
      ASSERT_TRUE(made.ok()) << made.status();
      drafter = *std::move(made);
      options.spec_tokens = k;
      options.drafter = drafter.get();
    }
    auto engine = Engine::Create(*model_, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    outputs.assign(prompts_.size(), {});
    std::vector<absl::Notification> done(prompts_.size());
    for (size_t i = 0; i < prompts_.size(); ++i) {
      GenerationRequest r;
      r.request_id = "r" + std::to_string(i);
      r.prompt = prompts_[i];
      r.params.temperature = 0;
      r.params.max_tokens = kNewTokens;
      if (i == 1) r.params.logprobs = 0;
      ASSERT_TRUE((*engine)
                      ->Enqueue(r,
                                [&outputs, &done, i](const GenerationOutput& out) {
                                  outputs[i].insert(outputs[i].end(), out.tokens.begin(),
                                                    out.tokens.end());
                                  if (out.finish != FinishReason::kNone) done[i].Notify();
                                })
                      .ok());
    }
    for (auto& d : done) ASSERT_TRUE(d.WaitForNotificationWithTimeout(absl::Seconds(60)));
  };
  std::vector<std::vector<int32_t>> plain, speculative;
  run(0, plain);
  model_->DropCaches();
  run(3, speculative);
  EXPECT_GT(ExpectSameUntilNearTie(speculative, plain, "engine k=3"),
            prompts_.size() * kNewTokens / 2);
}

// Sampled requests with MTP drafts: on the CUDA backend each verify row checks its draft on the
// device (Backend::SampleRows; the rows stay there) and takes the tokens the host's verify takes
// from the copied rows and the same streams. One sequence a step, so that both runs see the same
// batches and the same drafts; temperatures from near-greedy (drafts accepted) to 1 (mostly
// rejected), with truncation and penalties.
TEST_F(CudaSpeculativeTest, EngineVerifiesSampledDraftsOnTheDeviceAsOnTheHost) {
  ASSERT_TRUE(backend_->SamplesOnDevice());
  auto run = [&](EngineOptions::SamplingPlace place, std::vector<std::vector<int32_t>>& outputs,
                 int& multi_token_messages, int64_t& checked_on_backend) {
    auto drafter = MtpDrafter::Create(*model_, 1, 260);
    ASSERT_TRUE(drafter.ok()) << drafter.status();
    EngineOptions options;
    options.scheduler.max_num_seqs = 1;
    options.max_model_len = 256;
    options.spec_tokens = 3;
    options.drafter = drafter->get();
    options.sampling_place = place;
    auto engine = Engine::Create(*model_, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const size_t n = 10;
    outputs.assign(n, {});
    multi_token_messages = 0;
    std::vector<absl::Notification> done(n);
    for (size_t i = 0; i < n; ++i) {
      GenerationRequest r;
      r.request_id = "s" + std::to_string(i);
      r.prompt = prompts_[i % prompts_.size()];
      r.params.max_tokens = kNewTokens;
      r.params.ignore_eos = true;
      r.params.seed = 500 + i;
      r.params.temperature = std::vector<float>{0.05f, 0.3f, 0.7f, 1.0f, 0.02f}[i % 5];
      if (i % 3 == 1) r.params.top_p = 0.9f;
      if (i % 4 == 2) r.params.top_k = 8;
      if (i % 4 == 3) {
        r.params.repetition_penalty = 1.2f;
        r.params.presence_penalty = 0.3f;
      }
      ASSERT_TRUE(
          (*engine)
              ->Enqueue(r,
                        [&outputs, &done, &multi_token_messages, i](const GenerationOutput& out) {
                          outputs[i].insert(outputs[i].end(), out.tokens.begin(), out.tokens.end());
                          multi_token_messages += out.tokens.size() > 1;
                          if (out.finish != FinishReason::kNone) done[i].Notify();
                        })
              .ok());
    }
    for (auto& d : done) ASSERT_TRUE(d.WaitForNotificationWithTimeout(absl::Seconds(60)));
    checked_on_backend = (*engine)->GetStats().drafts_checked_on_backend;
  };
  std::vector<std::vector<int32_t>> on_device, on_host;
  int device_multi = 0, host_multi = 0;
  int64_t device_checked = 0, host_checked = 0;
  run(EngineOptions::SamplingPlace::kAuto, on_device, device_multi, device_checked);
  model_->DropCaches();
  run(EngineOptions::SamplingPlace::kHost, on_host, host_multi, host_checked);
  EXPECT_GT(device_checked, 0);  // the rows stayed on the device
  EXPECT_EQ(host_checked, 0);
  ASSERT_EQ(on_device.size(), on_host.size());
  for (size_t i = 0; i < on_device.size(); ++i) {
    EXPECT_EQ(on_device[i].size(), static_cast<size_t>(kNewTokens)) << "request " << i;
    EXPECT_EQ(on_device[i], on_host[i]) << "request " << i;
  }
  EXPECT_GT(device_multi, 0);  // some drafts were accepted
  EXPECT_EQ(device_multi, host_multi);
}

}  // namespace
}  // namespace mobius::worker
