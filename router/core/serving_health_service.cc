#include "router/core/serving_health_service.h"

#include <utility>

namespace mobius::router {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

ServingHealthService::ServingHealthService(std::function<bool()> serving, std::string service_name,
                                           absl::Duration watch_interval)
    : serving_(std::move(serving)),
      service_name_(std::move(service_name)),
      watch_interval_(watch_interval) {}

bool ServingHealthService::Known(const std::string& service) const {
  return service.empty() || service == service_name_;
}

HealthCheckResponse::ServingStatus ServingHealthService::Status() const {
  return serving_() ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

grpc::Status ServingHealthService::Check(grpc::ServerContext*, const HealthCheckRequest* request,
                                         HealthCheckResponse* response) {
  if (!Known(request->service())) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "unknown service '" + request->service() + "'");
  }
  response->set_status(Status());
  return grpc::Status::OK;
}

grpc::Status ServingHealthService::Watch(grpc::ServerContext* context,
                                         const HealthCheckRequest* request,
                                         grpc::ServerWriter<HealthCheckResponse>* writer) {
  // As grpc.health.v1 specifies: an unknown service is reported as SERVICE_UNKNOWN, not an error.
  const bool known = Known(request->service());
  bool first = true;
  HealthCheckResponse::ServingStatus last = HealthCheckResponse::UNKNOWN;
  while (!context->IsCancelled()) {
    const HealthCheckResponse::ServingStatus now =
        known ? Status() : HealthCheckResponse::SERVICE_UNKNOWN;
    if (first || now != last) {
      HealthCheckResponse response;
      response.set_status(now);
      if (!writer->Write(response)) break;
      last = now;
      first = false;
    }
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stopped_), watch_interval_)) break;
  }
  return grpc::Status::OK;
}

void ServingHealthService::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

}  // namespace mobius::router
