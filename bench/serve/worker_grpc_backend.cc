#include "bench/serve/worker_grpc_backend.h"

#include <unistd.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "worker.grpc.pb.h"

namespace mobius::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    default:
      return absl::StrCat("code ", static_cast<int>(code));
  }
}

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
  RequestOutcome outcome;
  if (request.is_text) {
    outcome.error =
        "text prompts need a tokenizer: use token-id prompts with --backend worker-grpc";
    return outcome;
  }
  v1::WorkerGenerateRequest call;
  call.set_request_id(absl::StrCat(id_prefix_, next_id_++));
  call.mutable_input_ids()->Assign(request.prompt_ids.begin(), request.prompt_ids.end());
  v1::SamplingParams* sampling = call.mutable_sampling_params();
  sampling->set_temperature(0);
  sampling->set_max_tokens(request.output_len);
  sampling->set_ignore_eos(true);

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoNanoseconds(options_.request_timeout));
  // wait_for_ready off: a worker that is down fails the request at once instead of queueing it.
  const Clock::time_point sent = Clock::now();
  std::unique_ptr<grpc::ClientReader<v1::WorkerGenerateResponse>> reader =
      stub_->worker->Generate(&context, call);
  v1::WorkerGenerateResponse response;
  int chunks = 0;
  int tokens = 0;
  bool complete = false;
  Clock::time_point last = sent;
  while (reader->Read(&response)) {
    const Clock::time_point now = Clock::now();
    const bool has_tokens = response.has_chunk() && response.chunk().token_ids_size() > 0;
    if (!has_tokens && !response.has_complete()) continue;
    if (chunks == 0) {
      outcome.ttft_s = Seconds(now - sent);
    } else {
      outcome.itl_s.push_back(Seconds(now - last));
    }
    last = now;
    ++chunks;
    if (has_tokens) tokens += response.chunk().token_ids_size();
    if (response.has_complete()) {
      complete = true;
      outcome.output_tokens = response.complete().usage().completion_tokens();
      outcome.prompt_tokens = response.complete().usage().prompt_tokens();
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) {
    outcome.error = absl::StrCat("gRPC ", CodeName(status.error_code()), ": ",
                                 status.error_message().substr(0, 200));
    outcome.itl_s.clear();
    return outcome;
  }
  if (!complete) {
    outcome.error = "stream ended without a complete message";
    outcome.itl_s.clear();
    return outcome;
  }
  if (outcome.output_tokens == 0) outcome.output_tokens = tokens;
  if (outcome.prompt_tokens == 0) outcome.prompt_tokens = request.prompt_len;
  outcome.latency_s = Seconds(last - sent);
  outcome.success = true;
  return outcome;
}

}  // namespace mobius::bench
