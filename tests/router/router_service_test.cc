// RouterService over real in-process worker replicas (gRPC on 127.0.0.1): reference outputs,
// routing across replicas, cancellation, retries, validation, admission control, stop strings and
// aborts.
//
// The fixture model (intern-s2-mobius-tiny, vocabulary 2048) ships no tokenizer, and the Qwen3
// tokenizer fixture has 151k ids, so prompts here are token ids. Its ids below 2048 are ordinary
// byte-level BPE tokens, so the Qwen3 tokenizer decodes the model's output to some text: enough
// to test detokenization and stop strings, with expectations computed by Tokenizer::Decode rather
// than by the code under test. Text prompts mostly tokenize to ids >= 2048, which the router must
// refuse as outside the model's vocabulary.
#include "router/core/router_service.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "router/core/bad_words.h"
#include "tests/model/fixture_util.h"
#include "tests/router/router_test_util.h"

namespace mobius::router {
namespace {

using testing::Collected;
using testing::GreedyRequest;
using testing::InProcessWorker;
using testing::RunGenerate;
using testing::WorkerOptions;

std::unique_ptr<const tokenizer::Tokenizer> LoadTokenizer() {
  auto tok =
      tokenizer::Tokenizer::FromDirectory(mobius::testing::FixturesDir() + "/tokenizer-qwen3");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

class RouterServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = mobius::testing::LoadReference(mobius::testing::FixtureModelDir(testing::kModel));
    ASSERT_EQ(ref_.greedy.size(), 3u);
  }

  // Starts `n` workers (kept in workers_) and a router over them, ready to serve.
  void StartRouter(int n, RouterOptions options = {}, WorkerOptions worker_options = {},
                   absl::Duration health_interval = absl::Milliseconds(50)) {
    std::vector<std::string> addresses;
    for (int i = 0; i < n; ++i) {
      workers_.push_back(std::make_unique<InProcessWorker>(worker_options));
      addresses.push_back(workers_.back()->address());
    }
    ReplicaSetOptions replica_options;
    replica_options.health_check_interval = health_interval;
    auto replicas = ReplicaSet::Create(addresses, replica_options);
    ASSERT_TRUE(replicas.ok()) << replicas.status();
    (*replicas)->PollOnce();
    router_ = std::make_unique<RouterService>(std::move(*replicas), LoadTokenizer(), options);
    ASSERT_TRUE(router_->Ready());
  }

  const std::vector<int32_t>& Prompt(int greedy_index) {
    return ref_.prompts[ref_.greedy[greedy_index].first];
  }
  const std::vector<int32_t>& Expected(int greedy_index) {
    return ref_.greedy[greedy_index].second;
  }

