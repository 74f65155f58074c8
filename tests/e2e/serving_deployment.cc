#include "tests/e2e/serving_deployment.h"

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/util/http_client.h"
#include "tests/util/run_command.h"

namespace mobius::testing {
namespace {

using Json = nlohmann::json;
using grpc::health::v1::HealthCheckResponse;

std::string FixtureModel() { return std::string(MOBIUS_FIXTURES_DIR) + "/" + kServedModel; }

template <typename Predicate>
bool PollUntil(int timeout_ms, int interval_ms, Predicate done) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
  }
}

}  // namespace

Deployment::Deployment(DeploymentOptions options) : options_(std::move(options)) {
  workers_.resize(options_.workers);
  for (Worker& w : workers_) {
    w.port = FreePort();
    w.metrics_port = FreePort();
    StartWorker(w);
  }
  grpc_port_ = FreePort();
  http_port_ = FreePort();
  std::vector<std::string> addresses;
  for (int i = 0; i < options_.workers; ++i) addresses.push_back(worker_address(i));
  std::vector<std::string> args = {MOBIUS_ROUTER_BINARY,
                                   "--worker=" + absl::StrJoin(addresses, ","),
                                   "--host=127.0.0.1",
                                   "--grpc-port=" + std::to_string(grpc_port_),
                                   "--http-port=" + std::to_string(http_port_),
                                   "--health-check-interval-ms=50"};
  args.insert(args.end(), options_.router_flags.begin(), options_.router_flags.end());
  router_ = std::make_unique<ChildProcess>(args);

  // Connect once the router listens, so that the channel does not sit in reconnect backoff.
  if (!PollUntil(30000, 10, [&] { return Listening(grpc_port_); })) {
    ADD_FAILURE() << "the router never listened on " << grpc_port_;
    return;
  }
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port_),
                                     grpc::InsecureChannelCredentials());
  inference_ = v1::Inference::NewStub(channel);
  auto health = grpc::health::v1::Health::NewStub(channel);
  if (!PollUntil(15000, 20, [&] { return Health(*health) == HealthCheckResponse::SERVING; })) {
    ADD_FAILURE() << "the router never became SERVING";
    return;
  }
  for (int i = 0; i < options_.workers; ++i) {
    if (!WaitReplicaHealth(i, true, 15000)) {
      ADD_FAILURE() << "replica " << worker_address(i) << " never became healthy";
      return;
    }
  }
  ready_ = true;
}

Deployment::~Deployment() = default;

void Deployment::StartWorker(Worker& w) {
  std::vector<std::string> args = {MOBIUS_WORKER_BINARY,
                                   "--model",
                                   FixtureModel(),
                                   "--host=127.0.0.1",
                                   "--port=" + std::to_string(w.port),
                                   "--metrics-port=" + std::to_string(w.metrics_port),
                                   "--threads=1"};
  args.insert(args.end(), options_.worker_flags.begin(), options_.worker_flags.end());
  if (options_.ranks > 1) {
    const std::string leader = "--leader=127.0.0.1:" + std::to_string(FreePort());
    std::vector<std::string> rank_args = {"--world-size=" + std::to_string(options_.ranks), leader,
                                          "--rendezvous-timeout-s=30"};
    rank_args.insert(rank_args.end(), options_.rank_flags.begin(), options_.rank_flags.end());
    w.followers.clear();
    for (int r = 1; r < options_.ranks; ++r) {
      std::vector<std::string> follower = {MOBIUS_WORKER_BINARY,
                                           "--model",
                                           FixtureModel(),
                                           "--host=127.0.0.1",
                                           "--port=" + std::to_string(FreePort()),
                                           "--threads=1",
                                           "--rank=" + std::to_string(r)};
      follower.insert(follower.end(), options_.worker_flags.begin(), options_.worker_flags.end());
      follower.insert(follower.end(), rank_args.begin(), rank_args.end());
      w.followers.push_back(std::make_unique<ChildProcess>(follower));
    }
    args.push_back("--rank=0");
    args.insert(args.end(), rank_args.begin(), rank_args.end());
  }
  // The child inherits the environment at fork.
  if (options_.step_delay_ms > 0) {
    setenv("MOBIUS_DEBUG_STEP_DELAY_MS", std::to_string(options_.step_delay_ms).c_str(), 1);
  }
  w.process = std::make_unique<ChildProcess>(args);
  unsetenv("MOBIUS_DEBUG_STEP_DELAY_MS");
  w.stub = v1::Worker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(w.port),
                                                   grpc::InsecureChannelCredentials()));
}

