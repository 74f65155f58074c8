// grpc.health.v1.Health as the router serves it (ServingHealthService): every answer follows the
// live state, with no moment where a stored status is stale, and Watch streams its changes.
#include "router/core/serving_health_service.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "grpcpp/create_channel.h"
#include "grpcpp/ext/health_check_service_server_builder_option.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace mobius::router {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class ServingHealthServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port_), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    service_.Stop();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  grpc::Status Check(const std::string& name, HealthCheckResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    HealthCheckRequest request;
    request.set_service(name);
    return stub_->Check(&context, request, response);
  }

  std::atomic<bool> serving_{false};
  ServingHealthService service_{[this] { return serving_.load(); }, "mobius.v1.Inference",
                                absl::Milliseconds(5)};
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
};

TEST_F(ServingHealthServiceTest, CheckAnswersFromTheCurrentState) {
  HealthCheckResponse response;
  // NOT_SERVING from the first answer on: nothing stored that could say SERVING before the state.
  ASSERT_TRUE(Check("", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  serving_ = true;
  ASSERT_TRUE(Check("", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  ASSERT_TRUE(Check("mobius.v1.Inference", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  serving_ = false;
  ASSERT_TRUE(Check("mobius.v1.Inference", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
}

TEST_F(ServingHealthServiceTest, CheckOfAnUnknownServiceIsNotFound) {
  HealthCheckResponse response;
  const grpc::Status status = Check("no.such.Service", &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(status.error_message().find("no.such.Service"), std::string::npos);
}

TEST_F(ServingHealthServiceTest, WatchStreamsChangesUntilStopped) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = stub_->Watch(&context, HealthCheckRequest());
  HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  serving_ = true;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  serving_ = false;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  service_.Stop();
  EXPECT_FALSE(reader->Read(&response));  // the stream ends
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(ServingHealthServiceTest, WatchOfAnUnknownServiceReportsServiceUnknown) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  HealthCheckRequest request;
  request.set_service("no.such.Service");
  auto reader = stub_->Watch(&context, request);
  HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVICE_UNKNOWN);
  context.TryCancel();
}

}  // namespace
}  // namespace mobius::router