  mobius::testing::ModelReference ref_;
  std::vector<std::unique_ptr<InProcessWorker>> workers_;
  std::unique_ptr<RouterService> router_;
};

TEST_F(RouterServiceTest, GreedyOutputsMatchTheReference) {
  StartRouter(1);
  auto tok = LoadTokenizer();
  for (int g = 0; g < 3; ++g) {
    const std::vector<int32_t>& expected = Expected(g);
    Collected c = RunGenerate(*router_, GreedyRequest(Prompt(g), expected.size()));
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.tokens, expected) << "greedy case " << g;
    EXPECT_EQ(c.completes, 1);
    EXPECT_FALSE(c.message_after_complete);
    EXPECT_EQ(c.complete.finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(c.complete.usage().prompt_tokens(), static_cast<int>(Prompt(g).size()));
    EXPECT_EQ(c.complete.usage().completion_tokens(), static_cast<int>(expected.size()));
    // The streamed text is the tokenizer's decode of the output (special tokens skipped).
    tokenizer::DecodeOptions decode;
    decode.skip_special_tokens = true;
    EXPECT_EQ(c.text, *tok->Decode(expected, decode));
    // router-<prefix drawn at start>-<n>: ids do not repeat across routers or restarts.
    const std::string& id = c.request_id;
    const bool shaped =
        id.size() >= 17 && id.rfind("router-", 0) == 0 && id[15] == '-' &&
        std::all_of(id.begin() + 7, id.begin() + 15, [](char ch) { return std::isxdigit(ch); }) &&
        std::all_of(id.begin() + 16, id.end(), [](char ch) { return std::isdigit(ch); });
    EXPECT_TRUE(shaped) << id;
  }
}

// With a tokenizer the router adds each logprob entry's token bytes (the chosen token's and the
// top ones'), so that front ends can show the tokens: the tokenizer's own bytes of each id.
TEST_F(RouterServiceTest, LogprobsCarryTheTokensBytes) {
  StartRouter(1);
  auto tok = LoadTokenizer();
  v1::GenerateRequest request = GreedyRequest(Prompt(0), 4);
  request.mutable_sampling_params()->set_logprobs(2);
  std::vector<v1::OutputLogprobs> entries;
  std::vector<int32_t> ids;
  Collected c = RunGenerate(*router_, request, nullptr, [&](const v1::TextChunk& chunk) {
    for (int k = 0; k < chunk.logprobs_size(); ++k) {
      entries.push_back(chunk.logprobs(k));
      ids.push_back(chunk.token_ids(k));
    }
  });
  ASSERT_TRUE(c.status.ok()) << c.status;
  ASSERT_EQ(entries.size(), 4u);
  for (size_t k = 0; k < entries.size(); ++k) {
    ASSERT_TRUE(entries[k].has_token_bytes()) << k;
    EXPECT_EQ(entries[k].token_bytes(), std::string(*tok->TokenBytes(ids[k]))) << k;
    ASSERT_EQ(entries[k].top_size(), 2) << k;
    for (const v1::TokenLogprob& t : entries[k].top()) {
      ASSERT_TRUE(t.has_token_bytes()) << k;
      EXPECT_EQ(t.token_bytes(), std::string(*tok->TokenBytes(t.token_id()))) << k;
    }
  }
}

TEST_F(RouterServiceTest, SixteenConcurrentStreamsUseBothReplicasAndFinish) {
  StartRouter(2);
  constexpr int kStreams = 16;
  std::vector<Collected> results(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest request = GreedyRequest(Prompt(i % 3), 24);
      request.set_request_id("concurrent-" + std::to_string(i));
      results[i] = RunGenerate(*router_, request);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status;
    EXPECT_EQ(results[i].completes, 1);
    EXPECT_EQ(results[i].tokens.size(), 24u);
    EXPECT_EQ(results[i].request_id, "concurrent-" + std::to_string(i));
  }
  const std::vector<ReplicaSnapshot> replicas = router_->replicas().Snapshot();
  ASSERT_EQ(replicas.size(), 2u);
  for (const ReplicaSnapshot& r : replicas) {
    EXPECT_GT(r.requests_sent, 0) << r.address;
    EXPECT_EQ(r.outstanding_tokens, 0) << r.address;
  }
  EXPECT_EQ(replicas[0].requests_sent + replicas[1].requests_sent, kStreams);
  for (auto& w : workers_) {
    const v1::GetLoadsResponse loads = w->Loads();
    EXPECT_EQ(loads.num_running(), 0);
    EXPECT_EQ(loads.num_waiting(), 0);
  }
  EXPECT_EQ(router_->in_flight(), 0);
}

TEST_F(RouterServiceTest, CancellationMidStreamFreesTheWorker) {
  StartRouter(1);
  std::atomic<bool> cancelled{false};
  int chunks = 0;
  Collected c =
      RunGenerate(*router_, GreedyRequest(Prompt(0), 3000), &cancelled, [&](const v1::TextChunk&) {
        if (++chunks == 2) cancelled.store(true);
      });
  EXPECT_EQ(c.status.code(), absl::StatusCode::kCancelled) << c.status;
  EXPECT_EQ(c.completes, 0);
  EXPECT_LT(c.tokens.size(), 3000u);
  EXPECT_TRUE(workers_[0]->WaitIdle(1000)) << "the worker still runs the cancelled request";
  EXPECT_EQ(router_->replicas().Snapshot()[0].outstanding_tokens, 0);
}

TEST_F(RouterServiceTest, DeadReplicaBeforeFirstTokenIsRetriedOnTheOther) {
  // Health checks far apart, so the router still believes the dead replica is healthy.
  StartRouter(2, {}, {}, absl::Hours(1));
  workers_[0]->Kill();
  // Ties go round-robin, so one of the first two requests is sent to the dead replica first.
  for (int i = 0; i < 2; ++i) {
    Collected c = RunGenerate(*router_, GreedyRequest(Prompt(1), 24));
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.tokens, Expected(1));
    EXPECT_EQ(c.completes, 1);
  }
  const std::vector<ReplicaSnapshot> replicas = router_->replicas().Snapshot();
  EXPECT_EQ(replicas[0].requests_sent, 1);  // tried once, then skipped as unhealthy
  EXPECT_FALSE(replicas[0].healthy);
  EXPECT_EQ(replicas[1].requests_sent, 2);
  EXPECT_TRUE(router_->Ready());
}

