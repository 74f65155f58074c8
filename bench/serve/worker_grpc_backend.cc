#include "bench/serve/worker_grpc_backend.h"

#include <unistd.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "bench/serve/grpc_stream_timing.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "worker.grpc.pb.h"

namespace mobius::bench {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

struct WorkerGrpcBackend::Stub {
  std::unique_ptr<v1::Worker::Stub> worker;
};

absl::StatusOr<std::unique_ptr<WorkerGrpcBackend>> WorkerGrpcBackend::Create(
    WorkerGrpcBackendOptions options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError("--worker HOST:PORT is required with --backend worker-grpc");
  }
  if (options.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--request-timeout-s must be > 0");
  }
  auto stub = std::make_unique<Stub>();
  stub->worker =
      v1::Worker::NewStub(grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials()));
  return std::unique_ptr<WorkerGrpcBackend>(
      new WorkerGrpcBackend(std::move(options), std::move(stub)));
}

WorkerGrpcBackend::WorkerGrpcBackend(WorkerGrpcBackendOptions options, std::unique_ptr<Stub> stub)
    : options_(std::move(options)),
      stub_(std::move(stub)),
      // Ids must be unique on the worker, which other benchmark runs may share.
      id_prefix_(absl::StrCat("bench-", getpid(), "-",
                              Clock::now().time_since_epoch().count() % 1000000, "-")) {}

WorkerGrpcBackend::~WorkerGrpcBackend() = default;

RequestOutcome WorkerGrpcBackend::Send(const BenchRequest& request) {
  if (request.is_text) {
    RequestOutcome refused;
    refused.error =
        "text prompts need a tokenizer: use token-id prompts with --backend worker-grpc";
    return refused;
  }
  v1::WorkerGenerateRequest call;
  call.set_request_id(absl::StrCat(id_prefix_, next_id_++));
  call.mutable_input_ids()->Assign(request.prompt_ids.begin(), request.prompt_ids.end());
  v1::SamplingParams* sampling = call.mutable_sampling_params();
  sampling->set_temperature(0);
  sampling->set_max_tokens(request.output_len);
  sampling->set_ignore_eos(true);
  if (!request.json_schema.empty()) {
    sampling->mutable_structured_output()->set_json_schema(request.json_schema);
  }

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoNanoseconds(options_.request_timeout));
  // wait_for_ready stays off: a worker that is down fails the request at once.
  const Clock::time_point sent = Clock::now();
  std::unique_ptr<grpc::ClientReader<v1::WorkerGenerateResponse>> reader =
      stub_->worker->Generate(&context, call);
  RequestOutcome outcome = ReadTimedGrpcStream(
      *reader, sent, request.prompt_len,
      [](const v1::WorkerGenerateResponse& r) {
        return r.has_chunk() ? r.chunk().token_ids_size() : 0;
      },
      [](const v1::WorkerGenerateResponse& r) {
        return r.has_complete() ? &r.complete().usage() : nullptr;
      });
  // The worker names the request in its errors; the bench's own id would make each failure a
  // reason of its own (RequestBackend::Send: reasons are counted).
  if (!outcome.success) {
    outcome.error = absl::StrReplaceAll(outcome.error, {{call.request_id(), "<request id>"}});
  }
  return outcome;
}

}  // namespace mobius::bench
