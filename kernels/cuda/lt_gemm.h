// y[m, n] = x[m, k] @ w[n, k]^T through cuBLASLt (bf16 inputs, fp32 compute, bf16 or fp32
// output), with the heuristic's choice cached per shape and pointer alignment.
#ifndef MOBIUS_KERNELS_CUDA_LT_GEMM_H_
#define MOBIUS_KERNELS_CUDA_LT_GEMM_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/statusor.h"

namespace mobius::kernels::cuda {

class LtGemm {
 public:
  static absl::StatusOr<std::unique_ptr<LtGemm>> Create();
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Queues the product on `stream`. False when cuBLASLt has no algorithm for this shape and
  // alignment (the caller falls back to its own kernel); nothing was queued then.
  bool Run(const uint16_t* x, const uint16_t* w, void* y, bool y_f32, int64_t m, int64_t n,
           int64_t k, cudaStream_t stream);

 private:
  // (m, n, k, y_f32, alignment of x, w, y in bytes)
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, int, int, int>;
  struct Plan {
    bool ok = false;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  LtGemm(cublasLtHandle_t handle, void* workspace) : handle_(handle), workspace_(workspace) {}
  Plan& PlanFor(const Key& key);

  static constexpr size_t kWorkspaceBytes = 32u << 20;
  cublasLtHandle_t handle_;
  void* workspace_;
  std::map<Key, Plan> plans_;
};

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_LT_GEMM_H_
