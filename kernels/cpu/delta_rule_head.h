// The gated delta rule of one value head over one segment, in its two algebraically equal forms.
// Internal to kernels/cpu: cpu_deltanet.cc normalises q and k and calls these per (segment, head).
#ifndef MOBIUS_KERNELS_CPU_DELTA_RULE_HEAD_H_
#define MOBIUS_KERNELS_CPU_DELTA_RULE_HEAD_H_

#include <cstdint>

namespace mobius::kernels::cpu {

// Token t (0-based within the segment) reads q + t * qk_stride and k + t * qk_stride (Dk floats,
// already l2-normalised, q scaled by Dk^-0.5), v + t * v_stride (Dv floats), g[t * gate_stride]
// and beta[t * gate_stride], and writes out + t * out_stride (Dv floats).
struct DeltaRuleHeadView {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;
  const float* beta = nullptr;
  float* out = nullptr;
  int64_t qk_stride = 0;
  int64_t v_stride = 0;
  int64_t gate_stride = 0;
  int64_t out_stride = 0;
  int num_tokens = 0;
  int dk = 0;
  int dv = 0;
};

// Tokens per chunk of the chunked form.
inline constexpr int kDeltaRuleChunk = 64;

// Token by token; `state` [Dk, Dv] is read and updated in place.
void DeltaRuleRecurrentHead(const DeltaRuleHeadView& view, float* state);

// Chunks of kDeltaRuleChunk tokens (the last one may be shorter); same contract.
void DeltaRuleChunkedHead(const DeltaRuleHeadView& view, float* state);

}  // namespace mobius::kernels::cpu

#endif  // MOBIUS_KERNELS_CPU_DELTA_RULE_HEAD_H_
