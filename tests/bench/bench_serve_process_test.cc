// `mobius bench serve` against real processes: a mobius-worker on the intern-s2-mobius-tiny
// fixture behind a mobius-router, loaded through the OpenAI API and directly over the worker's
// gRPC API; failures (HTTP errors, unreachable servers) are counted with their reasons, and bad
// flags are refused with the flag named.
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/child_process.h"
#include "tests/util/run_command.h"

namespace {

using mobius::testing::ChildProcess;
using mobius::testing::FreePort;
using ::testing::HasSubstr;
using ::testing::Not;

using Result = mobius::testing::CommandResult;  // stdout and stderr together

Result RunMobius(const std::string& args) {
  return mobius::testing::RunCommand(std::string(MOBIUS_BINARY) + " " + args + " 2>&1");
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nullptr;
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

class BenchServeProcessTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    worker_port_ = FreePort();
    http_port_ = FreePort();
    const std::string fixtures = MOBIUS_FIXTURES_DIR;
    worker_ =
        new ChildProcess({MOBIUS_WORKER_BINARY, "--model", fixtures + "/intern-s2-mobius-tiny",
                          "--host=127.0.0.1", "--port=" + std::to_string(worker_port_),
                          "--threads=1", "--tokenizer=" + fixtures + "/tokenizer-qwen3"});
    const int grpc_port = FreePort();
    router_grpc_port_ = grpc_port;
    router_ = new ChildProcess(
        {MOBIUS_ROUTER_BINARY, "--worker=127.0.0.1:" + std::to_string(worker_port_),
         "--host=127.0.0.1", "--grpc-port=" + std::to_string(grpc_port),
         "--http-port=" + std::to_string(http_port_),
         "--tokenizer=" + fixtures + "/tokenizer-qwen3", "--health-check-interval-ms=50"});
    for (int i = 0; i < 300 && !mobius::testing::Listening(grpc_port); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    auto health = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(grpc_port), grpc::InsecureChannelCredentials()));
    for (int i = 0; i < 300 && !serving_; ++i) {
      serving_ = mobius::testing::Health(*health) == grpc::health::v1::HealthCheckResponse::SERVING;
      if (!serving_) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  static void TearDownTestSuite() {
    delete router_;
    delete worker_;
  }
  void SetUp() override { ASSERT_TRUE(serving_) << "router never became SERVING"; }

  static std::string BaseUrl() { return "http://127.0.0.1:" + std::to_string(http_port_); }
  static std::string Json(const std::string& name) {
    return ::testing::TempDir() + "/bench_serve_" + name + ".json";
  }

  static inline ChildProcess* worker_ = nullptr;
  static inline ChildProcess* router_ = nullptr;
  static inline int worker_port_ = 0;
  static inline int http_port_ = 0;
  static inline int router_grpc_port_ = 0;
  static inline bool serving_ = false;
};

// What every successful run of N prompts of `output_len` tokens must show.
void ExpectAllCompleted(const nlohmann::json& j, int num_prompts, int input_len, int output_len) {
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["completed"], num_prompts);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_output_tokens"], num_prompts * output_len);  // ignore_eos honoured
  EXPECT_EQ(j["total_input_tokens"], num_prompts * input_len);
  EXPECT_GT(j["duration"].get<double>(), 0);
  EXPECT_GT(j["request_throughput"].get<double>(), 0);
  EXPECT_GT(j["mean_ttft_ms"].get<double>(), 0);
  EXPECT_GE(j["p99_ttft_ms"].get<double>(), j["median_ttft_ms"].get<double>());
  EXPECT_GT(j["mean_tpot_ms"].get<double>(), 0);
  EXPECT_GT(j["mean_itl_ms"].get<double>(), 0);
  EXPECT_GT(j["mean_e2el_ms"].get<double>(), j["mean_ttft_ms"].get<double>());
  ASSERT_EQ(j["output_lens"].size(), static_cast<size_t>(num_prompts));
  for (int i = 0; i < num_prompts; ++i) {
    EXPECT_EQ(j["output_lens"][i], output_len) << i;
    EXPECT_EQ(j["errors"][i], "") << i;
    // Chunks after the first: at most one per token plus the final finish_reason / complete.
    EXPECT_GE(j["itls"][i].size(), 1u) << i;
    EXPECT_LE(j["itls"][i].size(), static_cast<size_t>(output_len)) << i;
  }
}

