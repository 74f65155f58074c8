// What the MoE kernel files share (moe_kernels.cu: many tokens; moe_few_tokens.cu: decode steps).
#ifndef MOBIUS_KERNELS_CUDA_MOE_COMMON_CUH_
#define MOBIUS_KERNELS_CUDA_MOE_COMMON_CUH_

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace mobius::kernels::cuda {

// MOBIUS_MOE_GEMM (read once): 0 unset, 1 "fma" (the CUDA-core grouped path with the multi-launch
// grouping, the old kernel; ForcedFma), 2 "grouped" (the grouped path even where the few-token
// kernels would run; LaunchMoeExpertsFewTokens declines).
int MoeGemmKnob();
bool ForcedFma();

// routed sum + sigmoid(shared_gate[t]) * shared[i], rounded as the separate ops round (the sum
// stored to a zeroed out, then AddSigmoidScaled), so both give the same bits and a batch that
// takes this path and one that does not round alike. `shared_value` holds a bf16 value.
__device__ __forceinline__ uint16_t RoutedPlusShared(float sum, float shared_value,
                                                     float gate_logit) {
  const float routed = Bf16ToF32(F32ToBf16(sum));
  return F32ToBf16(routed + Sigmoid(gate_logit) * shared_value);
}

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_MOE_COMMON_CUH_
