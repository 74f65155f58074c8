// The continuous-batching engine on the fixture model: concurrent requests, chunked prefill mixed
// with decode, preemption under a small KV cache, cancellation, seeded sampling, validation.
#include "worker/runtime/engine.h"

#include <map>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grammar/grammar_matcher.h"
#include "grammar/json_schema_compiler.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "prometheus/text_serializer.h"
#include "tests/model/fixture_util.h"
#include "tests/runtime/piece_vocabulary.h"
#include "worker/runtime/mtp_drafter.h"

namespace mobius::worker {
namespace {

using ::testing::HasSubstr;

// Collects the stream of each request.
class Streams {
 public:
  OutputCallback For(const std::string& id) {
    {
      absl::MutexLock lock(&mu_);
      done_[id] = std::make_unique<absl::Notification>();
    }
    return [this, id](const GenerationOutput& out) {
      absl::MutexLock lock(&mu_);
      auto& r = results_[id];
      r.tokens.insert(r.tokens.end(), out.tokens.begin(), out.tokens.end());
      r.logprobs.insert(r.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
      if (!out.prompt_logprobs.empty()) {
        r.prompt_logprobs = out.prompt_logprobs;
        ++r.prompt_messages;
      }
      ++r.messages;
      if (out.finish != FinishReason::kNone) {
        r.finish = out.finish;
        r.matched = out.matched_stop_token;
        r.completion_tokens = out.completion_tokens;
        r.error = out.error;
        done_[id]->Notify();
      }
    };
  }
  struct Result {
    std::vector<int32_t> tokens;
    std::vector<SampledToken> logprobs;
    FinishReason finish = FinishReason::kNone;
    std::optional<int32_t> matched;
    int completion_tokens = 0;
    int messages = 0;
    std::vector<SampledToken> prompt_logprobs;
    int prompt_messages = 0;  // messages that carried prompt_logprobs
    absl::Status error;
  };
  Result Wait(const std::string& id) {
    absl::Notification* n;
    {
      absl::MutexLock lock(&mu_);
      n = done_[id].get();
    }
    EXPECT_TRUE(n->WaitForNotificationWithTimeout(absl::Seconds(60))) << id;
    absl::MutexLock lock(&mu_);
    return results_[id];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, Result> results_;
  std::map<std::string, std::unique_ptr<absl::Notification>> done_;
};

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FixtureModelDir("intern-s2-mobius-tiny");
    backend_ = kernels::CreateCpuBackend(1);
    model_ = testing::LoadFixtureModel(dir_, *backend_);
    ASSERT_NE(model_, nullptr);
    ref_ = testing::LoadReference(dir_);
  }
  std::unique_ptr<Engine> Start(EngineOptions options) {
    auto engine = Engine::Create(*model_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }
  GenerationRequest Greedy(const std::string& id, const std::vector<int32_t>& prompt, int n) {
    GenerationRequest r;
    r.request_id = id;
    r.prompt = prompt;
    r.params.temperature = 0;
    r.params.max_tokens = n;
    return r;
  }

  // Enqueues a greedy request per reference prompt, as long as its reference continuation, with
  // id `prefix` + the prompt's index.
  void EnqueueReference(Engine& engine, Streams& streams, const std::string& prefix) {
    for (const auto& [p, expected] : ref_.greedy) {
      const std::string id = prefix + std::to_string(p);
      ASSERT_TRUE(
          engine.Enqueue(Greedy(id, ref_.prompts[p], expected.size()), streams.For(id)).ok());
    }
  }

  std::string dir_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<HybridModel> model_;
  testing::ModelReference ref_;
};

TEST_F(EngineTest, ConcurrentGreedyRequestsMatchReferenceWithChunkedPrefill) {
  EngineOptions options;
  options.scheduler.max_num_seqs = 4;
  options.scheduler.max_tokens_per_step = 16;  // the 130-token prompt prefills over many steps
  options.max_model_len = 256;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  Streams streams;
  EnqueueReference(*engine, streams, "r");
  for (const auto& [p, expected] : ref_.greedy) {
    auto r = streams.Wait("r" + std::to_string(p));
    EXPECT_EQ(r.tokens, expected) << "prompt " << p;
    EXPECT_EQ(r.finish, FinishReason::kLength);
    EXPECT_EQ(r.completion_tokens, static_cast<int>(expected.size()));
    EXPECT_EQ(r.messages, static_cast<int>(expected.size()));  // one message per token
  }
  EXPECT_EQ(engine->GetStats().num_running, 0);
}

// Also with MTP speculation (k = 2): preemption frees a speculating sequence's snapshot slot and
// the head's cache, and the re-prefilled sequence speculates again.
TEST_F(EngineTest, PreemptionByRecomputeKeepsOutputsExact) {
  for (int spec_tokens : {0, 2}) {
    EngineOptions options;
    options.scheduler.max_num_seqs = 3;
    options.scheduler.max_tokens_per_step = 64;
    options.kv_block_size = 4;
    options.num_kv_blocks = 48;  // 192 positions for three sequences that need ~220
    options.max_model_len = 180;
    std::unique_ptr<MtpDrafter> drafter;
    if (spec_tokens > 0) {
      auto made = MtpDrafter::Create(*model_, 3, 184);
      ASSERT_TRUE(made.ok()) << made.status();
      drafter = *std::move(made);
      options.spec_tokens = spec_tokens;
      options.drafter = drafter.get();
    }
    auto engine = Start(options);
    ASSERT_NE(engine, nullptr);
    Streams streams;
    EnqueueReference(*engine, streams, "r");
    for (const auto& [p, expected] : ref_.greedy) {
      EXPECT_EQ(streams.Wait("r" + std::to_string(p)).tokens, expected)
          << "prompt " << p << " spec_tokens " << spec_tokens;
    }
    EXPECT_GT(engine->GetStats().num_preemptions, 0);
    engine.reset();
    EXPECT_EQ(model_->state_slots()->free_slots(), model_->state_slots()->num_slots());
  }
}

TEST_F(EngineTest, CancelFreesTheSlot) {
  EngineOptions options;
  options.scheduler.max_num_seqs = 1;
  options.max_model_len = 2048;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  Streams streams;
  absl::Notification first_token;
  auto collect = streams.For("long");
  ASSERT_TRUE(engine
                  ->Enqueue(Greedy("long", ref_.prompts[1], 1500),
                            [&](const GenerationOutput& out) {
                              collect(out);
                              if (!first_token.HasBeenNotified()) first_token.Notify();
                            })
                  .ok());
  ASSERT_TRUE(first_token.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(engine->Cancel("long"));
  auto r = streams.Wait("long");
  EXPECT_EQ(r.finish, FinishReason::kAbort);
  EXPECT_LT(r.tokens.size(), 1500u);
  // The only slot is free again: a new request runs to completion.
  const auto& [p, expected] = ref_.greedy[0];
  ASSERT_TRUE(engine->Enqueue(Greedy("next", ref_.prompts[p], 4), streams.For("next")).ok());
  EXPECT_EQ(streams.Wait("next").tokens,
            std::vector<int32_t>(expected.begin(), expected.begin() + 4));
  EXPECT_FALSE(engine->Cancel("next"));  // already finished
}

TEST_F(EngineTest, SeededSamplingIsReproducibleWhateverShareTheBatch) {
  EngineOptions options;
  options.scheduler.max_num_seqs = 4;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  auto sampled = [&](const std::string& id) {
    GenerationRequest r;
    r.request_id = id;
    r.prompt = ref_.prompts[2];
    r.params.temperature = 1.0f;
    r.params.top_p = 0.9f;
    r.params.seed = 77;
    r.params.max_tokens = 12;
    return r;
  };
  Streams streams;
  ASSERT_TRUE(engine->Enqueue(sampled("alone"), streams.For("alone")).ok());
  auto alone = streams.Wait("alone");
  ASSERT_TRUE(engine->Enqueue(Greedy("other", ref_.prompts[3], 12), streams.For("other")).ok());
  ASSERT_TRUE(engine->Enqueue(sampled("shared"), streams.For("shared")).ok());
  auto shared = streams.Wait("shared");
  streams.Wait("other");
  EXPECT_EQ(alone.tokens.size(), 12u);
  EXPECT_EQ(alone.tokens, shared.tokens);
}

// Six seeded sampled sequences in one batch: their rows are drawn on several threads
// (Engine::SampleRows takes two rows or more per thread), and each stream equals the same request
// run alone.
TEST_F(EngineTest, SampledRowsOfABatchMatchEachRequestAlone) {
  EngineOptions options;
  options.scheduler.max_num_seqs = 6;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  auto sampled = [&](const std::string& id, uint64_t seed) {
    GenerationRequest r;
    r.request_id = id;
    r.prompt = ref_.prompts[seed % ref_.prompts.size()];
    r.params.temperature = 0.9f;
    r.params.top_p = 0.95f;
    r.params.seed = seed;
    r.params.max_tokens = 10;
    return r;
  };
  Streams streams;
  std::vector<std::vector<int32_t>> alone;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const std::string id = "alone" + std::to_string(seed);
    ASSERT_TRUE(engine->Enqueue(sampled(id, seed), streams.For(id)).ok());
    alone.push_back(streams.Wait(id).tokens);
  }
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const std::string id = "batch" + std::to_string(seed);
    ASSERT_TRUE(engine->Enqueue(sampled(id, seed), streams.For(id)).ok());
  }
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const auto batched = streams.Wait("batch" + std::to_string(seed));
    EXPECT_EQ(batched.tokens.size(), 10u);
    EXPECT_EQ(batched.tokens, alone[seed - 1]) << "seed " << seed;
  }
}

// Rows drawn through the backend's SampleRows (kBackend: the CPU backend's goes through the
// host) take the host sampler's tokens, in batches that mix sampling rules, greedy rows, chunked
// prefill, and rows that the step copies and draws on the host (a penalty, top-n logprobs).
TEST_F(EngineTest, BackendSamplingMatchesHostSampling) {
  auto run = [&](EngineOptions::SamplingPlace place) {
    EngineOptions options;
    options.scheduler.max_num_seqs = 6;
    options.scheduler.max_tokens_per_step = 16;
    options.sampling_place = place;
    std::vector<Streams::Result> outputs;
    auto engine = Start(options);
    EXPECT_NE(engine, nullptr);
    if (engine == nullptr) return outputs;
    Streams streams;
    for (int i = 0; i < 6; ++i) {
      GenerationRequest r;
      r.request_id = "r" + std::to_string(i);
      r.prompt = ref_.prompts[i % ref_.prompts.size()];
      r.params.seed = 40 + i;
      r.params.max_tokens = 12;
      r.params.ignore_eos = true;
      switch (i % 4) {
        case 0:
          r.params.temperature = 0;
          break;
        case 1:
          r.params.temperature = 0.8f;
          r.params.top_p = 0.9f;
          break;
        case 2:
          r.params.top_k = 5;
          r.params.min_p = 0.05f;
          r.params.logprobs = 0;
          break;
        default:
          r.params.temperature = 1.1f;
          break;
      }
      if (i == 5) {  // penalised through Backend::PenalizeRows beside unpenalised rows
        r.params.presence_penalty = 0.4f;
        r.params.repetition_penalty = 1.2f;
      }
      if (i == 4) {  // top-n logprobs (Backend::TopLogitsRows), after penalties
        r.params.logprobs = 2;
        r.params.frequency_penalty = 0.3f;
      }
      if (i == 3) {  // logit biases (through the host inside Backend::PenalizeRows on a GPU)
        r.params.logit_bias = {{7, 3.0f}, {100, -100.0f}, {ref_.prompts[3][0], 1.5f}};
        // Banned (-infinity) for the whole output: min_tokens = max_tokens.
        r.params.stop_token_ids = {ref_.prompts[3][1], 9};
        r.params.min_tokens = 12;
      }
      EXPECT_TRUE(engine->Enqueue(r, streams.For(r.request_id)).ok());
    }
    for (int i = 0; i < 6; ++i) outputs.push_back(streams.Wait("r" + std::to_string(i)));
    return outputs;
  };
  const auto on_backend = run(EngineOptions::SamplingPlace::kBackend);
  const auto on_host = run(EngineOptions::SamplingPlace::kHost);
  ASSERT_EQ(on_backend.size(), 6u);
  ASSERT_EQ(on_host.size(), 6u);
  for (size_t i = 0; i < on_backend.size(); ++i) {
    EXPECT_EQ(on_backend[i].tokens.size(), 12u) << "request " << i;
    EXPECT_EQ(on_backend[i].tokens, on_host[i].tokens) << "request " << i;
    // Logprobs to within float rounding: requests arrive while the engine runs, so the two
    // runs may group them into different steps, and the CPU kernels' sums may then differ in
    // the last bits (seen under ctest -j2: -4.06765 against -4.06765).
    ASSERT_EQ(on_backend[i].logprobs.size(), on_host[i].logprobs.size()) << "request " << i;
    for (size_t k = 0; k < on_host[i].logprobs.size(); ++k) {
      const SampledToken &a = on_backend[i].logprobs[k], &b = on_host[i].logprobs[k];
      EXPECT_EQ(a.token, b.token);
      EXPECT_NEAR(a.logprob, b.logprob, 1e-4) << "request " << i << " token " << k;
      ASSERT_EQ(a.top.size(), b.top.size()) << "request " << i << " token " << k;
      for (size_t j = 0; j < a.top.size(); ++j) {
        EXPECT_EQ(a.top[j].token, b.top[j].token) << "request " << i << " token " << k;
        EXPECT_NEAR(a.top[j].logprob, b.top[j].logprob, 1e-4) << "request " << i << " token " << k;
      }
    }
  }
  EXPECT_EQ(on_backend[4].logprobs.size(), 12u);  // the logprobs requests were covered
  EXPECT_EQ(on_backend[4].logprobs[0].top.size(), 2u);
}

TEST_F(EngineTest, StopTokenEndsTheStream) {
  auto engine = Start(EngineOptions{});
  ASSERT_NE(engine, nullptr);
  const auto& [p, expected] = ref_.greedy[1];
  GenerationRequest r = Greedy("stop", ref_.prompts[p], 20);
  r.params.stop_token_ids = {expected[3]};
  Streams streams;
  ASSERT_TRUE(engine->Enqueue(r, streams.For("stop")).ok());
  auto result = streams.Wait("stop");
  const auto first = std::find(expected.begin(), expected.end(), expected[3]);
  EXPECT_EQ(result.tokens, std::vector<int32_t>(expected.begin(), first + 1));
  EXPECT_EQ(result.finish, FinishReason::kStop);
  EXPECT_EQ(result.matched, expected[3]);
}

// logit_bias shifts the tokens' logits (a large bias makes greedy decoding repeat the token);
// min_tokens keeps a stop token from ending the output before it is that long.
TEST_F(EngineTest, LogitBiasAndMinTokensShapeTheOutput) {
  auto engine = Start(EngineOptions{});
  ASSERT_NE(engine, nullptr);
  const auto& [p, expected] = ref_.greedy[1];
  GenerationRequest biased = Greedy("biased", ref_.prompts[p], 6);
  biased.params.logit_bias = {{77, 100.0f}};
  // The first greedy token stops the output, but not before 3 tokens.
  GenerationRequest held = Greedy("held", ref_.prompts[p], 20);
  held.params.stop_token_ids = {expected[0]};
  held.params.min_tokens = 3;
  Streams streams;
  ASSERT_TRUE(engine->Enqueue(biased, streams.For("biased")).ok());
  ASSERT_TRUE(engine->Enqueue(held, streams.For("held")).ok());
  EXPECT_EQ(streams.Wait("biased").tokens, std::vector<int32_t>(6, 77));
  const auto result = streams.Wait("held");
  ASSERT_GE(result.tokens.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_NE(result.tokens[k], expected[0]) << "token " << k;
  if (result.finish == FinishReason::kStop) {
    EXPECT_EQ(result.tokens.back(), expected[0]);
    EXPECT_GE(result.tokens.size(), 4u);
  }
}

// The reference's log-softmax of prompt p's logits row `row`.
std::vector<double> ReferenceLogprobs(const testing::ModelReference& ref, size_t p, size_t row,
                                      int vocab) {
  const float* x = ref.logits[p].data() + row * vocab;
  const double max = *std::max_element(x, x + vocab);
  double sum = 0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(x[v] - max);
  std::vector<double> out(vocab);
  for (int v = 0; v < vocab; ++v) out[v] = x[v] - max - std::log(sum);
  return out;
}

// Checks a request's prompt scores (prompt_logprobs = top_n) against the Hugging Face reference
// logits of its prompt: each token's logprob, its rank, and the top n (their logprobs, order, and
// that no token outside them is clearly better than the last).
void ExpectReferenceScores(const testing::ModelReference& ref, size_t p, int vocab, int top_n,
                           const std::vector<SampledToken>& scores) {
  const std::vector<int32_t>& prompt = ref.prompts[p];
  ASSERT_EQ(scores.size(), prompt.size() - 1) << "prompt " << p;
  for (size_t k = 1; k < prompt.size(); ++k) {
    const std::vector<double> expected = ReferenceLogprobs(ref, p, k - 1, vocab);
    const float* row = ref.logits[p].data() + (k - 1) * vocab;
    const double scale = std::max(
        1.0f, std::abs(*std::max_element(
                  row, row + vocab, [](float a, float b) { return std::abs(a) < std::abs(b); })));
    const double tol = 3e-3 * scale;  // the fixture test's 1e-3 of the logits, on two of them
    const SampledToken& s = scores[k - 1];
    SCOPED_TRACE(::testing::Message() << "prompt " << p << " token " << k);
    EXPECT_EQ(s.token, prompt[k]);
    const double own = expected[prompt[k]];
    EXPECT_NEAR(s.logprob, own, tol);
    const auto better = std::count_if(expected.begin(), expected.end(),
                                      [&](double v) { return v > own + 2 * tol; });
    const auto at_least = std::count_if(expected.begin(), expected.end(),
                                        [&](double v) { return v >= own - 2 * tol; });
    EXPECT_GE(s.rank, better + 1);
    EXPECT_LE(s.rank, at_least);
    ASSERT_EQ(s.top.size(), static_cast<size_t>(top_n));
    for (size_t j = 0; j < s.top.size(); ++j) {
      EXPECT_NEAR(s.top[j].logprob, expected[s.top[j].token], tol) << "top " << j;
      if (j > 0) {
        EXPECT_LE(s.top[j].logprob, s.top[j - 1].logprob);
      }
    }
    if (top_n == 0) continue;
    std::vector<double> sorted = expected;
    std::nth_element(sorted.begin(), sorted.begin() + (top_n - 1), sorted.end(),
                     std::greater<double>());
    EXPECT_GE(s.top.back().logprob, sorted[top_n - 1] - 2 * tol);
  }
}

// prompt_logprobs over chunked prefills (16 tokens a step, at most 7 of them scored rows) beside
// plain requests: each prompt scored once and in full, against the reference logits; the greedy
// continuations unchanged; max_tokens 0 scores the prompt and generates nothing.
TEST_F(EngineTest, PromptLogprobsScoreThePromptAgainstTheReference) {
  EngineOptions options;
  options.scheduler.max_num_seqs = 8;
  options.scheduler.max_tokens_per_step = 16;
  options.scheduler.max_prompt_score_rows_per_step = 7;
  options.max_model_len = 256;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  Streams streams;
  EnqueueReference(*engine, streams, "plain");
  for (const auto& [p, expected] : ref_.greedy) {
    GenerationRequest scored = Greedy("scored" + std::to_string(p), ref_.prompts[p], 4);
    scored.params.prompt_logprobs = 3;
    ASSERT_TRUE(engine->Enqueue(scored, streams.For(scored.request_id)).ok());
    GenerationRequest only = Greedy("only" + std::to_string(p), ref_.prompts[p], 0);
    only.params.prompt_logprobs = 0;
    ASSERT_TRUE(engine->Enqueue(only, streams.For(only.request_id)).ok());
  }
  const int vocab = model_->config().vocab_size;
  for (const auto& [p, expected] : ref_.greedy) {
    const auto plain = streams.Wait("plain" + std::to_string(p));
    EXPECT_EQ(plain.tokens, expected);
    EXPECT_EQ(plain.prompt_messages, 0);
    const auto scored = streams.Wait("scored" + std::to_string(p));
    EXPECT_EQ(scored.tokens, std::vector<int32_t>(expected.begin(), expected.begin() + 4));
    EXPECT_EQ(scored.prompt_messages, 1);
    ExpectReferenceScores(ref_, p, vocab, 3, scored.prompt_logprobs);
    const auto only = streams.Wait("only" + std::to_string(p));
    EXPECT_TRUE(only.tokens.empty());
    EXPECT_EQ(only.finish, FinishReason::kLength);
    EXPECT_EQ(only.completion_tokens, 0);
    EXPECT_EQ(only.messages, 1);
    ExpectReferenceScores(ref_, p, vocab, 0, only.prompt_logprobs);
  }
  EXPECT_EQ(engine->GetStats().num_running, 0);
  GenerationRequest one_token = Greedy("one", {ref_.prompts[0][0]}, 0);
  one_token.params.prompt_logprobs = 2;  // nothing to score: done at once
  ASSERT_TRUE(engine->Enqueue(one_token, streams.For("one")).ok());
  EXPECT_EQ(streams.Wait("one").finish, FinishReason::kLength);
}

// Preempted by recompute mid-prompt and after it (a small KV cache), with MTP speculation: each
// prompt is still scored once, in full, and the outputs stay exact.
TEST_F(EngineTest, PromptLogprobsSurvivePreemption) {
  EngineOptions options;
  options.scheduler.max_num_seqs = 3;
  options.scheduler.max_tokens_per_step = 64;
  options.scheduler.max_prompt_score_rows_per_step = 20;
  options.kv_block_size = 4;
  options.num_kv_blocks = 48;
  options.max_model_len = 180;
  auto drafter = MtpDrafter::Create(*model_, 3, 184);
  ASSERT_TRUE(drafter.ok()) << drafter.status();
  options.spec_tokens = 2;
  options.drafter = drafter->get();
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  Streams streams;
  for (const auto& [p, expected] : ref_.greedy) {
    GenerationRequest r = Greedy("r" + std::to_string(p), ref_.prompts[p], expected.size());
    r.params.prompt_logprobs = 1;
    ASSERT_TRUE(engine->Enqueue(r, streams.For(r.request_id)).ok());
  }
  const int vocab = model_->config().vocab_size;
  for (const auto& [p, expected] : ref_.greedy) {
    const auto r = streams.Wait("r" + std::to_string(p));
    EXPECT_EQ(r.tokens, expected) << "prompt " << p;
    EXPECT_EQ(r.prompt_messages, 1) << "prompt " << p;
    ExpectReferenceScores(ref_, p, vocab, 1, r.prompt_logprobs);
  }
  EXPECT_GT(engine->GetStats().num_preemptions, 0);
}

// allowed_token_ids and bad_words through the engine (greedy: every row goes through the
// backend's penalties): the output stays in the allowed set, and a bad word made of the greedy
// continuation's first two tokens turns its second token into something else.
TEST_F(EngineTest, AllowedTokensAndBadWordsShapeTheOutput) {
  EngineOptions options;
  options.sampling_place = EngineOptions::SamplingPlace::kBackend;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  const auto& [p, expected] = ref_.greedy[0];
  GenerationRequest allowed = Greedy("allowed", ref_.prompts[p], 8);
  allowed.params.allowed_token_ids = {7, 1500, 42};
  GenerationRequest banned = Greedy("banned", ref_.prompts[p], 4);
  banned.params.bad_words = {{expected[0], expected[1]}};
  Streams streams;
  ASSERT_TRUE(engine->Enqueue(allowed, streams.For("allowed")).ok());
  ASSERT_TRUE(engine->Enqueue(banned, streams.For("banned")).ok());
  const auto restricted = streams.Wait("allowed");
  ASSERT_EQ(restricted.tokens.size(), 8u);
  for (int32_t t : restricted.tokens) EXPECT_TRUE(t == 7 || t == 1500 || t == 42) << t;
  const auto avoided = streams.Wait("banned");
  ASSERT_EQ(avoided.tokens.size(), 4u);
  EXPECT_EQ(avoided.tokens[0], expected[0]);
  EXPECT_NE(avoided.tokens[1], expected[1]);

  // Rules that exclude every token (the only allowed one is a stop token that min_tokens bans)
  // end the request with the reason rather than with a token outside them.
  GenerationRequest impossible = Greedy("impossible", ref_.prompts[p], 4);
  impossible.params.allowed_token_ids = {7};
  impossible.params.stop_token_ids = {7};
  impossible.params.min_tokens = 2;
  ASSERT_TRUE(engine->Enqueue(impossible, streams.For("impossible")).ok());
  const auto none = streams.Wait("impossible");
  EXPECT_TRUE(none.tokens.empty());
  EXPECT_EQ(none.finish, FinishReason::kError);
  EXPECT_THAT(std::string(none.error.message()), HasSubstr("no token can be drawn"));
}

TEST_F(EngineTest, InvalidRequestsAreRejectedWithReasons) {
  EngineOptions options;
  options.max_model_len = 64;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  Streams streams;
  EXPECT_THAT(engine->Enqueue(Greedy("a", {1, 99999}, 4), streams.For("a")).message(),
              HasSubstr("99999"));
  EXPECT_THAT(engine->Enqueue(Greedy("b", {}, 4), streams.For("b")).message(), HasSubstr("empty"));
  EXPECT_THAT(
      engine->Enqueue(Greedy("c", std::vector<int32_t>(64, 1), 4), streams.For("c")).message(),
      HasSubstr("64"));
  GenerationRequest bad = Greedy("d", {1, 2}, 4);
  bad.params.top_p = 2;
  EXPECT_THAT(engine->Enqueue(bad, streams.For("d")).message(), HasSubstr("top_p"));
  GenerationRequest bad_scores = Greedy("d2", {1, 2}, 4);
  bad_scores.params.prompt_logprobs = 21;
  EXPECT_THAT(engine->Enqueue(bad_scores, streams.For("d2")).message(),
              HasSubstr("prompt_logprobs"));
  ASSERT_TRUE(engine->Enqueue(Greedy("e", {1, 2}, 100), streams.For("e")).ok());
  EXPECT_EQ(engine->Enqueue(Greedy("e", {1, 2}, 4), streams.For("e2")).code(),
            absl::StatusCode::kAlreadyExists);
  engine->Shutdown(/*drain=*/true);
  EXPECT_EQ(streams.Wait("e").tokens.size(), 62u);  // stopped by max_model_len 64
  EXPECT_EQ(engine->Enqueue(Greedy("f", {1}, 1), streams.For("f")).code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(EngineTest, MetricsMoveAsRequestsAreServed) {
  auto registry = std::make_shared<prometheus::Registry>();
  EngineMetrics metrics(registry, "tiny", model_->num_banks());
  EngineOptions options;
  options.metrics = &metrics;
  options.expert_load_sample_every = 1;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  Streams streams;
  int generated = 0, prompt_tokens = 0;
  for (const auto& [p, expected] : ref_.greedy) {
    const std::string id = "m" + std::to_string(p);
    ASSERT_TRUE(engine->Enqueue(Greedy(id, ref_.prompts[p], 5), streams.For(id)).ok());
    generated += 5;
    prompt_tokens += ref_.prompts[p].size();
  }
  for (const auto& [p, expected] : ref_.greedy) streams.Wait("m" + std::to_string(p));
  EXPECT_EQ(metrics.generation_tokens.Value(), generated);
  EXPECT_EQ(metrics.prompt_tokens.Value(), prompt_tokens);
  EXPECT_EQ(metrics.RequestsFinished("length").Value(), 3);
  EXPECT_EQ(metrics.running.Value(), 0);
  double routed = 0;
  for (auto* c : metrics.bank_routed_tokens) routed += c->Value();
  // Every token of every step is routed to top-k experts in each of the 8 MoE layers.
  const int k = model_->config().num_experts_per_tok;
  EXPECT_EQ(routed, double(prompt_tokens + generated - 3) * k * model_->config().num_hidden_layers);
  const std::string text = prometheus::TextSerializer().Serialize(registry->Collect());
  EXPECT_THAT(text, HasSubstr("vllm:num_requests_running{model_name=\"tiny\"} 0"));
  EXPECT_THAT(text, HasSubstr("vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 3"));
  EXPECT_THAT(text, HasSubstr("vllm:inter_token_latency_seconds_count{model_name=\"tiny\"} 12"));
  EXPECT_THAT(text, HasSubstr("mobius_bank_routed_tokens_total{"));
}

// Speculative decoding inside continuous batching, with the fixture's MTP head (random weights:
// nearly every draft is rejected, so nearly every verify step rolls back and recomputes): the
// greedy outputs stay the reference's while prompts prefill in chunks beside verify steps and
// a request that asks for logprobs decodes without drafts in the same batches.
TEST_F(EngineTest, MtpSpeculationKeepsGreedyOutputsExact) {
  for (int k : {1, 3}) {
    auto registry = std::make_shared<prometheus::Registry>();
    EngineMetrics metrics(registry, "tiny", model_->num_banks());
    EngineOptions options;
    options.scheduler.max_num_seqs = 4;
    options.scheduler.max_tokens_per_step = 16;
    options.max_model_len = 256;
    options.metrics = &metrics;
    options.spec_tokens = k;
    auto drafter = MtpDrafter::Create(*model_, 4, 256);
    ASSERT_TRUE(drafter.ok()) << drafter.status();
    options.drafter = drafter->get();
    auto engine = Start(options);
    ASSERT_NE(engine, nullptr);
    Streams streams;
    for (const auto& [p, expected] : ref_.greedy) {
      const std::string id = "r" + std::to_string(p);
      GenerationRequest r = Greedy(id, ref_.prompts[p], expected.size());
      if (p == 2) r.params.logprobs = 1;  // this one decodes plainly beside the others
      ASSERT_TRUE(engine->Enqueue(r, streams.For(id)).ok());
    }
    for (const auto& [p, expected] : ref_.greedy) {
      auto r = streams.Wait("r" + std::to_string(p));
      EXPECT_EQ(r.tokens, expected) << "k=" << k << " prompt " << p;
      EXPECT_EQ(r.finish, FinishReason::kLength);
    }
    EXPECT_GT(metrics.spec_drafts.Value(), 0) << "k=" << k;
    EXPECT_EQ(
        metrics.spec_draft_tokens.Value(),
        metrics.SpecDraftTokensAt(0).Value() * 1.0 +
            (k > 1 ? metrics.SpecDraftTokensAt(1).Value() + metrics.SpecDraftTokensAt(2).Value()
                   : 0.0));
    engine.reset();
    // Every state slot (including the snapshots) and KV block is free again.
    EXPECT_EQ(model_->state_slots()->free_slots(), model_->state_slots()->num_slots());
    EXPECT_EQ(model_->kv_cache()->free_blocks(), model_->kv_cache()->num_blocks());
    EXPECT_EQ((*drafter)->head().state_slots()->free_slots(),
              (*drafter)->head().state_slots()->num_slots());
  }
}

// Proposes the reference's own greedy continuation, so drafts are accepted: several tokens per
// step and per stream message, the same tokens.
class ReferenceDrafter : public Drafter {
 public:
  explicit ReferenceDrafter(const testing::ModelReference& ref) : ref_(ref) {}
  absl::Status Draft(std::span<const DraftRequest> requests,
                     std::vector<std::vector<int32_t>>& drafts) override {
    drafts.assign(requests.size(), {});
    for (size_t r = 0; r < requests.size(); ++r) {
      const DraftRequest& q = requests[r];
      for (const auto& [p, expected] : ref_.greedy) {
        const std::vector<int32_t>& prompt = ref_.prompts[p];
        if (q.context.size() <= prompt.size() ||
            !std::equal(prompt.begin(), prompt.end(), q.context.begin())) {
          continue;
        }
        const size_t generated = q.context.size() - prompt.size();  // incl. the pending token
        for (int j = 0; j < q.k && generated + j < expected.size(); ++j) {
          drafts[r].push_back(expected[generated + j]);
        }
      }
    }
    return absl::OkStatus();
  }

 private:
  const testing::ModelReference& ref_;
};

// Up to 4 drafts a step from `drafter`, counted in `metrics`, at context 256.
EngineOptions Speculating(EngineMetrics& metrics, Drafter& drafter) {
  EngineOptions options;
  options.max_model_len = 256;
  options.metrics = &metrics;
  options.spec_tokens = 4;
  options.drafter = &drafter;
  return options;
}

TEST_F(EngineTest, AcceptedDraftsStreamSeveralTokensPerMessage) {
  auto registry = std::make_shared<prometheus::Registry>();
  EngineMetrics metrics(registry, "tiny", model_->num_banks());
  ReferenceDrafter drafter(ref_);
  EngineOptions options = Speculating(metrics, drafter);
  options.scheduler.max_num_seqs = 4;
  auto engine = Start(options);
  ASSERT_NE(engine, nullptr);
  Streams streams;
  EnqueueReference(*engine, streams, "a");
  for (const auto& [p, expected] : ref_.greedy) {
    auto r = streams.Wait("a" + std::to_string(p));
    EXPECT_EQ(r.tokens, expected) << "prompt " << p;
    EXPECT_EQ(r.completion_tokens, static_cast<int>(expected.size()));
    // 24 tokens: the first from the prefill, then up to 5 per verify step.
    EXPECT_LE(r.messages, 1 + (static_cast<int>(expected.size()) - 1 + 4) / 5 + 1) << p;
  }
  EXPECT_GT(metrics.spec_accepted_tokens.Value(), 0.9 * metrics.spec_draft_tokens.Value());
  EXPECT_EQ(metrics.SpecAcceptedTokensAt(0).Value(), metrics.SpecDraftTokensAt(0).Value());
  const std::string text = prometheus::TextSerializer().Serialize(registry->Collect());
  EXPECT_THAT(text, HasSubstr("vllm:spec_decode_num_accepted_tokens_per_pos{"));
  EXPECT_THAT(text, HasSubstr("mobius_spec_decode_verify_seconds_count"));
}

// A stop token inside the accepted drafts ends the output there: the tokens after it were
// verified but never sent, and vllm:generation_tokens counts what was sent.
TEST_F(EngineTest, GenerationTokensCountWhatAStopInsideTheDraftsLeaves) {
  auto registry = std::make_shared<prometheus::Registry>();
  EngineMetrics metrics(registry, "tiny", model_->num_banks());
  ReferenceDrafter drafter(ref_);
  auto engine = Start(Speculating(metrics, drafter));
  ASSERT_NE(engine, nullptr);
  Streams streams;
  const auto& [p, expected] = ref_.greedy[0];
  ASSERT_GE(expected.size(), 8u);
  GenerationRequest request = Greedy("stop", ref_.prompts[p], 20);
  // The third token: the first verify step (after the prefill's token) accepts the drafts up to
  // and past it. (It must not occur earlier in the continuation.)
  ASSERT_EQ(std::count(expected.begin(), expected.begin() + 3, expected[2]), 1);
  request.params.stop_token_ids = {expected[2]};
  ASSERT_TRUE(engine->Enqueue(request, streams.For("stop")).ok());
  const auto r = streams.Wait("stop");
  EXPECT_EQ(r.tokens, std::vector<int32_t>(expected.begin(), expected.begin() + 3));
  EXPECT_GT(metrics.spec_accepted_tokens.Value(), 1);  // the drafts past the stop were accepted
  EXPECT_EQ(metrics.generation_tokens.Value(), 3);
}

// Sampled requests with drafts: each sequence's drafts are verified against its own rows and
// random stream (in parallel across the step's sequences), so seeded outputs do not depend on
// which sequences share a step: one sequence a step and four give the same tokens. Drafts are
// the reference's greedy continuation, so some are accepted and some rejected. Verified on the
// backend (each row's draft checked by Backend::SampleRows, with the uniforms peeked from the
// stream and consumed after the verdict), the tokens are the host verify's too, also for the
// plain draws of a request that does not speculate (logprobs) in the same steps.
TEST_F(EngineTest, SampledSpeculationIsIndependentOfBatching) {
  ReferenceDrafter drafter(ref_);
  auto run = [&](int max_num_seqs, EngineOptions::SamplingPlace place, double& accepted,
                 double& drafted, int64_t& checked_on_backend) {
    auto registry = std::make_shared<prometheus::Registry>();
    EngineMetrics metrics(registry, "tiny", model_->num_banks());
    EngineOptions options;
    options.scheduler.max_num_seqs = max_num_seqs;
    options.sampling_place = place;
    options.max_model_len = 256;
    options.metrics = &metrics;
    options.spec_tokens = 3;
    options.drafter = &drafter;
    std::vector<std::vector<int32_t>> outputs;
    auto engine = Start(options);
    EXPECT_NE(engine, nullptr);
    if (engine == nullptr) return outputs;
    Streams streams;
    const int n = 2 * static_cast<int>(ref_.greedy.size());
    for (int i = 0; i < n; ++i) {
      const auto& [p, expected] = ref_.greedy[i % ref_.greedy.size()];
      GenerationRequest r;
      r.request_id = "s" + std::to_string(i);
      r.prompt = ref_.prompts[p];
      r.params.max_tokens = 16;
      r.params.ignore_eos = true;
      r.params.seed = 70 + i;
      // Low temperatures: the tiny random model's rows are flat, so only near-greedy draws
      // accept the reference's drafts at all.
      r.params.temperature = i % 2 == 0 ? 0.02f : 0.05f;
      if (i % 3 == 1) r.params.top_p = 0.9f;
      if (i % 4 == 3) r.params.presence_penalty = 0.3f;
      if (i % 5 == 2) r.params.top_k = 3;
      if (i == 1) r.params.logprobs = 1;  // does not speculate: plain draws beside the verifies
      EXPECT_TRUE(engine->Enqueue(r, streams.For(r.request_id)).ok());
    }
    for (int i = 0; i < n; ++i) outputs.push_back(streams.Wait("s" + std::to_string(i)).tokens);
    accepted = metrics.spec_accepted_tokens.Value();
    drafted = metrics.spec_draft_tokens.Value();
    checked_on_backend = engine->GetStats().drafts_checked_on_backend;
    return outputs;
  };
  using Place = EngineOptions::SamplingPlace;
  double accepted_one = 0, drafted_one = 0, accepted_four = 0, drafted_four = 0;
  double accepted_backend = 0, drafted_backend = 0;
  int64_t checked_one = 0, checked_four = 0, checked_backend = 0;
  const auto one = run(1, Place::kHost, accepted_one, drafted_one, checked_one);
  const auto four = run(4, Place::kHost, accepted_four, drafted_four, checked_four);
  const auto backend = run(4, Place::kBackend, accepted_backend, drafted_backend, checked_backend);
  EXPECT_EQ(checked_one + checked_four, 0);
  EXPECT_EQ(checked_backend, static_cast<int64_t>(drafted_backend));  // every draft
  ASSERT_EQ(one.size(), four.size());
  ASSERT_EQ(one.size(), backend.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_EQ(one[i].size(), 16u) << "request " << i;
    EXPECT_EQ(one[i], four[i]) << "request " << i;
    EXPECT_EQ(one[i], backend[i]) << "request " << i << ", verified on the backend";
  }
  EXPECT_EQ(accepted_backend, accepted_four);
  EXPECT_GT(drafted_four, 0);
  EXPECT_GT(accepted_four, 0);             // some drafts accepted ...
  EXPECT_LT(accepted_four, drafted_four);  // ... and some rejected
  EXPECT_EQ(accepted_one, accepted_four);
}

// Structured output on the fixture model, which has no tokenizer: PieceVocabulary spells its
// ids; the last id is the end-of-sequence token.
class StructuredOutputEngineTest : public EngineTest {
 protected:
  std::unique_ptr<Engine> StartConstrained(
      bool with_vocabulary = true,
      EngineOptions::SamplingPlace place = EngineOptions::SamplingPlace::kAuto) {
    eos_ = model_->config().vocab_size - 1;
    vocabulary_ = testing::PieceVocabulary(model_->config().vocab_size, eos_);
    EngineOptions options;
    options.eos_token_ids = {eos_};
    options.sampling_place = place;
    if (with_vocabulary) options.vocabulary = vocabulary_;
    return Start(options);
  }
  std::string Text(const std::vector<int32_t>& tokens) const {
    std::string text;
    for (int32_t t : tokens) text += vocabulary_->bytes(t);
    return text;
  }
  GenerationRequest Constrained(const std::string& id, grammar::StructuredOutputSpec spec,
                                float temperature, uint64_t seed) {
    GenerationRequest r = Greedy(id, ref_.prompts[ref_.greedy[0].first], 600);
    r.params.temperature = temperature;
    r.params.seed = seed;
    r.params.structured_output = std::move(spec);
    return r;
  }
  void ExpectOutputsFollowTheSchema(EngineOptions::SamplingPlace place);
  int32_t eos_ = 0;
  std::shared_ptr<const grammar::TokenVocabulary> vocabulary_;
};

TEST_F(StructuredOutputEngineTest, OutputsFollowTheSchema) {
  // On the host, and drawn by the backend (the CPU backend's SampleRows, as CUDA draws): there
  // the masks are computed while the step runs and reach the draws through the rows' penalties
  // (ForwardOptions::before_outputs), so a draw that saw the previous step's mask would break
  // the schema.
  for (auto place : {EngineOptions::SamplingPlace::kHost, EngineOptions::SamplingPlace::kBackend}) {
    SCOPED_TRACE(place == EngineOptions::SamplingPlace::kHost ? "host" : "backend");
    ExpectOutputsFollowTheSchema(place);
  }
}

void StructuredOutputEngineTest::ExpectOutputsFollowTheSchema(EngineOptions::SamplingPlace place) {
  Streams streams;  // outlives the engine, whose shutdown may still deliver
  auto engine = StartConstrained(/*with_vocabulary=*/true, place);
  ASSERT_NE(engine, nullptr);
  grammar::StructuredOutputSpec spec;
  spec.kind = grammar::StructuredOutputSpec::Kind::kJsonSchema;
  spec.json_schema = R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"},
      "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]})";
  // Greedy, and sampled at several seeds, in one batch.
  for (int i = 0; i < 4; ++i) {
    const std::string id = "json" + std::to_string(i);
    ASSERT_TRUE(
        engine->Enqueue(Constrained(id, spec, i == 0 ? 0.0f : 1.0f, i), streams.For(id)).ok());
  }
  for (int i = 0; i < 4; ++i) {
    const auto result = streams.Wait("json" + std::to_string(i));
    const std::string text = Text(result.tokens);
    ASSERT_EQ(result.finish, FinishReason::kStop) << text << " " << result.error;
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_TRUE(j.is_object()) << text;
    ASSERT_EQ(j.size(), 3u) << text;
    EXPECT_TRUE(j["name"].is_string()) << text;
    EXPECT_TRUE(j["age"].is_number_integer()) << text;
    EXPECT_TRUE(j["ok"].is_boolean()) << text;
  }
}

TEST_F(StructuredOutputEngineTest, ChoicesAndJsonObjects) {
  Streams streams;
  auto engine = StartConstrained();
  ASSERT_NE(engine, nullptr);
  grammar::StructuredOutputSpec choice;
  choice.kind = grammar::StructuredOutputSpec::Kind::kChoice;
  choice.choices = {"yes", "no way"};
  grammar::StructuredOutputSpec object;
  object.kind = grammar::StructuredOutputSpec::Kind::kJsonObject;
  ASSERT_TRUE(engine->Enqueue(Constrained("c0", choice, 0, 0), streams.For("c0")).ok());
  ASSERT_TRUE(engine->Enqueue(Constrained("c1", choice, 1, 5), streams.For("c1")).ok());
  GenerationRequest obj = Constrained("o", object, 1, 3);
  obj.params.max_tokens = 40;  // a free-form object may stop by length: it must still be valid
  ASSERT_TRUE(engine->Enqueue(obj, streams.For("o")).ok());
  for (const char* id : {"c0", "c1"}) {
    const auto result = streams.Wait(id);
    const std::string text = Text(result.tokens);
    EXPECT_EQ(result.finish, FinishReason::kStop) << id;
    EXPECT_TRUE(text == "yes" || text == "no way") << id << ": " << text;
  }
  const auto result = streams.Wait("o");
  const std::string text = Text(result.tokens);
  ASSERT_NE(result.finish, FinishReason::kError) << result.error;
  const grammar::Grammar g = grammar::JsonObjectGrammar();
  grammar::GrammarMatcher m(g);
  EXPECT_TRUE(m.FeedBytes(text)) << text;  // a prefix of an object, at least
  if (result.finish == FinishReason::kStop) {
    EXPECT_TRUE(nlohmann::json::parse(text, nullptr, false).is_object()) << text;
  }
}

TEST_F(StructuredOutputEngineTest, RequestsItCannotServeAreRefusedWithReasons) {
  grammar::StructuredOutputSpec spec;
  spec.kind = grammar::StructuredOutputSpec::Kind::kJsonSchema;
  spec.json_schema = R"({"type": "array", "uniqueItems": true})";
  {
    auto engine = StartConstrained();
    ASSERT_NE(engine, nullptr);
    Streams streams;
    const absl::Status s = engine->Enqueue(Constrained("p", spec, 0, 0), streams.For("p"));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("schema.uniqueItems"));
  }
  auto engine = StartConstrained(/*with_vocabulary=*/false);
  ASSERT_NE(engine, nullptr);
  Streams streams;
  spec.json_schema = R"({"type": "string"})";
  const absl::Status s = engine->Enqueue(Constrained("t", spec, 0, 0), streams.For("t"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("--tokenizer"));
}

}  // namespace
}  // namespace mobius::worker
