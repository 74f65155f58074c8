// The serving issue's acceptance, as real processes on loopback: mobius-worker replicas of the
// intern-s2-mobius-tiny fixture behind one mobius-router, driven over gRPC and the OpenAI HTTP
// API. The fixture's vocabulary (2048) is smaller than any tokenizer's, so prompts are token ids
// and HTTP outputs are read from the `logprobs` token labels.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/e2e/serving_deployment.h"
#include "tests/util/http_client.h"

namespace mobius::testing {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace http = boost::beast::http;

// Distinct prompts of different lengths, all inside the fixture's vocabulary.
std::vector<std::vector<int32_t>> Prompts(int n) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p;
    for (int k = 0; k < 3 + i; ++k) p.push_back((97 * i + 31 * k + 5) % 2048);
    prompts.push_back(std::move(p));
  }
  return prompts;
}

std::string Series(const std::string& name, const std::string& labels) {
  return labels.empty() ? name : absl::StrCat(name, "{", labels, "}");
}

double Value(const std::string& exposition, const std::string& series) {
  return SeriesValue(exposition, series).value_or(-1);
}

std::string Requests(const std::string& protocol, const std::string& code) {
  return absl::StrCat("mobius_router_requests_total{code=\"", code, "\",protocol=\"", protocol,
                      "\"}");
}

const std::string kModelLabel = absl::StrCat("model_name=\"", kServedModel, "\"");

// 64 streams over the OpenAI endpoint and 64 over gRPC at once, over two replicas: all complete
// with `mobius generate`'s greedy ids, both replicas work, and afterwards both are idle with
// every KV block and state slot free.
TEST(ServingAcceptanceTest, ConcurrentHttpAndGrpcStreamsOverTwoReplicasMatchMobiusGenerate) {
  constexpr int kPerProtocol = 64;
  constexpr int kMaxTokens = 8;
  const std::vector<std::vector<int32_t>> prompts = Prompts(8);
  std::vector<std::vector<int32_t>> expected;
  for (const auto& p : prompts) expected.push_back(MobiusGenerate(p, kMaxTokens));
  for (const auto& e : expected) ASSERT_EQ(e.size(), static_cast<size_t>(kMaxTokens));

  Deployment d({.workers = 2, .worker_flags = {"--max-model-len=256"}});
  ASSERT_TRUE(d.ready());
  std::vector<HttpOutcome> http_out(kPerProtocol);
  std::vector<GrpcOutcome> grpc_out(kPerProtocol);
  std::vector<std::thread> clients;
  for (int i = 0; i < kPerProtocol; ++i) {
    clients.emplace_back([&, i] {
      http_out[i] = HttpStreamCompletion(d.http_port(), CompletionBody(prompts[i % 8], kMaxTokens));
    });
    clients.emplace_back([&, i] {
      grpc_out[i] = GrpcGenerate(d.inference(), GreedyRequest(prompts[(i + 3) % 8], kMaxTokens));
    });
  }
  for (std::thread& t : clients) t.join();

  for (int i = 0; i < kPerProtocol; ++i) {
    const HttpOutcome& h = http_out[i];
    EXPECT_EQ(h.status, 200) << "http " << i;
    EXPECT_FALSE(h.error.has_value()) << "http " << i << ": " << h.error->dump();
    EXPECT_TRUE(h.done) << "http " << i;
    EXPECT_EQ(h.finish_reason, "length") << "http " << i;
    EXPECT_EQ(h.tokens, expected[i % 8]) << "http " << i;
    const GrpcOutcome& g = grpc_out[i];
    EXPECT_TRUE(g.status.ok()) << "grpc " << i << ": " << g.status.error_message();
    EXPECT_TRUE(g.completed) << "grpc " << i;
    EXPECT_EQ(g.tokens, expected[(i + 3) % 8]) << "grpc " << i;
  }
  // Both replicas did work (as the workers themselves count it), and are idle now.
  for (int w = 0; w < 2; ++w) {
    const std::string metrics = d.WorkerMetrics(w);
    EXPECT_GT(Value(metrics, Series("vllm:generation_tokens_total", kModelLabel)), 0)
        << "replica " << w << " got no work";
    EXPECT_TRUE(d.WaitWorkerIdle(w, 2000)) << "replica " << w << " still holds resources";
    const v1::GetLoadsResponse loads = d.Loads(w);
    EXPECT_EQ(loads.num_running(), 0);
    EXPECT_EQ(loads.kv_cache_usage(), 0);
    EXPECT_EQ(loads.state_slot_usage(), 0);
    const std::string after = d.WorkerMetrics(w);
    EXPECT_EQ(Value(after, Series("vllm:num_requests_running", kModelLabel)), 0);
    EXPECT_EQ(Value(after, Series("vllm:kv_cache_usage_perc", kModelLabel)), 0);
    EXPECT_EQ(Value(after, Series("mobius_state_slot_usage_perc", kModelLabel)), 0);
  }
  const std::string router = d.RouterMetrics();
  EXPECT_EQ(Value(router, Requests("http", "OK")), kPerProtocol);
  EXPECT_EQ(Value(router, Requests("grpc", "OK")), kPerProtocol);
  EXPECT_EQ(Value(router, Series("vllm:generation_tokens_total", kModelLabel)),
            2 * kPerProtocol * kMaxTokens);
  EXPECT_EQ(Value(router, "mobius_router_requests_in_flight"), 0);
}

