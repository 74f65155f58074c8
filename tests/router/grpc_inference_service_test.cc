// The router's gRPC front end end to end: a real client of mobius.v1.Inference and
// grpc.health.v1.Health against GrpcFrontEnd over RouterService over an in-process worker.
#include "router/core/grpc_inference_service.h"

#include <chrono>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "inference.grpc.pb.h"
#include "router/core/router_service.h"
#include "tests/model/fixture_util.h"
#include "tests/router/router_test_util.h"

namespace mobius::router {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class GrpcInferenceServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = mobius::testing::LoadReference(mobius::testing::FixtureModelDir(testing::kModel));
    worker_ = std::make_unique<testing::InProcessWorker>();
    ReplicaSetOptions replica_options;
    replica_options.health_check_interval = absl::Milliseconds(50);
    auto replicas = ReplicaSet::Create({worker_->address()}, replica_options);
    ASSERT_TRUE(replicas.ok()) << replicas.status();
    (*replicas)->PollOnce();
    router_ = std::make_unique<RouterService>(std::move(*replicas), nullptr, RouterOptions());
    GrpcServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.health_update_interval = absl::Milliseconds(20);
    auto front = GrpcFrontEnd::Start(*router_, options);
    ASSERT_TRUE(front.ok()) << front.status();
    front_ = std::move(*front);
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(front_->port()),
                                       grpc::InsecureChannelCredentials());
    stub_ = v1::Inference::NewStub(channel);
    health_ = grpc::health::v1::Health::NewStub(channel);
  }
  void TearDown() override {
    if (front_) front_->Shutdown(absl::Now() + absl::Seconds(1));
  }

  HealthCheckResponse::ServingStatus Health() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    HealthCheckResponse response;
    if (!health_->Check(&context, HealthCheckRequest(), &response).ok()) {
      return HealthCheckResponse::UNKNOWN;
    }
    return response.status();
  }

  mobius::testing::ModelReference ref_;
  std::unique_ptr<testing::InProcessWorker> worker_;
  std::unique_ptr<RouterService> router_;
  std::unique_ptr<GrpcFrontEnd> front_;
  std::unique_ptr<v1::Inference::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

TEST_F(GrpcInferenceServiceTest, GenerateStreamsTheReferenceTokens) {
  const auto& [p, expected] = ref_.greedy[2];
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, testing::GreedyRequest(ref_.prompts[p], expected.size()));
  v1::GenerateResponse response;
  std::vector<int32_t> tokens;
  int completes = 0;
  while (reader->Read(&response)) {
    if (response.has_chunk()) {
      tokens.insert(tokens.end(), response.chunk().token_ids().begin(),
                    response.chunk().token_ids().end());
    } else {
      ++completes;
      EXPECT_EQ(response.complete().finish_reason(), v1::FINISH_REASON_LENGTH);
    }
  }
  grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, expected);
  EXPECT_EQ(completes, 1);
}

TEST_F(GrpcInferenceServiceTest, ErrorsKeepTheirCode) {
  v1::GenerateRequest request = testing::GreedyRequest({1, 2}, 4);
  request.mutable_sampling_params()->set_top_p(2);
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, request);
  v1::GenerateResponse response;
  EXPECT_FALSE(reader->Read(&response));
  grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("top_p"), std::string::npos);

  grpc::ClientContext tokenize_context;
  v1::TokenizeResponse ids;
  EXPECT_EQ(stub_->Tokenize(&tokenize_context, v1::TokenizeRequest(), &ids).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  grpc::ClientContext info_context;
  v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&info_context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.vocab_size(), 2048);
}

TEST_F(GrpcInferenceServiceTest, ClientCancellationFreesTheWorker) {
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, testing::GreedyRequest(ref_.prompts[0], 3000));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(worker_->WaitIdle(1000)) << "the worker still runs the cancelled request";
  for (int i = 0; i < 100 && router_->in_flight() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(router_->in_flight(), 0);
}

TEST_F(GrpcInferenceServiceTest, ClientDeadlineIsPropagated) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  auto reader = stub_->Generate(&context, testing::GreedyRequest(ref_.prompts[0], 3000));
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(worker_->WaitIdle(1000)) << "the worker still runs the expired request";
}

TEST_F(GrpcInferenceServiceTest, HealthFollowsReadinessAndDraining) {
  EXPECT_EQ(Health(), HealthCheckResponse::SERVING);
  front_->SetDraining();
  EXPECT_EQ(Health(), HealthCheckResponse::NOT_SERVING);
}

TEST_F(GrpcInferenceServiceTest, HealthIsNotServingWithoutHealthyReplicas) {
  EXPECT_EQ(Health(), HealthCheckResponse::SERVING);
  worker_->Kill();
  HealthCheckResponse::ServingStatus status = HealthCheckResponse::SERVING;
  for (int i = 0; i < 100 && status == HealthCheckResponse::SERVING; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    status = Health();
  }
  EXPECT_EQ(status, HealthCheckResponse::NOT_SERVING);
}

}  // namespace
}  // namespace mobius::router
