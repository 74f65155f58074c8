// grpc.health.v1.Health whose answer is computed when asked: Check and Watch report SERVING
// exactly while `serving()` is true. The router's readiness (a replica healthy and the model
// known, not draining) changes with its replicas; gRPC's default health service instead holds a
// stored status that only exists once the server has started, so for the moment between the
// port opening and the first SetServingStatus it answered SERVING for a router that knew no
// model yet (CI: a request in that moment failed with "no worker replica has answered yet").
#ifndef MOBIUS_ROUTER_CORE_SERVING_HEALTH_SERVICE_H_
#define MOBIUS_ROUTER_CORE_SERVING_HEALTH_SERVICE_H_

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace mobius::router {

class ServingHealthService final : public grpc::health::v1::Health::Service {
 public:
  // `serving` is called on every Check and every `watch_interval` of a Watch; `service_name` is
  // the service that may be named in a request besides "" (the whole server).
  ServingHealthService(std::function<bool()> serving, std::string service_name,
                       absl::Duration watch_interval);

  grpc::Status Check(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;
  // Streams the status at once and then on every change, until the client cancels or Stop().
  grpc::Status Watch(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

  // Ends the watches in flight (before the server shuts down); later ones end at once.
  void Stop();

 private:
  bool Known(const std::string& service) const;
  grpc::health::v1::HealthCheckResponse::ServingStatus Status() const;

  const std::function<bool()> serving_;
  const std::string service_name_;
  const absl::Duration watch_interval_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_SERVING_HEALTH_SERVICE_H_
