#include "tests/router/router_test_util.h"

#include <chrono>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tests/model/fixture_util.h"

namespace mobius::router::testing {

// The real WorkerService, with a record of the Abort calls (so that tests can tell an Abort RPC
// from a cancelled stream, which end the same way in the engine).
class InProcessWorker::RecordingService final : public v1::Worker::Service {
 public:
  explicit RecordingService(worker::WorkerService& inner) : inner_(inner) {}

  grpc::Status Generate(grpc::ServerContext* context, const v1::WorkerGenerateRequest* request,
                        grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) override {
    return inner_.Generate(context, request, writer);
  }
  grpc::Status Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      aborts_.push_back(request->request_id());
    }
    return inner_.Abort(context, request, response);
  }
  grpc::Status GetLoads(grpc::ServerContext* context, const v1::GetLoadsRequest* request,
                        v1::GetLoadsResponse* response) override {
    return inner_.GetLoads(context, request, response);
  }
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override {
    return inner_.GetModelInfo(context, request, response);
  }

  std::vector<std::string> aborts() {
    absl::MutexLock lock(&mu_);
    return aborts_;
  }

 private:
  worker::WorkerService& inner_;
  absl::Mutex mu_;
  std::vector<std::string> aborts_ ABSL_GUARDED_BY(mu_);
};

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
  recording_ = std::make_unique<RecordingService>(*service_);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(recording_.get());
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

std::vector<std::string> InProcessWorker::abort_calls() {
  return recording_ ? recording_->aborts() : std::vector<std::string>();
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
