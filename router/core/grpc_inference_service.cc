#include "router/core/grpc_inference_service.h"

#include "common/grpc_status.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "grpcpp/ext/health_check_service_server_builder_option.h"
#include "grpcpp/server_builder.h"

namespace mobius::router {

GrpcInferenceService::GrpcInferenceService(InferenceService& service,
                                           std::function<void(absl::StatusCode)> on_generate_done)
    : service_(service), on_generate_done_(std::move(on_generate_done)) {
  watcher_ = std::thread([this] { WatchCancellations(); });
}

GrpcInferenceService::~GrpcInferenceService() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watcher_.join();
}

void GrpcInferenceService::WatchCancellations() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(10))) {
    for (auto& [context, cancelled] : streams_) {
      if (context->IsCancelled()) cancelled->store(true);
    }
  }
}

grpc::Status GrpcInferenceService::Generate(grpc::ServerContext* context,
                                            const v1::GenerateRequest* request,
                                            grpc::ServerWriter<v1::GenerateResponse>* writer) {
  std::atomic<bool> cancelled{false};
  {
    absl::MutexLock lock(&mu_);
    streams_[context] = &cancelled;
  }
  CallContext call;
  call.cancelled = &cancelled;
  if (context->deadline() != std::chrono::system_clock::time_point::max()) {
    call.deadline = absl::FromChrono(context->deadline());
  }
  const absl::Status status = service_.Generate(
      *request, call,
      [writer](const v1::GenerateResponse& response) { return writer->Write(response); });
  {
    absl::MutexLock lock(&mu_);
    streams_.erase(context);
  }
  if (on_generate_done_) on_generate_done_(status.code());
  return ToGrpcStatus(status);
}

grpc::Status GrpcInferenceService::Tokenize(grpc::ServerContext*,
                                            const v1::TokenizeRequest* request,
                                            v1::TokenizeResponse* response) {
  absl::StatusOr<v1::TokenizeResponse> result = service_.Tokenize(*request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status GrpcInferenceService::Detokenize(grpc::ServerContext*,
                                              const v1::DetokenizeRequest* request,
                                              v1::DetokenizeResponse* response) {
  absl::StatusOr<v1::DetokenizeResponse> result = service_.Detokenize(*request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status GrpcInferenceService::GetModelInfo(grpc::ServerContext*,
                                                const v1::GetModelInfoRequest*,
                                                v1::ModelInfo* response) {
  absl::StatusOr<v1::ModelInfo> result = service_.GetModelInfo();
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status GrpcInferenceService::Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                                         v1::AbortResponse* response) {
  absl::StatusOr<v1::AbortResponse> result = service_.Abort(*request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

GrpcFrontEnd::GrpcFrontEnd(InferenceService& service, const GrpcServerOptions& options)
    : service_(service),
      options_(options),
      adapter_(service, options.on_generate_done),
      health_([this] { return Serving(); }, v1::Inference::service_full_name(),
              options.health_update_interval) {}

bool GrpcFrontEnd::Serving() {
  absl::MutexLock lock(&mu_);
  return !draining_ && !stopping_ && service_.Ready();
}

absl::StatusOr<std::unique_ptr<GrpcFrontEnd>> GrpcFrontEnd::Start(
    InferenceService& service, const GrpcServerOptions& options) {
  std::unique_ptr<GrpcFrontEnd> front(new GrpcFrontEnd(service, options));
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(options.host, ":", options.port);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &front->port_);
  builder.RegisterService(&front->adapter_);
  // Health from ServingHealthService only (answered from the live state), not gRPC's default
  // service with its stored status.
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
  builder.RegisterService(&front->health_);
  front->server_ = builder.BuildAndStart();
  if (front->server_ == nullptr || front->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", address));
  }
  front->health_thread_ = std::thread([f = front.get()] { f->LogHealthLoop(); });
  return front;
}

GrpcFrontEnd::~GrpcFrontEnd() { Shutdown(absl::Now()); }

void GrpcFrontEnd::LogHealthLoop() {
  bool serving = false;
  bool first = true;
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    const bool now_serving = !draining_ && service_.Ready();
    if (first || now_serving != serving) {
      MOBIUS_LOG(INFO, "router", "") << "health: " << (now_serving ? "SERVING" : "NOT_SERVING");
      serving = now_serving;
      first = false;
    }
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.health_update_interval);
  }
}

void GrpcFrontEnd::SetDraining() {
  // Health answers NOT_SERVING from the next check on, so load balancers stop sending at once.
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

void GrpcFrontEnd::Shutdown(absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || server_ == nullptr) return;
    stopping_ = true;
  }
  if (health_thread_.joinable()) health_thread_.join();
  health_.Stop();
  server_->Shutdown(absl::ToChronoTime(deadline));
  server_->Wait();
}

}  // namespace mobius::router
