// Argument checks and host-side arithmetic shared by the communicator implementations, so that
// every implementation refuses the same malformed calls with the same messages and sums bf16 the
// same way (widened to fp32, rounded once at the end).
#ifndef MOBIUS_WORKER_DISTRIBUTED_COLLECTIVE_UTIL_H_
#define MOBIUS_WORKER_DISTRIBUTED_COLLECTIVE_UTIL_H_

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "kernels/tensor.h"

namespace mobius::worker {

// InvalidArgument unless `t` is non-empty, F32 or BF16 (the reducible types).
absl::Status CheckReducible(const kernels::Tensor& t, std::string_view op);
// InvalidArgument unless `t` is in host memory (the CPU backend's tensors).
absl::Status CheckHost(const kernels::Tensor& t, std::string_view op);
// out.dim(0) == world * in.dim(0), same dtype and row size.
absl::Status CheckAllGather(const kernels::Tensor& in, const kernels::Tensor& out, int world);
// in.dim(0) == world * out.dim(0), same dtype and row size, reducible.
absl::Status CheckReduceScatter(const kernels::Tensor& in, const kernels::Tensor& out, int world);
absl::Status CheckRoot(int root, int world, std::string_view op);

// acc[i] += src[i] (src of F32 or BF16, widened to fp32).
void AccumulateF32(float* acc, const void* src, kernels::DType dtype, int64_t n);
// dst[i] = src[i] (fp32 to F32 or BF16, rounded to nearest even).
void StoreF32As(const float* src, void* dst, kernels::DType dtype, int64_t n);
// dst[i] = src[i] widened to fp32.
void LoadAsF32(const void* src, kernels::DType dtype, float* dst, int64_t n);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_DISTRIBUTED_COLLECTIVE_UTIL_H_
