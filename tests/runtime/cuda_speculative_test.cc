// Speculative decoding on the CUDA backend (bf16): greedy outputs with the MTP head's drafts are
// the outputs without them, for the decoder alone and inside the engine's continuous batching,
// with every draft rejected (the fixture's random head) and with every draft accepted (drafts
// copied from the plain run). Skipped without a GPU.
//
// "The same" in bf16 means: the same tokens up to the first position where the plain run's
// choice is not decisive (top-2 logit gap under 2e-2 of the largest logit, the fixtures' bf16
// criterion). The verify step runs a sequence's k + 1 tokens through the multi-token kernels
// (chunked delta rule, prefill attention, GEMMs of more rows) where plain decoding runs one
// token; in bf16 those round differently, and the random tiny fixtures have near-ties that
// flip under such differences. Plain decoding alone does the same: the whole-prompt prefill of
// the decoder and the engine's 16-token prefill chunks already disagree on one fixture prompt
// (seen on the H200). Bit-identical outputs need batch-invariant kernels.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

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
  // How many leading tokens of `plain` (the greedy continuation of prompt i) are decisive: the
  // first position whose top-2 logit gap is under 2e-2 of the largest logit ends the prefix
  // (logits from one forward over prompt + plain).
  size_t DecisivePrefix(size_t i, const std::vector<int32_t>& plain) {
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
    const int V = model_->config().vocab_size;
    for (size_t j = 0; j < plain.size(); ++j) {
      const float* row = logits.data() + (prompts_[i].size() - 1 + j) * V;
      std::vector<float> sorted(row, row + V);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
      float max_abs = 0;
      for (int v = 0; v < V; ++v) max_abs = std::max(max_abs, std::fabs(row[v]));
      if (sorted[0] - sorted[1] < 2e-2f * max_abs) return j;
    }
    return plain.size();
  }
  // Expects `got` to equal `plain` over each prompt's decisive prefix; returns the tokens
  // compared.
  size_t ExpectSameWhereDecisive(const std::vector<std::vector<int32_t>>& got,
                                 const std::vector<std::vector<int32_t>>& plain,
                                 const std::string& what) {
    size_t compared = 0;
    for (size_t i = 0; i < plain.size(); ++i) {
      const size_t n = DecisivePrefix(i, plain[i]);
      EXPECT_GE(got[i].size(), n);
      const size_t m = std::min(n, got[i].size());
      EXPECT_EQ(std::vector<int32_t>(got[i].begin(), got[i].begin() + m),
                std::vector<int32_t>(plain[i].begin(), plain[i].begin() + m))
          << what << " prompt " << i;
      const size_t same =
          std::mismatch(got[i].begin(), got[i].end(), plain[i].begin(), plain[i].end()).first -
          got[i].begin();
      std::printf("[cuda spec] %s prompt %zu: decisive prefix %zu of %zu, identical prefix %zu\n",
                  what.c_str(), i, n, plain[i].size(), same);
      compared += m;
    }
    return compared;
  }

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
  size_t compared = 0;
  for (int k = 1; k <= 4; ++k) {
    for (bool mixed : {false, true}) {
      auto drafter = MtpDrafter::Create(*model_, 8, 256);
      ASSERT_TRUE(drafter.ok()) << drafter.status();
      SpeculativeDecoder spec(*model_, **drafter);
      std::vector<std::vector<int32_t>> out;
      ASSERT_TRUE(spec.Generate(Requests(k, mixed), out).ok());
      compared += ExpectSameWhereDecisive(out, expected,
                                          "k=" + std::to_string(k) + (mixed ? " mixed" : ""));
      EXPECT_GT(spec.stats().recompute_steps, 0);
    }
  }
  // Drafts that are the plain outputs: accepted, and still the same outputs.
  CopyDrafter copy(prompts_, expected);
  SpeculativeDecoder accepting(*model_, copy);
  std::vector<std::vector<int32_t>> out;
  ASSERT_TRUE(accepting.Generate(Requests(4, true), out).ok());
  compared += ExpectSameWhereDecisive(out, expected, "copy drafts");
  // The criterion must leave most tokens compared, or the test would assert little.
  EXPECT_GT(compared, 9 * prompts_.size() * kNewTokens / 2);
  std::printf("[cuda spec] copy drafts: acceptance at position 0 %.3f, mean length %.2f\n",
              accepting.stats().AcceptanceRate(0), accepting.stats().MeanAcceptedLength());
  EXPECT_GT(accepting.stats().AcceptanceRate(0), 0.9);
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
  EXPECT_GT(ExpectSameWhereDecisive(speculative, plain, "engine k=3"),
            prompts_.size() * kNewTokens / 2);
}

}  // namespace
}  // namespace mobius::worker