TEST_F(BenchServeProcessTest, ThroughTheRouterOverTheOpenAiApi) {
  const std::string json = Json("router");
  Result r = RunMobius("bench serve --base-url " + BaseUrl() +
                       " --num-prompts 6 --random-input-len 8 --random-output-len 5 "
                       "--max-concurrency 3 --warmup 1 --seed 3 --progress-interval-s 0.05 "
                       "--output-json " +
                       json);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("Serving Benchmark Result"));
  EXPECT_THAT(r.out, HasSubstr("Successful requests:                     6"));
  EXPECT_THAT(r.out, HasSubstr("P99 ITL (ms):"));
  nlohmann::json j = ReadJson(json);
  ExpectAllCompleted(j, 6, 8, 5);
  EXPECT_FALSE(j["settings"]["model"].get<std::string>().empty());  // from GET /v1/models
  EXPECT_EQ(j["settings"]["max_concurrency"], 3);
}

TEST_F(BenchServeProcessTest, PoissonArrivalsAndExtraPercentiles) {
  const std::string json = Json("rate");
  Result r = RunMobius("bench serve --base-url " + BaseUrl() +
                       " --num-prompts 4 --random-input-len 4 --random-output-len 3 "
                       "--request-rate 20 --warmup 0 --metric-percentiles 50,90,99 "
                       "--progress-interval-s 0 --output-json " +
                       json);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  nlohmann::json j = ReadJson(json);
  ExpectAllCompleted(j, 4, 4, 3);
  EXPECT_EQ(j["settings"]["request_rate"], 20.0);
  EXPECT_DOUBLE_EQ(j["p50_ttft_ms"].get<double>(), j["median_ttft_ms"].get<double>());
  EXPECT_TRUE(j.contains("p90_itl_ms"));
}

TEST_F(BenchServeProcessTest, DirectlyToTheWorkerOverGrpc) {
  const std::string json = Json("worker");
  Result r = RunMobius(
      "bench serve --backend worker-grpc --worker 127.0.0.1:" + std::to_string(worker_port_) +
      " --num-prompts 6 --random-input-len 8 --random-output-len 5 "
      "--max-concurrency 3 --seed 3 --output-json " +
      json);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  ExpectAllCompleted(ReadJson(json), 6, 8, 5);
}

TEST_F(BenchServeProcessTest, ThroughTheRoutersGrpcApi) {
  const std::string json = Json("router_grpc");
  Result r = RunMobius(
      "bench serve --backend router-grpc --router 127.0.0.1:" + std::to_string(router_grpc_port_) +
      " --num-prompts 6 --random-input-len 8 --random-output-len 5 "
      "--max-concurrency 3 --seed 3 --output-json " +
      json);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  ExpectAllCompleted(ReadJson(json), 6, 8, 5);
}

// --json-schema reaches the server on every path: a schema it can serve constrains the outputs
// (which the schema's minItems keeps open to max_tokens), one it refuses fails every request with
// the server's reason.
TEST_F(BenchServeProcessTest, JsonSchemaOnEveryBackend) {
  const std::string served = ::testing::TempDir() + "/schema_served.json";
  const std::string refused = ::testing::TempDir() + "/schema_refused.json";
  std::ofstream(served) << R"({"type": "array", "items": {"type": "integer"}, "minItems": 100})";
  std::ofstream(refused) << R"({"type": "array", "uniqueItems": true})";
  const std::string backends[] = {
      "--base-url " + BaseUrl(),
      "--backend worker-grpc --worker 127.0.0.1:" + std::to_string(worker_port_),
      "--backend router-grpc --router 127.0.0.1:" + std::to_string(router_grpc_port_)};
  for (const std::string& backend : backends) {
    SCOPED_TRACE(backend);
    const std::string json = Json("with_schema");
    Result r = RunMobius("bench serve " + backend +
                         " --num-prompts 3 --random-input-len 8 --random-output-len 6 --warmup 0 "
                         "--progress-interval-s 0 --json-schema " +
                         served + " --output-json " + json);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    nlohmann::json j = ReadJson(json);
    ExpectAllCompleted(j, 3, 8, 6);
    EXPECT_EQ(j["settings"]["json_schema"], served);
    r = RunMobius("bench serve " + backend +
                  " --num-prompts 2 --random-input-len 8 --random-output-len 6 --warmup 0 "
                  "--progress-interval-s 0 --json-schema " +
                  refused + " --output-json " + json);
    EXPECT_EQ(r.exit_code, 1) << r.out;  // nothing completed
    j = ReadJson(json);
    ASSERT_TRUE(j.is_object()) << r.out;
    EXPECT_EQ(j["failed"], 2);
    // One reason, counted twice: no request-specific words in it.
    ASSERT_EQ(j["failure_reasons"].size(), 1u) << j["failure_reasons"];
    EXPECT_THAT(j["failure_reasons"].begin().key(), HasSubstr("uniqueItems"));
    EXPECT_EQ(j["failure_reasons"].begin().value(), 2);
  }
}

