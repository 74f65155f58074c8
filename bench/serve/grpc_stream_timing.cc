#include "bench/serve/grpc_stream_timing.h"

namespace mobius::bench {
namespace {

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

std::string GrpcFailureReason(const grpc::Status& status) {
  std::string message = status.error_message();
  if (message.size() > 200) message = message.substr(0, 200) + "...";
  return absl::StrCat("gRPC ", CodeName(status.error_code()), ": ", message);
}

}  // namespace mobius::bench
