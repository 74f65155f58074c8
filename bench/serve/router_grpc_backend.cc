#include "bench/serve/router_grpc_backend.h"

#include <chrono>
#include <utility>

#include "bench/serve/grpc_stream_timing.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "inference.grpc.pb.h"

namespace mobius::bench {

struct RouterGrpcBackend::Stub {
  std::unique_ptr<v1::Inference::Stub> inference;
};

absl::StatusOr<std::unique_ptr<RouterGrpcBackend>> RouterGrpcBackend::Create(
    RouterGrpcBackendOptions options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError("--router HOST:PORT is required with --backend router-grpc");
  }
  if (options.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--request-timeout-s must be > 0");
  }
  auto stub = std::make_unique<Stub>();
  stub->inference = v1::Inference::NewStub(
      grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials()));
  return std::unique_ptr<RouterGrpcBackend>(
      new RouterGrpcBackend(std::move(options), std::move(stub)));
}

RouterGrpcBackend::RouterGrpcBackend(RouterGrpcBackendOptions options, std::unique_ptr<Stub> stub)
    : options_(std::move(options)), stub_(std::move(stub)) {}

RouterGrpcBackend::~RouterGrpcBackend() = default;

RequestOutcome RouterGrpcBackend::Send(const BenchRequest& request) {
  v1::GenerateRequest call;  // no request id: the router assigns unique ones
  if (request.is_text) {
    call.set_text(request.prompt_text);
  } else {
    call.mutable_input_ids()->mutable_ids()->Assign(request.prompt_ids.begin(),
                                                    request.prompt_ids.end());
  }
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
  const auto sent = std::chrono::steady_clock::now();
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub_->inference->Generate(&context, call);
  return ReadTimedGrpcStream(
      *reader, sent, request.prompt_len,
      [](const v1::GenerateResponse& r) { return r.has_chunk() ? r.chunk().token_ids_size() : 0; },
      [](const v1::GenerateResponse& r) {
        return r.has_complete() ? &r.complete().usage() : nullptr;
      });
}

}  // namespace mobius::bench
