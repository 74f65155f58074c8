// The matrix rate a backend reaches, measured the way its model steps multiply: Backend::Linear
// on square operands of random values, in the backend's activation dtype (bf16 on CUDA, through
// cuBLASLt). `mobius bench engine` divides a step's FLOPs by it for the step's FLOP bound, as it
// divides the step's bytes by the copy bandwidth it measures in the same run.
#ifndef MOBIUS_CLI_MATRIX_RATE_PROBE_H_
#define MOBIUS_CLI_MATRIX_RATE_PROBE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace mobius::cli {

struct MatrixRate {
  double flops_per_second = 0;
  int64_t dim = 0;          // the product was [dim, dim] x [dim, dim]^T
  double per_call_s = 0;    // the fastest round's time per product
  int calls_per_round = 0;  // products queued back to back in each of three timed rounds
};

// Times three rounds of `calls` products of [dim, dim] x [dim, dim]^T queued back to back (after
// one warm-up product) and keeps the fastest round.
// InvalidArgument for dim or calls below 1; the backend's error when the operands do not fit.
absl::StatusOr<MatrixRate> MeasureMatrixRate(kernels::Backend& backend, int64_t dim, int calls);

}  // namespace mobius::cli

#endif  // MOBIUS_CLI_MATRIX_RATE_PROBE_H_
