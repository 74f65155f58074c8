// The CUDA implementation of kernels::Backend: bf16 weights and activations with fp32
// accumulation, fp32 DeltaNet states, for Hopper GPUs (sm_90a). Every op is queued
// asynchronously on one stream owned by the backend; host reads synchronise that stream.
#ifndef MOBIUS_KERNELS_CUDA_CUDA_BACKEND_H_
#define MOBIUS_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

struct CUstream_st;  // cudaStream_t, without the CUDA headers

namespace mobius::kernels {

// Creates a backend on CUDA device `device_ordinal`. NotFound when there is no such device,
// Internal when the CUDA runtime or cuBLASLt cannot be initialised on it.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device_ordinal = 0);

// The CUDA backend's limits on a model's shapes (Backend::CheckModelOpShapes; a host function,
// so that it runs without a GPU): head_dim, linear_key_head_dim and linear_conv_kernel_dim.
absl::Status CheckCudaModelOpShapes(const ModelOpShapes& shapes);

// The stream every op of `backend` is queued on (so that NCCL collectives order with them), or
// null when `backend` is not a CUDA backend.
CUstream_st* CudaBackendStream(Backend& backend);

}  // namespace mobius::kernels

#endif  // MOBIUS_KERNELS_CUDA_CUDA_BACKEND_H_
