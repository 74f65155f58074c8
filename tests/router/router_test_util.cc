#include "tests/router/router_test_util.h"

#include <chrono>
#include <thread>

#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tests/model/fixture_util.h"

namespace mobius::router::testing {

InProcessWorker::InProcessWorker(const WorkerOptions& options) {
  const std::string dir = mobius::testing::FixtureModelDir(kModel);
  backend_ = kernels::CreateCpuBackend(1);
  model_ = mobius::testing::LoadFixtureModel(dir, *backend_);
  if (model_ == nullptr) {
    ADD_FAILURE() << "cannot load " << dir;
    return;
  }
  worker::EngineOptions engine_options;
  engine_options.scheduler.max_num_seqs = options.max_num_seqs;
  engine_options.max_model_len = options.max_model_len;
  auto engine = worker::Engine::Create(*model_, engine_options);
  if (!engine.ok()) {
    ADD_FAILURE() << engine.status();
    return;
  }
  engine_ = std::move(*engine);
  service_ = std::make_unique<worker::WorkerService>(*engine_, model_->config(), "tiny",
                                                     std::vector<int32_t>{}, options.max_model_len);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    ADD_FAILURE() << "worker server did not start";
    return;
  }
  server_->GetHealthCheckService()->SetServingStatus(true);
  stub_ = v1::Worker::NewStub(grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
}

InProcessWorker::~InProcessWorker() {
  Kill();
  if (engine_) engine_->Shutdown(/*drain=*/false);
}

void InProcessWorker::Kill() {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  server_.reset();
}

v1::GetLoadsResponse InProcessWorker::Loads() {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::GetLoadsResponse loads;
  grpc::Status status = stub_->GetLoads(&context, v1::GetLoadsRequest(), &loads);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return loads;
}

bool InProcessWorker::WaitIdle(int timeout_ms) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < end) {
    const v1::GetLoadsResponse loads = Loads();
    if (loads.num_running() == 0 && loads.num_waiting() == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

Collected RunGenerate(InferenceService& service, const v1::GenerateRequest& request,
                      const std::atomic<bool>* cancelled,
                      const std::function<void(const v1::TextChunk&)>& on_chunk) {
  Collected c;
  CallContext context;
  context.cancelled = cancelled;
  c.status = service.Generate(request, context, [&](const v1::GenerateResponse& response) {
    if (c.completes > 0) c.message_after_complete = true;
    c.request_id = response.request_id();
    if (response.has_chunk()) {
      ++c.chunks;
      c.tokens.insert(c.tokens.end(), response.chunk().token_ids().begin(),
                      response.chunk().token_ids().end());
      c.text += response.chunk().text();
      if (on_chunk) on_chunk(response.chunk());
    } else {
      ++c.completes;
      c.complete = response.complete();
    }
    return true;
  });
  return c;
}

v1::GenerateRequest GreedyRequest(const std::vector<int32_t>& ids, int max_tokens) {
  v1::GenerateRequest request;
  request.mutable_input_ids()->mutable_ids()->Assign(ids.begin(), ids.end());
  request.mutable_sampling_params()->set_temperature(0);
  request.mutable_sampling_params()->set_max_tokens(max_tokens);
  return request;
}

}  // namespace mobius::router::testing
