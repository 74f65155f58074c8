// The mobius-worker binary as a process: it serves, reports health, and on SIGTERM turns
// NOT_SERVING, finishes the request in flight and exits 0.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/util/child_process.h"
#include "worker.grpc.pb.h"

namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using mobius::testing::ChildProcess;
using mobius::testing::FreePort;
using mobius::testing::Health;

// GET http://127.0.0.1:port/metrics with a plain socket; the response, or "" on failure.
std::string FetchMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t n;
      while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
    }
  }
  close(fd);
  return response;
}

TEST(WorkerProcessTest, ServesAndDrainsOnSigterm) {
  const int port = FreePort(), metrics_port = FreePort();
  const std::string model = std::string(MOBIUS_FIXTURES_DIR) + "/qwen3next-tiny";
  ChildProcess worker({MOBIUS_WORKER_BINARY, "--model", model, "--port=" + std::to_string(port),
                       "--metrics-port=" + std::to_string(metrics_port), "--host=127.0.0.1",
                       "--max-num-seqs=2", "--threads=1"});
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto stub = mobius::v1::Worker::NewStub(channel);
  bool serving = false;
  for (int i = 0; i < 300 && !serving; ++i) {
    serving = Health(*health) == HealthCheckResponse::SERVING;
    if (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(serving) << "worker never became SERVING";

  // A request in flight when SIGTERM arrives still completes.
  mobius::v1::WorkerGenerateRequest request;
  request.add_input_ids(7);
  request.mutable_sampling_params()->set_max_tokens(200);
  request.mutable_sampling_params()->set_ignore_eos(true);
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, request);
  mobius::v1::WorkerGenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  ASSERT_TRUE(response.has_chunk());

  // The metrics endpoint shows the request running and tokens counted.
  const std::string metrics = FetchMetrics(metrics_port);
  EXPECT_NE(metrics.find("200 OK"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("vllm:num_requests_running{model_name=\"qwen3next-tiny\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("vllm:generation_tokens_total"), std::string::npos);
  // The exposition is valid Prometheus text format (promtool ships in Debian's `prometheus`,
  // which .ci/run installs). promtool exits 1 on a parse error and 3 on lint findings; the only
  // lint finding allowed is the ':' in the vllm:* names, which vLLM-compatible dashboards and
  // autoscalers expect.
  const size_t body = metrics.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  const std::string path = ::testing::TempDir() + "/worker_metrics.txt";
  std::ofstream(path) << metrics.substr(body + 4);
  FILE* pipe = popen(("promtool check metrics < " + path + " 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string findings;
  char line[512];
  while (fgets(line, sizeof(line), pipe) != nullptr) findings += line;
  const int status = pclose(pipe);
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  EXPECT_TRUE(code == 0 || code == 3) << "promtool exit " << code << " (is the prometheus "
                                      << "package installed?):\n"
                                      << findings;
  std::istringstream lines(findings);
  for (std::string f; std::getline(lines, f);) {
    EXPECT_NE(f.find("metric names should not contain ':'"), std::string::npos) << f;
  }

  std::thread terminator([&] { EXPECT_EQ(worker.Terminate(), 0); });
  int tokens = response.chunk().token_ids_size();
  bool completed = false;
  while (reader->Read(&response)) {
    if (response.has_chunk()) tokens += response.chunk().token_ids_size();
    if (response.has_complete()) {
      completed = true;
      EXPECT_EQ(response.complete().finish_reason(), mobius::v1::FINISH_REASON_LENGTH);
    }
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(completed);
  EXPECT_EQ(tokens, 200);
  terminator.join();
}

}  // namespace
