#include "cli/matrix_rate_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace mobius::cli {
namespace {

// Values in [-1, 1) from a fixed linear congruential sequence: tensor cores draw more power
// (and may clock lower) on random operands than on zeros, so the probe must not multiply
// Allocate's zeros.
absl::StatusOr<kernels::Tensor> RandomMatrix(kernels::Backend& backend, int64_t dim,
                                             uint32_t seed) {
  ASSIGN_OR_RETURN(kernels::Tensor t, backend.Allocate(backend.activation_dtype(), {dim, dim}));
  std::vector<float> host(static_cast<size_t>(dim * dim));
  uint32_t state = seed;
  for (float& v : host) {
    state = state * 1664525u + 1013904223u;
    v = static_cast<float>(state >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  backend.CopyFromHost(host.data(), kernels::DType::kF32, t);
  return t;
}

constexpr int kRounds = 3;

}  // namespace

absl::StatusOr<MatrixRate> MeasureMatrixRate(kernels::Backend& backend, int64_t dim, int calls) {
  if (dim < 1 || calls < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "matrix-rate probe: dim = %d and calls = %d must both be at least 1", dim, calls));
  }
  ASSIGN_OR_RETURN(kernels::Tensor x, RandomMatrix(backend, dim, 1));
  ASSIGN_OR_RETURN(kernels::Tensor w, RandomMatrix(backend, dim, 2));
  ASSIGN_OR_RETURN(kernels::Tensor y, backend.Allocate(backend.activation_dtype(), {dim, dim}));
  backend.Linear(x, w, y);
  backend.Synchronize();
  MatrixRate rate;
  rate.dim = dim;
  rate.calls_per_round = calls;
  rate.per_call_s = 1e30;
  // Calls queued back to back, so that the host's launch and wait overhead is spread over them.
  for (int round = 0; round < kRounds; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < calls; ++c) backend.Linear(x, w, y);
    backend.Synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rate.per_call_s = std::min(rate.per_call_s, s / calls);
  }
  RETURN_IF_ERROR(backend.TakeOpError());
  rate.flops_per_second = 2.0 * static_cast<double>(dim) * dim * dim / rate.per_call_s;
  return rate;
}

}  // namespace mobius::cli
