// In-process worker replicas (real mobius.v1.Worker gRPC servers on 127.0.0.1 over the
// intern-s2-mobius-tiny fixture) and a client that collects a router's stream, for router tests.
#ifndef MOBIUS_TESTS_ROUTER_ROUTER_TEST_UTIL_H_
#define MOBIUS_TESTS_ROUTER_ROUTER_TEST_UTIL_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/server.h"
#include "inference.pb.h"
#include "kernels/backend.h"
#include "router/inference_service.h"
#include "worker.grpc.pb.h"
#include "worker/model/hybrid_model.h"
#include "worker/runtime/engine.h"
#include "worker/server/worker_service.h"

namespace mobius::router::testing {

inline constexpr char kModel[] = "intern-s2-mobius-tiny";

struct WorkerOptions {
  int max_num_seqs = 16;
  int max_model_len = 4096;
};

class InProcessWorker {
 public:
  // Loads the fixture model and serves it on a free local port; fails the test on error.
  explicit InProcessWorker(const WorkerOptions& options = {});
  ~InProcessWorker();

  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // Stops the server at once (calls in flight are cancelled), as if the process died.
  void Kill();
  // GetLoads over gRPC.
  v1::GetLoadsResponse Loads();
  // Polls GetLoads until nothing runs or waits; false after `timeout_ms`.
  bool WaitIdle(int timeout_ms);
  // Request ids of the Worker.Abort calls received so far, in order.
  [[nodiscard]] std::vector<std::string> abort_calls();

 private:
  class RecordingService;

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<worker::HybridModel> model_;
  std::unique_ptr<worker::Engine> engine_;
  std::unique_ptr<worker::WorkerService> service_;
  std::unique_ptr<RecordingService> recording_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Worker::Stub> stub_;
  int port_ = 0;
};

// Everything a Generate call produced.
struct Collected {
  absl::Status status;
  std::string request_id;
  std::vector<int32_t> tokens;
  std::string text;
  int chunks = 0;
  int completes = 0;
  bool message_after_complete = false;
  v1::TextComplete complete;
};

// Runs `request` through `service`; `on_chunk` (optional) sees each chunk as it arrives.
Collected RunGenerate(InferenceService& service, const v1::GenerateRequest& request,
                      const std::atomic<bool>* cancelled = nullptr,
                      const std::function<void(const v1::TextChunk&)>& on_chunk = nullptr);

// A greedy request for `ids` with max_tokens.
v1::GenerateRequest GreedyRequest(const std::vector<int32_t>& ids, int max_tokens);

}  // namespace mobius::router::testing

#endif  // MOBIUS_TESTS_ROUTER_ROUTER_TEST_UTIL_H_
