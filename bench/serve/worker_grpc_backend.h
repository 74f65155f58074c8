// Benchmark requests straight to one worker's `mobius.v1.Worker` Generate stream, bypassing the
// router, so that the router's own share of TTFT and ITL can be measured: the same token-id
// prompts, greedy, ignore_eos. Each streamed message with tokens, and the final `complete`, is
// a chunk (the HTTP path's final finish_reason event is its counterpart).
#ifndef MOBIUS_BENCH_SERVE_WORKER_GRPC_BACKEND_H_
#define MOBIUS_BENCH_SERVE_WORKER_GRPC_BACKEND_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bench/serve/request_backend.h"

namespace mobius::bench {

struct WorkerGrpcBackendOptions {
  std::string address;  // HOST:PORT of the worker's gRPC endpoint
  absl::Duration request_timeout = absl::Minutes(10);
};

class WorkerGrpcBackend final : public RequestBackend {
 public:
  // InvalidArgument for an empty address; the channel connects lazily.
  static absl::StatusOr<std::unique_ptr<WorkerGrpcBackend>> Create(
      WorkerGrpcBackendOptions options);
  ~WorkerGrpcBackend() override;

  // Token-id prompts only (the worker does not tokenize).
  RequestOutcome Send(const BenchRequest& request) override;

 private:
  struct Stub;
  WorkerGrpcBackend(WorkerGrpcBackendOptions options, std::unique_ptr<Stub> stub);

  const WorkerGrpcBackendOptions options_;
  std::unique_ptr<Stub> stub_;
  const std::string id_prefix_;
  std::atomic<uint64_t> next_id_{0};
};

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_WORKER_GRPC_BACKEND_H_
