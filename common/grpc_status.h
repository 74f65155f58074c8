// absl::Status -> grpc::Status at the edge of every gRPC service (absl and gRPC share the
// canonical code numbers, so the mapping is one to one).
#ifndef MOBIUS_COMMON_GRPC_STATUS_H_
#define MOBIUS_COMMON_GRPC_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace mobius {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace mobius

#endif  // MOBIUS_COMMON_GRPC_STATUS_H_
