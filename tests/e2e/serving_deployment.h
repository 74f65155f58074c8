// A deployment of real processes on loopback for the serving acceptance tests: mobius-worker
// replicas of the intern-s2-mobius-tiny fixture and one mobius-router in front of them, plus the
// clients the tests speak through (gRPC Inference, HTTP, each worker's Worker API and /metrics)
// and the reference outputs of `mobius generate`.
#ifndef MOBIUS_TESTS_E2E_SERVING_DEPLOYMENT_H_
#define MOBIUS_TESTS_E2E_SERVING_DEPLOYMENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "grpcpp/channel.h"
#include "inference.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/util/child_process.h"
#include "worker.grpc.pb.h"

namespace mobius::testing {

inline constexpr char kServedModel[] = "intern-s2-mobius-tiny";

struct DeploymentOptions {
  int workers = 2;
  // Extra flags of every worker (each runs --threads=1) and of the router.
  std::vector<std::string> worker_flags = {};
  std::vector<std::string> router_flags = {};
  // MOBIUS_DEBUG_STEP_DELAY_MS of the workers (0: unset): a slower step makes races observable.
  int step_delay_ms = 0;
  // Ranks (processes) of each replica (issue 5): rank 0 serves the Worker API, the others follow
  // it; `rank_flags` (e.g. --tp=2) go to every rank of every replica.
  int ranks = 1;
  std::vector<std::string> rank_flags = {};
};

class Deployment {
 public:
  // Starts the workers and the router and waits until the router is SERVING with every replica
  // healthy; fails the test (ready() false) otherwise.
  explicit Deployment(DeploymentOptions options);
  ~Deployment();

  [[nodiscard]] bool ready() const { return ready_; }
  [[nodiscard]] int http_port() const { return http_port_; }
  [[nodiscard]] int grpc_port() const { return grpc_port_; }
  [[nodiscard]] std::string worker_address(int i) const;
  [[nodiscard]] v1::Inference::Stub& inference() { return *inference_; }

  // Worker i's GetLoads (a default response when it does not answer).
  v1::GetLoadsResponse Loads(int i);
  // Polls worker i until nothing runs or waits and its KV blocks and state slots are all free;
  // false after `timeout_ms`.
  bool WaitWorkerIdle(int i, int timeout_ms);
  // Worker i's /metrics text; "" when it does not answer.
  std::string WorkerMetrics(int i);
  // The body of GET `path` on worker i's metrics port ("" when it does not answer).
  std::string WorkerHttp(int i, const std::string& path);
  // POST `path` (an empty JSON body) on worker i's metrics port: the status and the body.
  std::pair<int, std::string> WorkerHttpPost(int i, const std::string& path,
                                             const std::string& body = "{}");
  // The router's /metrics text.
  std::string RouterMetrics();

  void KillWorker(int i);       // SIGKILL (rank 0 of a multi-rank replica)
  void KillRank(int i, int r);  // SIGKILL rank r >= 1 of replica i
  // Whether the process of rank r of replica i has exited, and its exit status (-1: running).
  int RankExitStatus(int i, int r);
  void RestartWorker(int i);   // on the same ports
  int TerminateWorker(int i);  // SIGTERM; the exit code
  int TerminateRouter();       // SIGTERM; the exit code
  // Polls the router's /metrics until the replica's health gauge is `healthy`.
  bool WaitReplicaHealth(int i, bool healthy, int timeout_ms);

 private:
  struct Worker {
    int port = 0;
    int metrics_port = 0;
    std::unique_ptr<ChildProcess> process;
    std::unique_ptr<v1::Worker::Stub> stub;
    std::vector<std::unique_ptr<ChildProcess>> followers;  // ranks 1 .. ranks - 1
  };
  void StartWorker(Worker& worker);

  const DeploymentOptions options_;
  std::vector<Worker> workers_;
  std::unique_ptr<ChildProcess> router_;
  int grpc_port_ = 0;
  int http_port_ = 0;
  std::unique_ptr<v1::Inference::Stub> inference_;
  bool ready_ = false;
};

// The value of one series, written exactly as exposed (name{labels}, labels sorted by name), in
// a Prometheus text exposition; nullopt when absent.
std::optional<double> SeriesValue(const std::string& exposition, const std::string& series);

// `promtool check metrics` findings other than the ':' in vllm:* names (which vLLM-compatible
// dashboards and autoscalers need), plus promtool's exit status when it is neither 0 nor 3.
std::vector<std::string> PromtoolFindings(const std::string& exposition);

// Greedy output ids of `mobius generate` for a prompt (the CLI as a process).
std::vector<int32_t> MobiusGenerate(const std::vector<int32_t>& prompt, int max_tokens);

// A gRPC Generate call read to its end.
struct GrpcOutcome {
  grpc::Status status;
  std::vector<int32_t> tokens;
  bool completed = false;
  v1::TextComplete complete;
};
v1::GenerateRequest GreedyRequest(const std::vector<int32_t>& prompt, int max_tokens);
// `on_chunk` (optional) runs after each chunk with the tokens so far.
GrpcOutcome GrpcGenerate(v1::Inference::Stub& stub, const v1::GenerateRequest& request,
                         grpc::ClientContext* context = nullptr,
                         const std::function<void(const std::vector<int32_t>&)>& on_chunk = {});

// A streamed /v1/completions call read to its end: ids come from the `logprobs` tokens
// ("token_id:N"), since the tiny model has no tokenizer of its own.
struct HttpOutcome {
  int status = 0;
  std::vector<int32_t> tokens;
  std::string finish_reason;
  std::optional<nlohmann::json> error;  // an error event, or the error body of a non-200
  bool done = false;                    // saw data: [DONE]
};
nlohmann::json CompletionBody(const std::vector<int32_t>& prompt, int max_tokens);
HttpOutcome HttpStreamCompletion(
    int port, const nlohmann::json& body,
    const std::function<void(const std::vector<int32_t>&)>& on_chunk = {});
// Adds the token ids of one SSE completion chunk to `tokens`; the finish reason when it has one.
std::optional<std::string> AppendChunkTokens(const nlohmann::json& chunk,
                                             std::vector<int32_t>& tokens);

}  // namespace mobius::testing

#endif  // MOBIUS_TESTS_E2E_SERVING_DEPLOYMENT_H_