TEST_F(RouterServiceTest, ReplicaDyingAfterTokensIsUnavailable) {
  StartRouter(2, {}, {}, absl::Hours(1));
  std::atomic<bool> killed{false};
  std::thread killer;
  const int picked_before = router_->replicas().Snapshot()[0].requests_sent;
  Collected c =
      RunGenerate(*router_, GreedyRequest(Prompt(0), 3000), nullptr, [&](const v1::TextChunk&) {
        if (killed.exchange(true)) return;
        const int victim = router_->replicas().Snapshot()[0].requests_sent > picked_before ? 0 : 1;
        killer = std::thread([this, victim] { workers_[victim]->Kill(); });
      });
  killer.join();
  EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
  EXPECT_NE(c.status.message().find("after"), std::string::npos) << c.status;
  EXPECT_EQ(c.completes, 0);
  EXPECT_GT(c.tokens.size(), 0u);
}

TEST_F(RouterServiceTest, ValidationErrorsNameTheField) {
  WorkerOptions worker_options;
  worker_options.max_model_len = 64;
  StartRouter(1, {}, worker_options);
  struct Case {
    std::string name;
    std::function<void(v1::GenerateRequest&)> mutate;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"no input", [](v1::GenerateRequest& r) { r.clear_input(); }, "input_ids"},
      {"empty ids", [](v1::GenerateRequest& r) { r.mutable_input_ids()->clear_ids(); },
       "input_ids is empty"},
      {"empty text", [](v1::GenerateRequest& r) { r.set_text(""); }, "text is empty"},
      {"id outside vocab", [](v1::GenerateRequest& r) { r.mutable_input_ids()->add_ids(2048); },
       "input_ids: token 2048"},
      {"negative id", [](v1::GenerateRequest& r) { r.mutable_input_ids()->set_ids(0, -1); },
       "input_ids: token -1"},
      {"text outside vocab", [](v1::GenerateRequest& r) { r.set_text("Hello, world"); },
       "text: token"},
      {"prompt too long",
       [](v1::GenerateRequest& r) {
         r.mutable_input_ids()->clear_ids();
         for (int i = 0; i < 64; ++i) r.mutable_input_ids()->add_ids(5);
       },
       "input_ids has 64 tokens"},
      {"max_tokens negative",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_max_tokens(-1); },
       "sampling_params.max_tokens"},
      {"max_tokens above context",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_max_tokens(65); },
       "sampling_params.max_tokens = 65"},
      {"temperature NaN",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_temperature(std::nanf("")); },
       "sampling_params.temperature"},
      {"temperature negative",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_temperature(-0.5f); },
       "sampling_params.temperature"},
      {"top_p zero", [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_top_p(0); },
       "sampling_params.top_p"},
      {"top_p above one",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_top_p(1.5f); },
       "sampling_params.top_p"},
      {"top_k below -1", [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_top_k(-2); },
       "sampling_params.top_k"},
      {"stop token outside vocab",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->add_stop_token_ids(5000); },
       "sampling_params.stop_token_ids[0]"},
      {"empty stop string",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->add_stop(""); },
       "sampling_params.stop[0]"},
      {"logit_bias token outside vocab",
       [](v1::GenerateRequest& r) {
         (*r.mutable_sampling_params()->mutable_logit_bias())[5000] = 1;
       },
       "sampling_params.logit_bias names token 5000"},
      {"logit_bias too large",
       [](v1::GenerateRequest& r) {
         (*r.mutable_sampling_params()->mutable_logit_bias())[3] = 150;
       },
       "sampling_params.logit_bias[3] = 150"},
      {"min_tokens above max_tokens",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_min_tokens(5); },
       "sampling_params.min_tokens = 5 is invalid: it exceeds max_tokens 4"},
  };
  for (const Case& test : cases) {
    v1::GenerateRequest request = GreedyRequest({1, 2, 3}, 4);
    test.mutate(request);
    Collected c = RunGenerate(*router_, request);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << test.name << ": " << c.status;
    EXPECT_NE(c.status.message().find(test.expected), std::string::npos)
        << test.name << ": " << c.status;
    EXPECT_EQ(c.chunks + c.completes, 0) << test.name;
    // The field rides along as a payload, for front ends to name in their own spelling.
    if (test.name != "no input") {
      std::string field(test.expected);
      if (field.rfind("sampling_params.", 0) == 0) field = field.substr(16);
      field = field.substr(0, field.find_first_of(" :[="));
      EXPECT_EQ(RequestFieldOf(c.status), field) << test.name << ": " << c.status;
    }
  }
  // Boundary values are accepted.
  v1::GenerateRequest ok = GreedyRequest({1, 2, 3}, 4);
  ok.mutable_sampling_params()->set_top_p(1);
  ok.mutable_sampling_params()->set_top_k(-1);
  EXPECT_TRUE(RunGenerate(*router_, ok).status.ok());
}