// A client that cancels (gRPC) or disconnects (HTTP) mid-stream frees the worker's slot, KV
// blocks and state slot before the worker runs another step. Steps are slowed to 150 ms, far
// longer than the cancellation takes to travel, so "within one step" is observable: the
// worker's step counter advances by at most the step that was running when the client left.
TEST(ServingAcceptanceTest, CancellationFreesTheWorkerWithinOneStep) {
  constexpr int kStepMs = 150;
  Deployment d({.workers = 1, .worker_flags = {"--max-model-len=256"}, .step_delay_ms = kStepMs});
  ASSERT_TRUE(d.ready());
  const std::string steps = Series("mobius_engine_steps_total", kModelLabel);
  auto expect_freed_within_one_step = [&](const std::string& what, double steps_at_cancel,
                                          Clock::time_point cancelled_at) {
    ASSERT_TRUE(d.WaitWorkerIdle(0, 5000)) << what << ": the worker still runs the request";
    const double elapsed_ms =
        std::chrono::duration<double, std::milli>(Clock::now() - cancelled_at).count();
    const double steps_after = Value(d.WorkerMetrics(0), steps);
    EXPECT_LE(steps_after - steps_at_cancel, 1) << what;
    EXPECT_LT(elapsed_ms, 3 * kStepMs) << what;
    std::printf("%s: freed after %.0f ms, %.0f more steps\n", what.c_str(), elapsed_ms,
                steps_after - steps_at_cancel);
  };

  {
    grpc::ClientContext context;
    double steps_at_cancel = 0;
    Clock::time_point cancelled_at;
    GrpcOutcome g = GrpcGenerate(d.inference(), GreedyRequest(Prompts(1)[0], 200), &context,
                                 [&](const std::vector<int32_t>& tokens) {
                                   if (tokens.size() != 2) return;
                                   steps_at_cancel = Value(d.WorkerMetrics(0), steps);
                                   cancelled_at = Clock::now();
                                   context.TryCancel();
                                 });
    EXPECT_EQ(g.status.error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_FALSE(g.completed);
    expect_freed_within_one_step("gRPC cancel", steps_at_cancel, cancelled_at);
  }
  {
    SseStream stream(d.http_port(), "/v1/completions", CompletionBody(Prompts(2)[1], 200).dump());
    ASSERT_EQ(stream.status(), 200);
    std::vector<int32_t> tokens;
    while (tokens.size() < 2) {
      std::optional<std::string> data = stream.Next();
      ASSERT_TRUE(data.has_value());
      AppendChunkTokens(Json::parse(*data, nullptr, false), tokens);
    }
    const double steps_at_cancel = Value(d.WorkerMetrics(0), steps);
    const Clock::time_point cancelled_at = Clock::now();
    stream.Close();
    expect_freed_within_one_step("HTTP disconnect", steps_at_cancel, cancelled_at);
  }
  const std::string router = d.RouterMetrics();
  EXPECT_EQ(Value(router, Requests("grpc", "CANCELLED")), 1);
  EXPECT_EQ(Value(router, Requests("http", "CANCELLED")), 1);
}

// SIGKILL of a replica while requests run on both: its requests that had produced no token are
// retried on the other replica and complete with the reference output; its streaming ones end
// with UNAVAILABLE (HTTP: an error event, then [DONE]); new requests go to the survivor; and
// once the worker is back on the same port, health checks bring it back and it gets work again.
TEST(ServingAcceptanceTest, KilledReplicaRetriesUnstartedRequestsAndComesBack) {
  constexpr int kMaxTokens = 20;
  const std::vector<int32_t> prompt = Prompts(4)[3];
  const std::vector<int32_t> expected = MobiusGenerate(prompt, kMaxTokens);
  // Two sequences at a time per worker, so that later requests wait there without a token.
  Deployment d({.workers = 2,
                .worker_flags = {"--max-model-len=256", "--max-num-seqs=2"},
                .step_delay_ms = 40});
  ASSERT_TRUE(d.ready());
  auto requests_sent = [&](int replica) {
    return Value(d.RouterMetrics(), absl::StrCat("mobius_router_replica_requests_total{replica=\"",
                                                 d.worker_address(replica), "\"}"));
  };

  struct Call {
    bool http = false;
    int replica = -1;
    std::atomic<int> tokens{0};
    int tokens_at_kill = -1;
    HttpOutcome h;
    GrpcOutcome g;
  };
  constexpr int kCalls = 8;
  std::vector<std::unique_ptr<Call>> calls;
  std::vector<std::thread> threads;
  // Placed one at a time (HTTP, HTTP, gRPC, gRPC, ...), each one's replica read from the
  // router's per-replica counter, so that both kinds run and wait on both replicas.
  for (int k = 0; k < kCalls; ++k) {
    auto call = std::make_unique<Call>();
    Call* c = call.get();
    c->http = (k / 2) % 2 == 0;
    const double before[2] = {requests_sent(0), requests_sent(1)};
    threads.emplace_back([&d, c, &prompt] {
      auto on_chunk = [c](const std::vector<int32_t>& t) { c->tokens.store(t.size()); };
      if (c->http) {
        c->h = HttpStreamCompletion(d.http_port(), CompletionBody(prompt, kMaxTokens), on_chunk);
      } else {
        c->g = GrpcGenerate(d.inference(), GreedyRequest(prompt, kMaxTokens), nullptr, on_chunk);
      }
    });
    for (int i = 0; i < 200 && c->replica < 0; ++i) {
      for (int r = 0; r < 2; ++r) {
        if (requests_sent(r) > before[r]) c->replica = r;
      }
      if (c->replica < 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_GE(c->replica, 0) << "request " << k << " was never placed";
    calls.push_back(std::move(call));
  }
  const int victim = calls[0]->replica;
  // The first two requests on each replica run; wait until each has streamed a token.
  for (int r = 0; r < 2; ++r) {
    int seen = 0;
    for (auto& c : calls) {
      if (c->replica != r || seen++ >= 2) continue;
      for (int i = 0; i < 500 && c->tokens.load() == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  }
  for (auto& c : calls) c->tokens_at_kill = c->tokens.load();
  d.KillWorker(victim);
  const auto killed_at = Clock::now();

  // A new request right away is served (by the survivor, the only one alive).
  GrpcOutcome fresh = GrpcGenerate(d.inference(), GreedyRequest(prompt, kMaxTokens));
  EXPECT_TRUE(fresh.status.ok()) << fresh.status.error_message();
  EXPECT_EQ(fresh.tokens, expected);
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(d.WaitReplicaHealth(victim, false, 2000));

  int streaming_http = 0, streaming_grpc = 0, retried = 0;
  for (size_t k = 0; k < calls.size(); ++k) {
    const Call& c = *calls[k];
    const std::string what =
        absl::StrCat("request ", k, c.http ? " (http)" : " (grpc)", " on replica ", c.replica, ", ",
                     c.tokens_at_kill, " tokens at the kill");
    if (c.replica == victim && c.tokens_at_kill > 0) {
      if (c.http) {
        ++streaming_http;
        EXPECT_EQ(c.h.status, 200) << what;
        ASSERT_TRUE(c.h.error.has_value()) << what;
        EXPECT_TRUE(
            absl::StrContains((*c.h.error)["error"]["message"].get<std::string>(), "failed after"))
            << what << ": " << c.h.error->dump();
        EXPECT_TRUE(c.h.done) << what;
        EXPECT_LT(c.h.tokens.size(), static_cast<size_t>(kMaxTokens)) << what;
      } else {
        ++streaming_grpc;
        EXPECT_EQ(c.g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << what;
        EXPECT_FALSE(c.g.completed) << what;
      }
      continue;
    }
    if (c.replica == victim) ++retried;
    if (c.http) {
      EXPECT_FALSE(c.h.error.has_value()) << what << ": " << c.h.error->dump();
      EXPECT_EQ(c.h.tokens, expected) << what;
    } else {
      EXPECT_TRUE(c.g.status.ok()) << what << ": " << c.g.status.error_message();
      EXPECT_EQ(c.g.tokens, expected) << what;
    }
  }
  // The scenario had each kind of request on the killed replica.
  EXPECT_GE(streaming_http, 1);
  EXPECT_GE(streaming_grpc, 1);
  EXPECT_GE(retried, 1);
  EXPECT_GE(Value(d.RouterMetrics(), "mobius_router_retries_total"), retried);
  std::printf(
      "killed replica %d: %d streaming HTTP, %d streaming gRPC failed, %d retried; all "
      "done %.0f ms after the kill\n",
      victim, streaming_http, streaming_grpc, retried,
      std::chrono::duration<double, std::milli>(Clock::now() - killed_at).count());

  // The worker comes back on its port: the router's health checks notice and it gets work.
  d.RestartWorker(victim);
  ASSERT_TRUE(d.WaitReplicaHealth(victim, true, 10000)) << "the restarted replica is not used";
  std::vector<GrpcOutcome> after(2);
  std::vector<std::thread> again;
  for (int i = 0; i < 2; ++i) {
    again.emplace_back(
        [&, i] { after[i] = GrpcGenerate(d.inference(), GreedyRequest(prompt, kMaxTokens)); });
  }
  for (std::thread& t : again) t.join();
  for (const GrpcOutcome& g : after) {
    EXPECT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_EQ(g.tokens, expected);
  }
  EXPECT_GT(Value(d.WorkerMetrics(victim), Series("vllm:generation_tokens_total", kModelLabel)), 0)
      << "the restarted replica got no request";
}

// Bad requests, over HTTP and gRPC, are refused with the field named, and overload with a
// retry hint, while a long request keeps streaming its reference output undisturbed.
TEST(ServingAcceptanceTest, BadRequestsAndOverloadAreRefusedWithoutDisturbingALongRequest) {
  constexpr int kLongTokens = 100;
  const std::vector<int32_t> prompt = Prompts(3)[2];
  const std::vector<int32_t> expected = MobiusGenerate(prompt, kLongTokens);
  Deployment d(
      {.workers = 1,
       .worker_flags = {"--max-model-len=256"},
       .router_flags = {"--max-queued-requests=2",
                        "--tokenizer=" + std::string(MOBIUS_FIXTURES_DIR) + "/tokenizer-qwen3"},
       .step_delay_ms = 20});
  ASSERT_TRUE(d.ready());
  std::atomic<int> long_tokens{0};
  GrpcOutcome long_call;
  std::thread long_thread([&] {
    long_call = GrpcGenerate(d.inference(), GreedyRequest(prompt, kLongTokens), nullptr,
                             [&](const std::vector<int32_t>& t) { long_tokens.store(t.size()); });
  });
  for (int i = 0; i < 500 && long_tokens.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GT(long_tokens.load(), 0);

  const std::string too_long = Json(std::vector<int32_t>(256, 7)).dump();
  struct HttpCase {
    std::string name, body, content_type;
    int status;
    std::string message_part;
  };
  const std::vector<HttpCase> http_cases = {
      {"empty prompt", R"({"prompt": "", "max_tokens": 4})", "application/json", 400,
       "prompt must not be empty"},
      {"empty id prompt", R"({"prompt": [], "max_tokens": 4})", "application/json", 400,
       "prompt must not be empty"},
      {"negative max_tokens", R"({"prompt": [1, 2], "max_tokens": -1})", "application/json", 400,
       "max_tokens"},
      {"huge max_tokens", R"({"prompt": [1, 2], "max_tokens": 100000})", "application/json", 400,
       "max_tokens = 100000"},
      {"NaN temperature (not JSON)", R"({"prompt": [1, 2], "temperature": NaN})",
       "application/json", 400, "invalid JSON"},
      {"negative temperature", R"({"prompt": [1, 2], "temperature": -0.5})", "application/json",
       400, "temperature"},
      {"top_p zero", R"({"prompt": [1, 2], "top_p": 0})", "application/json", 400, "top_p"},
      {"top_p above one", R"({"prompt": [1, 2], "top_p": 1.5})", "application/json", 400, "top_p"},
      {"prompt longer than the context", R"({"prompt": )" + too_long + "}", "application/json", 400,
       "256 tokens"},
      {"token outside the vocabulary", R"({"prompt": [1, 2048]})", "application/json", 400,
       "token 2048"},
      {"unknown model", R"({"model": "gpt-4", "prompt": [1, 2]})", "application/json", 400,
       "gpt-4"},
      {"malformed JSON", R"({"prompt": [1, 2)", "application/json", 400, "invalid JSON"},
      {"wrong content type", "prompt=1", "application/x-www-form-urlencoded", 400, "Content-Type"},
  };
  for (const HttpCase& c : http_cases) {
    const HttpReply reply =
        HttpCall(d.http_port(), http::verb::post, "/v1/completions", c.body, c.content_type);
    EXPECT_EQ(reply.status, c.status) << c.name << ": " << reply.body;
    const Json body = Json::parse(reply.body, nullptr, false);
    ASSERT_TRUE(body.contains("error")) << c.name << ": " << reply.body;
    EXPECT_TRUE(absl::StrContains(body["error"]["message"].get<std::string>(), c.message_part))
        << c.name << ": " << reply.body;
  }

  struct GrpcCase {
    std::string name;
    std::function<void(v1::GenerateRequest&)> mutate;
    std::string message_part;
  };
  const std::vector<GrpcCase> grpc_cases = {
      {"empty prompt", [](v1::GenerateRequest& r) { r.mutable_input_ids()->clear_ids(); },
       "input_ids is empty"},
      {"negative max_tokens",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_max_tokens(-1); },
       "sampling_params.max_tokens"},
      {"huge max_tokens",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_max_tokens(100000); },
       "sampling_params.max_tokens"},
      {"NaN temperature",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_temperature(std::nanf("")); },
       "sampling_params.temperature"},
      {"negative temperature",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_temperature(-1); },
       "sampling_params.temperature"},
      {"top_p zero", [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_top_p(0); },
       "sampling_params.top_p"},
      {"top_p above one",
       [](v1::GenerateRequest& r) { r.mutable_sampling_params()->set_top_p(1.5f); },
       "sampling_params.top_p"},
      {"prompt longer than the context",
       [](v1::GenerateRequest& r) {
         for (int i = 0; i < 256; ++i) r.mutable_input_ids()->add_ids(7);
       },
       "input_ids has"},
      {"token outside the vocabulary",
       [](v1::GenerateRequest& r) { r.mutable_input_ids()->add_ids(2048); }, "token 2048"},
  };
  for (const GrpcCase& c : grpc_cases) {
    v1::GenerateRequest request = GreedyRequest({1, 2, 3}, 4);
    c.mutate(request);
    const GrpcOutcome g = GrpcGenerate(d.inference(), request);
    EXPECT_EQ(g.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.name << ": " << g.status.error_message();
    EXPECT_TRUE(absl::StrContains(g.status.error_message(), c.message_part))
        << c.name << ": " << g.status.error_message();
    EXPECT_TRUE(g.tokens.empty()) << c.name;
  }

  // Overload: a second long request fills the router's limit of two; the next is refused.
  SseStream second(d.http_port(), "/v1/completions", CompletionBody(prompt, 200).dump());
  ASSERT_EQ(second.status(), 200);
  const HttpReply refused = HttpCall(d.http_port(), http::verb::post, "/v1/completions",
                                     CompletionBody(prompt, 4).dump());
  EXPECT_EQ(refused.status, 429) << refused.body;
  EXPECT_TRUE(absl::StrContains(refused.body, "retry after")) << refused.body;
  int retry_after = 0;
  EXPECT_TRUE(absl::SimpleAtoi(refused.header(http::field::retry_after), &retry_after));
  EXPECT_GE(retry_after, 1);
  const GrpcOutcome exhausted = GrpcGenerate(d.inference(), GreedyRequest(prompt, 4));
  EXPECT_EQ(exhausted.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(exhausted.status.error_message(), "retry after"))
      << exhausted.status.error_message();
  second.Close();

  long_thread.join();
  EXPECT_TRUE(long_call.status.ok()) << long_call.status.error_message();
  EXPECT_TRUE(long_call.completed);
  EXPECT_EQ(long_call.complete.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(long_call.tokens, expected);
  EXPECT_EQ(long_tokens.load(), kLongTokens);
}

// SIGTERM drains a worker behind the router and the router itself: requests in flight finish,
// new ones are refused, and both processes exit 0.
TEST(ServingAcceptanceTest, SigtermDrainsWorkerAndRouter) {
  constexpr int kMaxTokens = 30;
  const std::vector<int32_t> prompt = Prompts(2)[1];
  Deployment d({.workers = 1, .worker_flags = {"--max-model-len=256"}, .step_delay_ms = 20});
  ASSERT_TRUE(d.ready());

  // The worker: its request in flight completes through the router; new requests are refused.
  {
    std::atomic<int> tokens{0};
    GrpcOutcome in_flight;
    std::thread client([&] {
      in_flight = GrpcGenerate(d.inference(), GreedyRequest(prompt, kMaxTokens), nullptr,
                               [&](const std::vector<int32_t>& t) { tokens.store(t.size()); });
    });
    for (int i = 0; i < 500 && tokens.load() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    int exit_code = -1;
    std::thread terminator([&] { exit_code = d.TerminateWorker(0); });
    EXPECT_TRUE(d.WaitReplicaHealth(0, false, 2000)) << "the draining worker still looks healthy";
    const GrpcOutcome refused = GrpcGenerate(d.inference(), GreedyRequest(prompt, 4));
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << refused.status.error_message();
    client.join();
    terminator.join();
    EXPECT_TRUE(in_flight.status.ok()) << in_flight.status.error_message();
    EXPECT_EQ(in_flight.tokens.size(), static_cast<size_t>(kMaxTokens));
    EXPECT_EQ(exit_code, 0);
  }

  // The router, with one stream of each protocol in flight.
  d.RestartWorker(0);
  ASSERT_TRUE(d.WaitReplicaHealth(0, true, 10000));
  std::atomic<int> http_tokens{0}, grpc_tokens{0};
  HttpOutcome http_call;
  GrpcOutcome grpc_call;
  std::thread http_client([&] {
    http_call =
        HttpStreamCompletion(d.http_port(), CompletionBody(prompt, kMaxTokens),
                             [&](const std::vector<int32_t>& t) { http_tokens = t.size(); });
  });
  std::thread grpc_client([&] {
    grpc_call = GrpcGenerate(d.inference(), GreedyRequest(prompt, kMaxTokens), nullptr,
                             [&](const std::vector<int32_t>& t) { grpc_tokens = t.size(); });
  });
  for (int i = 0; i < 500 && (http_tokens.load() == 0 || grpc_tokens.load() == 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  int router_exit = -1;
  std::thread terminator([&] { router_exit = d.TerminateRouter(); });
  // Draining: new requests over both protocols are refused while the streams go on.
  bool refused_http = false;
  for (int i = 0; i < 200 && !refused_http; ++i) {
    const HttpReply reply = HttpCall(d.http_port(), http::verb::post, "/v1/completions",
                                     CompletionBody(prompt, 4).dump());
    refused_http = reply.status == 503;
    if (!refused_http) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(refused_http);
  const GrpcOutcome refused = GrpcGenerate(d.inference(), GreedyRequest(prompt, 4));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  http_client.join();
  grpc_client.join();
  terminator.join();
  EXPECT_EQ(http_call.status, 200);
  EXPECT_FALSE(http_call.error.has_value()) << http_call.error->dump();
  EXPECT_TRUE(http_call.done);
  EXPECT_EQ(http_call.tokens.size(), static_cast<size_t>(kMaxTokens));
  EXPECT_TRUE(grpc_call.status.ok()) << grpc_call.status.error_message();
  EXPECT_EQ(grpc_call.tokens.size(), static_cast<size_t>(kMaxTokens));
  EXPECT_EQ(router_exit, 0);
}

// The router's /metrics is valid Prometheus exposition (promtool), has the series the dashboards
// read, and its counters, gauges and histograms move as requests are served.
TEST(ServingAcceptanceTest, RouterMetricsAreValidAndMove) {
  constexpr int kMaxTokens = 6;
  const std::vector<int32_t> prompt = Prompts(5)[4];
  Deployment d({.workers = 1, .worker_flags = {"--max-model-len=256"}, .step_delay_ms = 20});
  ASSERT_TRUE(d.ready());
  const std::string replica = absl::StrCat("{replica=\"", d.worker_address(0), "\"}");
  const std::string before = d.RouterMetrics();
  for (const std::string& f : PromtoolFindings(before)) ADD_FAILURE() << f;
  EXPECT_EQ(Value(before, Requests("http", "OK")), 0);
  EXPECT_EQ(Value(before, Requests("grpc", "OK")), 0);
  EXPECT_EQ(Value(before, "mobius_router_retries_total"), 0);
  EXPECT_EQ(Value(before, "mobius_router_requests_in_flight"), 0);
  EXPECT_EQ(Value(before, "mobius_router_replica_healthy" + replica), 1);
  EXPECT_EQ(Value(before, "mobius_router_replica_outstanding_tokens" + replica), 0);

  // While a request streams: in flight, and its tokens outstanding at the replica.
  {
    SseStream stream(d.http_port(), "/v1/completions", CompletionBody(prompt, 200).dump());
    ASSERT_EQ(stream.status(), 200);
    ASSERT_TRUE(stream.Next().has_value());
    const std::string during = d.RouterMetrics();
    EXPECT_EQ(Value(during, "mobius_router_requests_in_flight"), 1);
    EXPECT_GT(Value(during, "mobius_router_replica_outstanding_tokens" + replica), 0);
    stream.Close();
  }
  ASSERT_TRUE(d.WaitWorkerIdle(0, 2000));

  const HttpOutcome h = HttpStreamCompletion(d.http_port(), CompletionBody(prompt, kMaxTokens));
  EXPECT_EQ(h.tokens.size(), static_cast<size_t>(kMaxTokens));
  const GrpcOutcome g = GrpcGenerate(d.inference(), GreedyRequest(prompt, kMaxTokens));
  EXPECT_TRUE(g.status.ok());
  const HttpReply bad = HttpCall(d.http_port(), http::verb::post, "/v1/completions",
                                 R"({"prompt": [1], "top_p": 2})");
  EXPECT_EQ(bad.status, 400);

  const std::string after = d.RouterMetrics();
  for (const std::string& f : PromtoolFindings(after)) ADD_FAILURE() << f;
  EXPECT_EQ(Value(after, Requests("http", "OK")), 1);
  EXPECT_EQ(Value(after, Requests("grpc", "OK")), 1);
  EXPECT_EQ(Value(after, Requests("http", "CANCELLED")), 1);
  EXPECT_EQ(Value(after, Requests("http", "INVALID_ARGUMENT")), 1);
  EXPECT_EQ(Value(after, "mobius_router_requests_in_flight"), 0);
  EXPECT_EQ(Value(after, "mobius_router_replica_requests_total" + replica), 3);
  EXPECT_EQ(Value(after, Series("vllm:prompt_tokens_total", kModelLabel)), 3 * prompt.size());
  EXPECT_GE(Value(after, Series("vllm:generation_tokens_total", kModelLabel)), 2 * kMaxTokens + 1);
  // Two requests completed; three got a first token; each streamed several chunks.
  EXPECT_EQ(Value(after, Series("vllm:e2e_request_latency_seconds_count", kModelLabel)), 2);
  EXPECT_EQ(Value(after, Series("vllm:time_to_first_token_seconds_count", kModelLabel)), 3);
  EXPECT_GE(Value(after, Series("vllm:inter_token_latency_seconds_count", kModelLabel)),
            2 * (kMaxTokens - 1));
  EXPECT_GT(Value(after, Series("vllm:time_to_first_token_seconds_sum", kModelLabel)), 0);
}

}  // namespace
}  // namespace mobius::testing
