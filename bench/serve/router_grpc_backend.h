// Benchmark requests over the router's own gRPC API (`mobius.v1.Inference` Generate): the
// router's routing and streaming without the HTTP/JSON front end, so that a run against it sits
// between the OpenAI API and a worker direct and splits the router's overhead in two. Token-id
// and text prompts (the router tokenizes); greedy, ignore_eos.
#ifndef MOBIUS_BENCH_SERVE_ROUTER_GRPC_BACKEND_H_
#define MOBIUS_BENCH_SERVE_ROUTER_GRPC_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bench/serve/request_backend.h"

namespace mobius::bench {

struct RouterGrpcBackendOptions {
  std::string address;  // HOST:PORT of the router's gRPC endpoint
  absl::Duration request_timeout = absl::Minutes(10);
};

class RouterGrpcBackend final : public RequestBackend {
 public:
  // InvalidArgument for an empty address; the channel connects lazily.
  static absl::StatusOr<std::unique_ptr<RouterGrpcBackend>> Create(
      RouterGrpcBackendOptions options);
  ~RouterGrpcBackend() override;

  RequestOutcome Send(const BenchRequest& request) override;

 private:
  struct Stub;
  RouterGrpcBackend(RouterGrpcBackendOptions options, std::unique_ptr<Stub> stub);

  const RouterGrpcBackendOptions options_;
  std::unique_ptr<Stub> stub_;
};

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_ROUTER_GRPC_BACKEND_H_