TEST_F(RouterServiceTest, PromptPlusMaxTokensIsCappedToTheContext) {
  WorkerOptions worker_options;
  worker_options.max_model_len = 64;
  StartRouter(1, {}, worker_options);
  std::vector<int32_t> prompt(60, 7);
  Collected c = RunGenerate(*router_, GreedyRequest(prompt, 64));
  ASSERT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(c.tokens.size(), 4u);
  EXPECT_EQ(c.complete.finish_reason(), v1::FINISH_REASON_LENGTH);
}

TEST_F(RouterServiceTest, OverloadIsResourceExhaustedWithRetryHintAndAbortEndsTheStream) {
  RouterOptions options;
  options.max_queued_requests = 1;
  StartRouter(1, options);
  absl::Notification streaming;
  Collected first;
  std::thread t([&] {
    v1::GenerateRequest request = GreedyRequest(Prompt(0), 3000);
    request.set_request_id("long");
    first = RunGenerate(*router_, request, nullptr, [&](const v1::TextChunk&) {
      if (!streaming.HasBeenNotified()) streaming.Notify();
    });
  });
  streaming.WaitForNotification();
  Collected rejected = RunGenerate(*router_, GreedyRequest(Prompt(1), 4));
  EXPECT_EQ(rejected.status.code(), absl::StatusCode::kResourceExhausted) << rejected.status;
  EXPECT_NE(rejected.status.message().find("retry after"), std::string::npos) << rejected.status;

  v1::AbortRequest abort;
  abort.set_request_id("long");
  auto aborted = router_->Abort(abort);
  ASSERT_TRUE(aborted.ok());
  EXPECT_TRUE(aborted->found());
  t.join();
  ASSERT_TRUE(first.status.ok()) << first.status;
  EXPECT_EQ(first.complete.finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_EQ(first.complete.usage().completion_tokens(), static_cast<int>(first.tokens.size()));
  EXPECT_TRUE(workers_[0]->WaitIdle(1000));
  for (int i = 0; i < 100 && workers_[0]->abort_calls().empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(workers_[0]->abort_calls(), std::vector<std::string>{"long"});

  abort.set_request_id("unknown");
  EXPECT_FALSE(router_->Abort(abort)->found());
  // The slot is free again.
  EXPECT_TRUE(RunGenerate(*router_, GreedyRequest(Prompt(1), 4)).status.ok());
}

TEST_F(RouterServiceTest, StopStringTruncatesTheTextAndEndsTheRequest) {
  StartRouter(1);
  auto tok = LoadTokenizer();
  const std::vector<int32_t>& expected = Expected(0);
  tokenizer::DecodeOptions decode;
  decode.skip_special_tokens = true;
  const std::string full = *tok->Decode(expected, decode);
  // A stop string from the middle of the reference output: two characters starting at the
  // first character boundary after the midpoint.
  size_t begin = full.size() / 2;
  auto is_continuation = [&](size_t i) { return (static_cast<uint8_t>(full[i]) & 0xC0) == 0x80; };
  while (begin < full.size() && is_continuation(begin)) ++begin;
  size_t end = begin;
  for (int chars = 0; chars < 2 && end < full.size(); ++chars) {
    ++end;
    while (end < full.size() && is_continuation(end)) ++end;
  }
  const std::string stop = full.substr(begin, end - begin);
  ASSERT_FALSE(stop.empty());
  const size_t match = full.find(stop);
  // The first k ids whose decode contains the stop string.
  size_t k = 1;
  while (k <= expected.size() &&
         tok->Decode(absl::MakeConstSpan(expected).first(k), decode)->find(stop) ==
             std::string::npos) {
    ++k;
  }
  ASSERT_LE(k, expected.size());

  v1::GenerateRequest request = GreedyRequest(Prompt(0), 200);
  request.mutable_sampling_params()->add_stop("never appears \xe2\x9c\x93");
  request.mutable_sampling_params()->add_stop(stop);
  request.set_request_id("stopped");
  Collected c = RunGenerate(*router_, request);
  ASSERT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(c.text, full.substr(0, match)) << "stop \"" << stop << "\"";
  EXPECT_EQ(c.complete.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(c.complete.matched_string(), stop);
  EXPECT_EQ(c.tokens, std::vector<int32_t>(expected.begin(), expected.begin() + k));
  EXPECT_EQ(c.complete.usage().completion_tokens(), static_cast<int>(k));
  EXPECT_TRUE(workers_[0]->WaitIdle(1000));
  // The router asked the worker to abort the request (not only cancelled its stream).
  for (int i = 0; i < 100 && workers_[0]->abort_calls().empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(workers_[0]->abort_calls(), std::vector<std::string>{"stopped"});

  // include_stop_str_in_output: the same tokens, the text through the end of the stop string.
  request.mutable_sampling_params()->set_include_stop_str_in_output(true);
  request.set_request_id("stopped-including");
  Collected included = RunGenerate(*router_, request);
  ASSERT_TRUE(included.status.ok()) << included.status;
  EXPECT_EQ(included.text, full.substr(0, match + stop.size()));
  EXPECT_EQ(included.complete.matched_string(), stop);
  EXPECT_EQ(included.tokens, c.tokens);

  // min_tokens = k: stop strings match only once the output is longer than k tokens (vLLM v1),
  // so the one completed by token k does not, and the text runs on through it.
  request.mutable_sampling_params()->clear_include_stop_str_in_output();
  request.mutable_sampling_params()->set_min_tokens(static_cast<int>(k));
  request.mutable_sampling_params()->set_max_tokens(static_cast<int>(k) + 1);
  request.set_request_id("stopped-later");
  Collected later = RunGenerate(*router_, request);
  ASSERT_TRUE(later.status.ok()) << later.status;
  EXPECT_EQ(later.tokens.size(), k + 1);
  EXPECT_EQ(later.text.substr(0, match + stop.size()), full.substr(0, match + stop.size()));
  // min_tokens = k - 1: token k may stop the output, and does when the stop string lies within
  // its text (one that began in the text before the boundary is not matched: a documented
  // difference from vLLM).
  const std::string before_k =
      k >= 2 ? *tok->Decode(absl::MakeConstSpan(expected).first(k - 1), decode) : std::string();
  if (k >= 2 && before_k.size() <= match) {
    request.mutable_sampling_params()->set_min_tokens(static_cast<int>(k) - 1);
    request.mutable_sampling_params()->set_max_tokens(200);
    request.set_request_id("stopped-at-k");
    Collected at_k = RunGenerate(*router_, request);
    ASSERT_TRUE(at_k.status.ok()) << at_k.status;
    EXPECT_EQ(at_k.text, full.substr(0, match));
    EXPECT_EQ(at_k.complete.matched_string(), stop);
    EXPECT_EQ(at_k.tokens.size(), k);
  }
}

TEST_F(RouterServiceTest, TokenizeModelInfoAndDrain) {
  RouterOptions options;
  options.served_model_name = "mobius-tiny";
  StartRouter(1, options);
  v1::TokenizeRequest tokenize;
  tokenize.set_text("Hello world");
  auto ids = router_->Tokenize(tokenize);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*LoadTokenizer()->Encode("Hello world"),
            std::vector<int32_t>(ids->ids().begin(), ids->ids().end()));
  // Detokenize inverts it; special tokens keep their text unless asked to be skipped.
  v1::DetokenizeRequest detokenize;
  *detokenize.mutable_ids() = ids->ids();
  const std::optional<int32_t> im_end = LoadTokenizer()->TokenToId("<|im_end|>");
  ASSERT_TRUE(im_end.has_value());
  detokenize.add_ids(*im_end);
  auto text = router_->Detokenize(detokenize);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->text(), "Hello world<|im_end|>");
  detokenize.set_skip_special_tokens(true);
  EXPECT_EQ(router_->Detokenize(detokenize)->text(), "Hello world");
  detokenize.add_ids(-3);
  const absl::Status bad = router_->Detokenize(detokenize).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RequestFieldOf(bad), "ids");
  EXPECT_NE(bad.message().find("ids[3] = -3"), std::string::npos) << bad;
  auto info = router_->GetModelInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->model_name(), "mobius-tiny");
  EXPECT_EQ(info->vocab_size(), 2048);
  EXPECT_EQ(info->max_context_length(), 4096);

  router_->StartDrain();
  EXPECT_FALSE(router_->Ready());
  Collected c = RunGenerate(*router_, GreedyRequest(Prompt(1), 4));
  EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
  EXPECT_TRUE(router_->WaitUntilIdle(absl::Now() + absl::Seconds(1)));
}

