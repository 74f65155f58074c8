// The router's gRPC front end: mobius.v1.Inference as a thin adapter over an InferenceService,
// plus grpc.health.v1.Health (SERVING while the service is Ready(), NOT_SERVING otherwise and
// for good once draining starts).
#ifndef MOBIUS_ROUTER_CORE_GRPC_INFERENCE_SERVICE_H_
#define MOBIUS_ROUTER_CORE_GRPC_INFERENCE_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "inference.grpc.pb.h"
#include "router/core/serving_health_service.h"
#include "router/inference_service.h"

namespace mobius::router {

class GrpcInferenceService final : public v1::Inference::Service {
 public:
  // `service` must outlive this object. `on_generate_done` (optional) is called once per Generate
  // call with its final status, e.g. to count requests.
  explicit GrpcInferenceService(InferenceService& service,
                                std::function<void(absl::StatusCode)> on_generate_done = nullptr);
  ~GrpcInferenceService() override;

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const v1::TokenizeRequest* request,
                        v1::TokenizeResponse* response) override;
  grpc::Status Detokenize(grpc::ServerContext* context, const v1::DetokenizeRequest* request,
                          v1::DetokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;
  grpc::Status Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override;

 private:
  // The sync API has no cancellation callback: one thread polls the contexts of the streams in
  // flight and raises their CallContext flag when the client has gone.
  void WatchCancellations();

  InferenceService& service_;
  const std::function<void(absl::StatusCode)> on_generate_done_;
  absl::Mutex mu_;
  absl::flat_hash_map<grpc::ServerContext*, std::atomic<bool>*> streams_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watcher_;
};

struct GrpcServerOptions {
  std::string host = "0.0.0.0";
  int port = 50050;  // 0 picks a free port
  // How often a health Watch and the health log look at InferenceService::Ready() (a Check asks
  // it at once).
  absl::Duration health_update_interval = absl::Milliseconds(200);
  // Called once per Generate call with its final status (see GrpcInferenceService).
  std::function<void(absl::StatusCode)> on_generate_done;
};

// A running gRPC server with the Inference and Health services.
class GrpcFrontEnd {
 public:
  // Binds and starts serving. `service` must outlive the front end.
  static absl::StatusOr<std::unique_ptr<GrpcFrontEnd>> Start(InferenceService& service,
                                                             const GrpcServerOptions& options);
  ~GrpcFrontEnd();

  [[nodiscard]] int port() const { return port_; }
  // Health turns NOT_SERVING and stays so; the services keep answering.
  void SetDraining();
  // Stops the server; calls in flight may finish until `deadline`, then are cancelled.
  void Shutdown(absl::Time deadline);

 private:
  GrpcFrontEnd(InferenceService& service, const GrpcServerOptions& options);
  // What health reports: the service is Ready() and the front end neither draining nor stopping.
  bool Serving();
  // Logs the health status when it changes.
  void LogHealthLoop();

  InferenceService& service_;
  const GrpcServerOptions options_;
  GrpcInferenceService adapter_;
  ServingHealthService health_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread health_thread_;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_GRPC_INFERENCE_SERVICE_H_