TEST_F(BenchServeProcessTest, HttpErrorsAreCountedFailuresWithTheirReason) {
  // Text prompts tokenize (Qwen3) to ids beyond the tiny model's 2048-token vocabulary: 400.
  const std::string json = Json("chat");
  Result r = RunMobius("bench serve --base-url " + BaseUrl() +
                       " --endpoint /v1/chat/completions --num-prompts 3 --random-input-len 16 "
                       "--random-output-len 2 --output-json " +
                       json);
  EXPECT_EQ(r.exit_code, 1) << r.out;  // nothing completed
  EXPECT_THAT(r.out, HasSubstr("Failed requests:                         3"));
  nlohmann::json j = ReadJson(json);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["completed"], 0);
  EXPECT_EQ(j["failed"], 3);
  ASSERT_EQ(j["failure_reasons"].size(), 1u) << j["failure_reasons"];
  EXPECT_THAT(j["failure_reasons"].begin().key(), HasSubstr("HTTP 400"));
  EXPECT_EQ(j["failure_reasons"].begin().value(), 3);
}

TEST_F(BenchServeProcessTest, UnreachableServersAreCountedFailures) {
  const std::string dead = "127.0.0.1:" + std::to_string(FreePort());
  const std::string http_json = Json("dead_http");
  Result r = RunMobius("bench serve --base-url http://" + dead +
                       " --num-prompts 3 --random-input-len 4 --random-output-len 2 "
                       "--output-json " +
                       http_json);
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("cannot list the models"));
  nlohmann::json j = ReadJson(http_json);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["failed"], 3);
  EXPECT_THAT(j["failure_reasons"].dump(), HasSubstr("Connection refused"));

  const std::string grpc_json = Json("dead_grpc");
  r = RunMobius("bench serve --backend worker-grpc --worker " + dead +
                " --num-prompts 2 --random-input-len 4 --random-output-len 2 --output-json " +
                grpc_json);
  EXPECT_EQ(r.exit_code, 1) << r.out;
  j = ReadJson(grpc_json);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["failed"], 2);
  EXPECT_THAT(j["failure_reasons"].dump(), HasSubstr("gRPC UNAVAILABLE"));
}

TEST(BenchServeCommandTest, HelpListsTheFlags) {
  Result r = RunMobius("bench serve --help");
  EXPECT_EQ(r.exit_code, 1) << r.out;  // absl's --help exit code
  for (const char* flag : {"--backend",
                           "--base_url",
                           "--endpoint",
                           "--worker",
                           "--router",
                           "--num_prompts",
                           "--random_input_len",
                           "--random_output_len",
                           "--random_range_ratio",
                           "--vocab_size",
                           "--dataset",
                           "--request_rate",
                           "--burstiness",
                           "--max_concurrency",
                           "--warmup",
                           "--output_json",
                           "--metric_percentiles",
                           "--request_timeout_s",
                           "--json_schema",
                           "--model NAME",
                           "--seed N"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
  EXPECT_THAT(r.out, Not(HasSubstr("--device")));   // no model is loaded here
  EXPECT_THAT(r.out, Not(HasSubstr("--batches")));  // bench engine's
}

TEST(BenchServeCommandTest, BadFlagsNameTheFlag) {
  struct Case {
    const char* args;
    const char* message;
  };
  for (const Case& c :
       {Case{"--random-range-ratio 1.5", "--random-range-ratio must be in [0, 1)"},
        Case{"--backend carrier-pigeon", "--backend \"carrier-pigeon\""},
        Case{"--base-url localhost:8000", "--base-url \"localhost:8000\""},
        Case{"--endpoint /v1/embeddings", "--endpoint \"/v1/embeddings\""},
        Case{"--num-prompts 0", "--num-prompts must be > 0"},
        Case{"--request-rate 0", "--request-rate must be > 0"},
        Case{"--metric-percentiles 50,101", "--metric-percentiles"},
        Case{"--endpoint /v1/chat/completions --prompt-format ids", "text prompts only"},
        Case{"--backend worker-grpc --worker x:1 --prompt-format text", "token-id prompts only"},
        Case{"--backend worker-grpc", "--worker HOST:PORT is required"},
        Case{"--backend router-grpc", "--router HOST:PORT is required"},
        Case{"--dataset /nonexistent.jsonl", "--dataset: cannot open"},
        Case{"--json-schema /nonexistent.json", "--json-schema: cannot read"},
        Case{"--json-schema /proc/self/status", "is not a JSON Schema"},
        Case{"--steps 3", "--steps is not a flag of this command"},
        Case{"--device cpu", "--device is not a flag of this command"}}) {
    Result r = RunMobius(std::string("bench serve --base-url http://127.0.0.1:1 ") + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_THAT(r.out, HasSubstr(c.message)) << c.args;
  }
  Result engine = RunMobius("bench engine --num-prompts 3");
  EXPECT_EQ(engine.exit_code, 2);
  EXPECT_THAT(engine.out, HasSubstr("--num_prompts is not a flag of this command"));
}

}  // namespace