// truncate_prompt_tokens keeps the prompt's last N tokens: the output is the shorter prompt's,
// and usage counts what was kept; -1 keeps what the context holds; 0 is refused here.
TEST_F(RouterServiceTest, TruncatePromptTokensKeepsTheEnd) {
  StartRouter(1);
  std::vector<int32_t> long_prompt = {11, 12, 13, 14, 15, 16};
  const std::vector<int32_t>& tail = Prompt(1);
  long_prompt.insert(long_prompt.end(), tail.begin(), tail.end());
  v1::GenerateRequest request = GreedyRequest(long_prompt, 24);
  request.set_truncate_prompt_tokens(static_cast<int32_t>(tail.size()));
  Collected truncated = RunGenerate(*router_, request);
  ASSERT_TRUE(truncated.status.ok()) << truncated.status;
  EXPECT_EQ(truncated.tokens, Expected(1));
  EXPECT_EQ(truncated.complete.usage().prompt_tokens(), static_cast<int>(tail.size()));
  request.set_truncate_prompt_tokens(-1);  // the context (4096) holds it all
  Collected whole = RunGenerate(*router_, request);
  ASSERT_TRUE(whole.status.ok()) << whole.status;
  EXPECT_EQ(whole.complete.usage().prompt_tokens(), static_cast<int>(long_prompt.size()));
  request.set_truncate_prompt_tokens(0);
  const absl::Status zero = RunGenerate(*router_, request).status;
  EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RequestFieldOf(zero), "truncate_prompt_tokens");
}

