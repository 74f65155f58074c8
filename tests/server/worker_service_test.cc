// mobius.v1.Worker end to end in-process: a real gRPC server on a local port, a real client.
#include "worker/server/worker_service.h"

#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tests/model/fixture_util.h"

namespace mobius::worker {
namespace {

class WorkerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = testing::FixtureModelDir("qwen3next-tiny");
    backend_ = kernels::CreateCpuBackend(1);
    model_ = testing::LoadFixtureModel(dir, *backend_);
    ASSERT_NE(model_, nullptr);
    ref_ = testing::LoadReference(dir);
    EngineOptions options;
    options.scheduler.max_num_seqs = 2;
    options.max_model_len = 512;
    auto engine = Engine::Create(*model_, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
    service_ = std::make_unique<WorkerService>(*engine_, model_->config(), "tiny",
                                               std::vector<int32_t>{}, 512);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    stub_ = v1::Worker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                    grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
    if (engine_) engine_->Shutdown(false);
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<HybridModel> model_;
  testing::ModelReference ref_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

TEST_F(WorkerServiceTest, GenerateStreamsReferenceTokensThenCompletes) {
  const auto& [p, expected] = ref_.greedy[1];
  v1::WorkerGenerateRequest request;
  request.set_request_id("a");
  for (int32_t t : ref_.prompts[p]) request.add_input_ids(t);
  request.mutable_sampling_params()->set_temperature(0);
  request.mutable_sampling_params()->set_max_tokens(static_cast<int>(expected.size()));
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, request);
  v1::WorkerGenerateResponse response;
  std::vector<int32_t> tokens;
  bool completed = false;
  while (reader->Read(&response)) {
    if (response.has_chunk()) {
      EXPECT_FALSE(completed);
      tokens.insert(tokens.end(), response.chunk().token_ids().begin(),
                    response.chunk().token_ids().end());
    } else {
      completed = true;
      EXPECT_EQ(response.complete().finish_reason(), v1::FINISH_REASON_LENGTH);
      EXPECT_EQ(response.complete().usage().prompt_tokens(),
                static_cast<int>(ref_.prompts[p].size()));
      EXPECT_EQ(response.complete().usage().completion_tokens(), static_cast<int>(expected.size()));
    }
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(completed);
  EXPECT_EQ(tokens, expected);
}

TEST_F(WorkerServiceTest, BadRequestIsInvalidArgument) {
  v1::WorkerGenerateRequest request;
  request.add_input_ids(1 << 20);
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, request);
  v1::WorkerGenerateResponse response;
  EXPECT_FALSE(reader->Read(&response));
  grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("vocabulary"), std::string::npos);
}

TEST_F(WorkerServiceTest, ClientCancellationFreesTheSlot) {
  for (int round = 0; round < 3; ++round) {  // 3 > max_num_seqs: slots must come back
    v1::WorkerGenerateRequest request;
    request.set_request_id("long" + std::to_string(round));
    request.add_input_ids(5);
    request.mutable_sampling_params()->set_max_tokens(400);
    grpc::ClientContext context;
    auto reader = stub_->Generate(&context, request);
    v1::WorkerGenerateResponse response;
    ASSERT_TRUE(reader->Read(&response));
    context.TryCancel();
    while (reader->Read(&response)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // Within a few steps, nothing is running.
  for (int i = 0; i < 200; ++i) {
    grpc::ClientContext context;
    v1::GetLoadsResponse loads;
    ASSERT_TRUE(stub_->GetLoads(&context, v1::GetLoadsRequest(), &loads).ok());
    if (loads.num_running() == 0 && loads.num_waiting() == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ADD_FAILURE() << "cancelled requests still hold slots";
}

TEST_F(WorkerServiceTest, ModelInfo) {
  grpc::ClientContext context;
  v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model_name(), "tiny");
  EXPECT_EQ(info.vocab_size(), 2048);
  EXPECT_EQ(info.model_type(), "qwen3_next");
}

}  // namespace
}  // namespace mobius::worker
