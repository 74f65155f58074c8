#include "kernels/cuda/lt_gemm.h"

#include "absl/strings/str_format.h"

namespace mobius::kernels::cuda {
namespace {

int Alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  for (int a = 256; a > 1; a /= 2) {
    if (v % a == 0) return a;
  }
  return 1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LtGemm>> LtGemm::Create() {
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t st = cublasLtCreate(&handle);
  if (st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrFormat("cublasLtCreate failed: %s", cublasLtGetStatusString(st)));
  }
  void* workspace = nullptr;
  const cudaError_t err = cudaMalloc(&workspace, kWorkspaceBytes);
  if (err != cudaSuccess) {
    cublasLtDestroy(handle);
    return absl::ResourceExhaustedError(absl::StrFormat("cuBLASLt workspace of %d bytes: %s",
                                                        kWorkspaceBytes, cudaGetErrorString(err)));
  }
  return std::unique_ptr<LtGemm>(new LtGemm(handle, workspace));
}

LtGemm::~LtGemm() {
  for (auto& [key, plan] : plans_) {
    if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
    if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
    if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
    if (plan.op) cublasLtMatmulDescDestroy(plan.op);
  }
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

// Row-major y[m, n] = x[m, k] w[n, k]^T is column-major y^T[n, m] = (w^T)^T[n, k] x^T[k, m]:
// A = w viewed column-major as [k, n] (transposed), B = x viewed as [k, m], C = y as [n, m].
LtGemm::Plan& LtGemm::PlanFor(const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan& plan = plans_[key];
  const auto [m, n, k, y_f32, align_x, align_w, align_y] = key;
  const cudaDataType_t y_type = y_f32 ? CUDA_R_32F : CUDA_R_16BF;
  if (cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) {
    return plan;
  }
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a));
  cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b));
  if (cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_16BF, k, n, k) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_16BF, k, m, k) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&plan.c, y_type, n, m, n) != CUBLAS_STATUS_SUCCESS) {
    return plan;
  }
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return plan;
  const size_t workspace = kWorkspaceBytes;
  const uint32_t ax = align_x, aw = align_w, ay = align_y;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                       sizeof(workspace));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw,
                                       sizeof(aw));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax,
                                       sizeof(ax));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay,
                                       sizeof(ay));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay,
                                       sizeof(ay));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, plan.op, plan.a, plan.b, plan.c,
                                                           plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    plan.algo = result.algo;
    plan.ok = true;
  }
  return plan;
}

bool LtGemm::Run(const uint16_t* x, const uint16_t* w, void* y, bool y_f32, int64_t m, int64_t n,
                 int64_t k, cudaStream_t stream) {
  const Plan& plan = PlanFor(Key(m, n, k, y_f32, Alignment(x), Alignment(w), Alignment(y)));
  if (!plan.ok) return false;
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t st =
      cublasLtMatmul(handle_, plan.op, &alpha, w, plan.a, x, plan.b, &beta, y, plan.c, y, plan.c,
                     &plan.algo, workspace_, kWorkspaceBytes, stream);
  return st == CUBLAS_STATUS_SUCCESS;
}

}  // namespace mobius::kernels::cuda