// bad_words as text: the router tokenizes each word (vLLM's variants, BadWordSequences) and the
// worker bans it. A word spelling the greedy continuation's first two tokens keeps the first and
// changes the second; without a tokenizer the field is refused by name.
TEST_F(RouterServiceTest, BadWordsAreTokenizedAndAvoided) {
  StartRouter(1);
  auto tok = LoadTokenizer();
  const std::vector<int32_t>& expected = Expected(0);
  const std::vector<int32_t> pair = {expected[0], expected[1]};
  absl::StatusOr<std::string> word = tok->Decode(pair);
  ASSERT_TRUE(word.ok()) << word.status();
  absl::StatusOr<std::vector<std::vector<int32_t>>> sequences = BadWordSequences(*tok, *word);
  ASSERT_TRUE(sequences.ok()) << sequences.status();
  // The fixture's continuation re-encodes to itself, as written or after a space.
  ASSERT_TRUE(std::find(sequences->begin(), sequences->end(), pair) != sequences->end())
      << "\"" << *word << "\" does not re-encode to its tokens";

  v1::GenerateRequest request = GreedyRequest(Prompt(0), 4);
  request.mutable_sampling_params()->add_bad_words(*word);
  Collected c = RunGenerate(*router_, request);
  ASSERT_TRUE(c.status.ok()) << c.status;
  ASSERT_EQ(c.tokens.size(), 4u);
  EXPECT_EQ(c.tokens[0], expected[0]);
  EXPECT_NE(c.tokens[1], expected[1]);

  request.mutable_sampling_params()->set_bad_words(0, " \t");
  const absl::Status blank = RunGenerate(*router_, request).status;
  EXPECT_EQ(blank.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RequestFieldOf(blank), "bad_words");

  workers_.push_back(std::make_unique<InProcessWorker>());
  auto replicas = ReplicaSet::Create({workers_.back()->address()}, {});
  ASSERT_TRUE(replicas.ok());
  (*replicas)->PollOnce();
  RouterService no_tokenizer(std::move(*replicas), nullptr, {});
  request.mutable_sampling_params()->set_bad_words(0, *word);
  const absl::Status refused = RunGenerate(no_tokenizer, request).status;
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RequestFieldOf(refused), "bad_words");
}