std::string Deployment::worker_address(int i) const {
  return "127.0.0.1:" + std::to_string(workers_[i].port);
}

v1::GetLoadsResponse Deployment::Loads(int i) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::GetLoadsResponse loads;
  if (!workers_[i].stub->GetLoads(&context, v1::GetLoadsRequest(), &loads).ok()) {
    return v1::GetLoadsResponse();
  }
  return loads;
}

bool Deployment::WaitWorkerIdle(int i, int timeout_ms) {
  return PollUntil(timeout_ms, 2, [&] {
    const v1::GetLoadsResponse l = Loads(i);
    return l.num_running() == 0 && l.num_waiting() == 0 && l.kv_cache_usage() == 0 &&
           l.state_slot_usage() == 0;
  });
}

std::string Deployment::WorkerMetrics(int i) { return WorkerHttp(i, "/metrics"); }

std::string Deployment::WorkerHttp(int i, const std::string& path) {
  return HttpGet(workers_[i].metrics_port, path).body;
}

std::pair<int, std::string> Deployment::WorkerHttpPost(int i, const std::string& path,
                                                       const std::string& body) {
  const HttpReply reply =
      HttpCall(workers_[i].metrics_port, boost::beast::http::verb::post, path, body);
  return {reply.status, reply.body};
}

std::string Deployment::RouterMetrics() { return HttpGet(http_port_, "/metrics").body; }

void Deployment::KillWorker(int i) { workers_[i].process.reset(); }

void Deployment::KillRank(int i, int r) { workers_[i].followers[r - 1].reset(); }

int Deployment::RankExitStatus(int i, int r) {
  ChildProcess* p = r == 0 ? workers_[i].process.get() : workers_[i].followers[r - 1].get();
  return p == nullptr ? -1 : p->ExitStatusIfExited();
}

void Deployment::RestartWorker(int i) { StartWorker(workers_[i]); }

int Deployment::TerminateWorker(int i) { return workers_[i].process->Terminate(); }

int Deployment::TerminateRouter() { return router_->Terminate(); }

bool Deployment::WaitReplicaHealth(int i, bool healthy, int timeout_ms) {
  const std::string series =
      absl::StrCat("mobius_router_replica_healthy{replica=\"", worker_address(i), "\"}");
  return PollUntil(timeout_ms, 20, [&] {
    std::optional<double> value = SeriesValue(RouterMetrics(), series);
    return value.has_value() && *value == (healthy ? 1 : 0);
  });
}

std::optional<double> SeriesValue(const std::string& exposition, const std::string& series) {
  std::istringstream lines(exposition);
  for (std::string line; std::getline(lines, line);) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ') {
      double value = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &value)) return value;
    }
  }
  return std::nullopt;
}

std::vector<std::string> PromtoolFindings(const std::string& exposition) {
  const std::string path = ::testing::TempDir() + "/metrics_" + std::to_string(getpid()) + ".txt";
  std::ofstream(path) << exposition;
  const auto [code, out] = RunCommand("promtool check metrics < " + path + " 2>&1");
  std::vector<std::string> findings;
  // promtool exits 1 on a parse error and 3 on lint findings.
  if (code != 0 && code != 3) {
    findings.push_back(absl::StrCat("promtool exit ", code,
                                    " (is the prometheus package "
                                    "installed?): ",
                                    out));
  }
  std::istringstream lines(out);
  for (std::string f; std::getline(lines, f);) {
    if (f.find("metric names should not contain ':'") == std::string::npos) findings.push_back(f);
  }
  return findings;
}

