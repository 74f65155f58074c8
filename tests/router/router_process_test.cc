// The mobius-router binary as a process in front of a mobius-worker process: it becomes SERVING
// once the worker is healthy, streams the reference tokens, answers --help, and on SIGTERM turns
// NOT_SERVING, refuses new requests, finishes the request in flight and exits 0.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "inference.grpc.pb.h"
#include "tests/util/child_process.h"
#include "tests/util/run_command.h"

namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using mobius::testing::ChildProcess;
using mobius::testing::FreePort;
using mobius::testing::Health;
using mobius::testing::Listening;
using mobius::testing::ReservedPort;

mobius::v1::GenerateRequest Greedy(std::vector<int32_t> ids, int max_tokens) {
  mobius::v1::GenerateRequest request;
  request.mutable_input_ids()->mutable_ids()->Assign(ids.begin(), ids.end());
  request.mutable_sampling_params()->set_temperature(0);
  request.mutable_sampling_params()->set_max_tokens(max_tokens);
  return request;
}

TEST(RouterProcessTest, HelpListsTheRouterFlags) {
  const std::string out =
      mobius::testing::RunCommand(std::string(MOBIUS_ROUTER_BINARY) + " --help 2>&1").out;
  for (const char* flag :
       {"--worker", "--grpc_port", "--http_port", "--tokenizer", "--max_queued_requests",
        "--health_check_interval_ms", "--request_timeout_s", "--served_model_name"}) {
    EXPECT_NE(out.find(flag), std::string::npos) << flag << " missing from:\n" << out;
  }
}

TEST(RouterProcessTest, ServesThroughAWorkerAndDrainsOnSigterm) {
  const int worker_port = FreePort();
  const int router_port = FreePort();
  const std::string fixtures = MOBIUS_FIXTURES_DIR;
  ChildProcess worker({MOBIUS_WORKER_BINARY, "--model", fixtures + "/intern-s2-mobius-tiny",
                       "--host=127.0.0.1", "--port=" + std::to_string(worker_port),
                       "--max-num-seqs=4", "--threads=1"});
  // Dash spelling and a repeated --worker (the second address has no worker: it stays unhealthy
  // and gets no requests; reserved, so that no worker of a test running in parallel takes it).
  const ReservedPort down;
  ChildProcess router({MOBIUS_ROUTER_BINARY, "--worker", "127.0.0.1:" + std::to_string(worker_port),
                       "--worker=127.0.0.1:" + std::to_string(down.port()), "--host=127.0.0.1",
                       "--grpc-port=" + std::to_string(router_port),
                       "--tokenizer=" + fixtures + "/tokenizer-qwen3",
                       "--health-check-interval-ms=50"});
  // Connect once the router listens, so that the channel does not sit in reconnect backoff. It
  // listens after loading the tokenizer, which takes seconds on a loaded 2-core CI machine.
  bool listening = false;
  for (int i = 0; i < 1500 && !listening; ++i) {
    listening = Listening(router_port);
    if (!listening) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(listening) << "router never listened on " << router_port;
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(router_port),
                                     grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto stub = mobius::v1::Inference::NewStub(channel);
  bool serving = false;
  for (int i = 0; i < 300 && !serving; ++i) {
    serving = Health(*health) == HealthCheckResponse::SERVING;
    if (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(serving) << "router never became SERVING";

  {
    grpc::ClientContext context;
    auto reader = stub->Generate(&context, Greedy({7, 8, 9}, 8));
    mobius::v1::GenerateResponse response;
    int tokens = 0;
    bool completed = false;
    while (reader->Read(&response)) {
      tokens += response.chunk().token_ids_size();
      completed |= response.has_complete();
    }
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
    EXPECT_EQ(tokens, 8);
    EXPECT_TRUE(completed);
  }

  // A request in flight when SIGTERM arrives still completes.
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, Greedy({7}, 300));
  mobius::v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  std::thread terminator([&] { EXPECT_EQ(router.Terminate(), 0); });
  // Draining: health turns NOT_SERVING and new requests are refused.
  bool not_serving = false;
  for (int i = 0; i < 100 && !not_serving; ++i) {
    not_serving = Health(*health) == HealthCheckResponse::NOT_SERVING;
    if (!not_serving) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(not_serving);
  {
    grpc::ClientContext refused_context;
    auto refused = stub->Generate(&refused_context, Greedy({7}, 4));
    mobius::v1::GenerateResponse r;
    while (refused->Read(&r)) {
    }
    EXPECT_EQ(refused->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  int tokens = response.chunk().token_ids_size();
  bool completed = false;
  while (reader->Read(&response)) {
    tokens += response.chunk().token_ids_size();
    completed |= response.has_complete();
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(completed);
  EXPECT_EQ(tokens, 300);
  terminator.join();
  EXPECT_EQ(worker.Terminate(), 0);
}

}  // namespace