TEST(BadWordSequencesTest, FollowVllmsVariants) {
  auto tok = LoadTokenizer();
  ASSERT_NE(tok, nullptr);
  // "hello" and " hello" are one token each, different ones: both are banned.
  absl::StatusOr<std::vector<std::vector<int32_t>>> hello = BadWordSequences(*tok, "  hello");
  ASSERT_TRUE(hello.ok()) << hello.status();
  ASSERT_EQ(hello->size(), 2u);
  EXPECT_EQ((*hello)[0], *tok->Encode("hello"));
  EXPECT_EQ((*hello)[1], *tok->Encode(" hello"));
  EXPECT_FALSE(BadWordSequences(*tok, " \n").ok());
}

TEST_F(RouterServiceTest, WithoutTokenizerIdsWorkAndTextIsRefused) {
  workers_.push_back(std::make_unique<InProcessWorker>());
  auto replicas = ReplicaSet::Create({workers_[0]->address()}, {});
  ASSERT_TRUE(replicas.ok());
  (*replicas)->PollOnce();
  RouterService router(std::move(*replicas), nullptr, {});
  Collected c = RunGenerate(router, GreedyRequest(Prompt(1), 24));
  ASSERT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(c.tokens, Expected(1));
  EXPECT_EQ(c.text, "");
  v1::GenerateRequest text;
  text.set_text("hi");
  c = RunGenerate(router, text);
  EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status.message().find("--tokenizer"), std::string::npos);
  EXPECT_EQ(router.Tokenize(v1::TokenizeRequest()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(router.Detokenize(v1::DetokenizeRequest()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(RouterServiceTest, NoHealthyReplicaIsUnavailable) {
  StartRouter(1, {}, {}, absl::Milliseconds(20));
  workers_[0]->Kill();
  for (int i = 0; i < 200 && router_->Ready(); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_FALSE(router_->Ready());
  Collected c = RunGenerate(*router_, GreedyRequest(Prompt(1), 4));
  EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
}

}  // namespace
}  // namespace mobius::router