std::vector<int32_t> MobiusGenerate(const std::vector<int32_t>& prompt, int max_tokens) {
  const std::string command =
      absl::StrCat(MOBIUS_CLI_BINARY, " generate --model ", FixtureModel(), " --prompt-ids ",
                   absl::StrJoin(prompt, ","), " --max-tokens ", max_tokens,
                   " --ignore-eos --threads 1 2>/dev/null");
  const auto [code, out] = RunCommand(command);
  EXPECT_EQ(code, 0) << command << "\n" << out;
  const Json json = Json::parse(out, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("token_ids")) {
    ADD_FAILURE() << "unexpected output of " << command << ":\n" << out;
    return {};
  }
  return json["token_ids"].get<std::vector<int32_t>>();
}

v1::GenerateRequest GreedyRequest(const std::vector<int32_t>& prompt, int max_tokens) {
  v1::GenerateRequest request;
  request.mutable_input_ids()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  request.mutable_sampling_params()->set_temperature(0);
  request.mutable_sampling_params()->set_max_tokens(max_tokens);
  request.mutable_sampling_params()->set_ignore_eos(true);
  return request;
}

GrpcOutcome GrpcGenerate(v1::Inference::Stub& stub, const v1::GenerateRequest& request,
                         grpc::ClientContext* context,
                         const std::function<void(const std::vector<int32_t>&)>& on_chunk) {
  grpc::ClientContext own_context;
  if (context == nullptr) context = &own_context;
  GrpcOutcome outcome;
  auto reader = stub.Generate(context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_complete()) {
      outcome.completed = true;
      outcome.complete = response.complete();
      continue;
    }
    outcome.tokens.insert(outcome.tokens.end(), response.chunk().token_ids().begin(),
                          response.chunk().token_ids().end());
    if (on_chunk && response.chunk().token_ids_size() > 0) on_chunk(outcome.tokens);
  }
  outcome.status = reader->Finish();
  return outcome;
}

Json CompletionBody(const std::vector<int32_t>& prompt, int max_tokens) {
  // The ids come back as the logprobs' "token_id:<id>" labels.
  return Json{{"model", kServedModel},
              {"prompt", prompt},
              {"max_tokens", max_tokens},
              {"temperature", 0},
              {"ignore_eos", true},
              {"logprobs", 0},
              {"return_tokens_as_token_ids", true},
              {"stream", true}};
}

std::optional<std::string> AppendChunkTokens(const Json& chunk, std::vector<int32_t>& tokens) {
  if (!chunk.contains("choices") || chunk["choices"].empty()) return std::nullopt;
  const Json& choice = chunk["choices"][0];
  if (choice.contains("logprobs") && choice["logprobs"].is_object()) {
    for (const Json& label : choice["logprobs"]["tokens"]) {
      int32_t id = -1;
      const std::string s = label.get<std::string>();
      if (s.rfind("token_id:", 0) == 0 && absl::SimpleAtoi(s.substr(9), &id)) {
        tokens.push_back(id);
      } else {
        ADD_FAILURE() << "unexpected token label " << s;
      }
    }
  }
  if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) {
    return choice["finish_reason"].get<std::string>();
  }
  return std::nullopt;
}

HttpOutcome HttpStreamCompletion(int port, const Json& body,
                                 const std::function<void(const std::vector<int32_t>&)>& on_chunk) {
  HttpOutcome outcome;
  SseStream stream(port, "/v1/completions", body.dump());
  outcome.status = stream.status();
  if (outcome.status != 200) {
    outcome.error = Json::parse(stream.ReadAll(), nullptr, /*allow_exceptions=*/false);
    return outcome;
  }
  while (std::optional<std::string> data = stream.Next()) {
    if (*data == "[DONE]") {
      outcome.done = true;
      continue;
    }
    const Json chunk = Json::parse(*data, nullptr, /*allow_exceptions=*/false);
    if (chunk.contains("error")) {
      outcome.error = chunk;
      continue;
    }
    const size_t before = outcome.tokens.size();
    if (std::optional<std::string> reason = AppendChunkTokens(chunk, outcome.tokens)) {
      outcome.finish_reason = *reason;
    }
    if (on_chunk && outcome.tokens.size() > before) on_chunk(outcome.tokens);
  }
  return outcome;
}

}  // namespace mobius::testing
