// The gated DeltaNet's per-token arithmetic as the kernels that form it share it: the gates
// kernel, the recurrent delta rule and the one-launch step (deltanet_decode_step.cu). Which of
// them a step runs depends on its batch and token counts, and greedy tokens must not: a
// speculative verify step's must equal a plain decode step's. So these pieces are written once
// and the kernels give the same bits.
#ifndef MOBIUS_KERNELS_CUDA_DELTANET_RECURRENCE_CUH_
#define MOBIUS_KERNELS_CUDA_DELTANET_RECURRENCE_CUH_

namespace mobius::kernels::cuda {

// g = -exp(a_log) * softplus(a + dt_bias).
__device__ __forceinline__ float DeltaGateG(float a, float a_log, float dt_bias) {
  const float av = a + dt_bias;
  const float softplus = av > 20.0f ? av : log1pf(expf(av));
  return -expf(a_log) * softplus;
}

// beta = sigmoid(b).
__device__ __forceinline__ float DeltaGateBeta(float b) { return 1.0f / (1.0f + expf(-b)); }

// The l2 normalisation of a token's q and k, lane l holding elements l, l + 32, ... (zeros past
// Dk): qinv = q_scale / |q| and kinv = 1 / |k| (with 1e-6 under the roots), and kq = k.q after
// both scalings; every lane of the warp gets the same values.
template <int kPer>
__device__ __forceinline__ void DeltaRuleQkNorms(const float (&qn)[kPer], const float (&kn)[kPer],
                                                 float q_scale, float& qinv, float& kinv,
                                                 float& kq) {
  float qss = 0.f, kss = 0.f, qk = 0.f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    qss += qn[e] * qn[e];
    kss += kn[e] * kn[e];
    qk += qn[e] * kn[e];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    qss += __shfl_xor_sync(0xffffffffu, qss, o);
    kss += __shfl_xor_sync(0xffffffffu, kss, o);
    qk += __shfl_xor_sync(0xffffffffu, qk, o);
  }
  qinv = rsqrtf(qss + 1e-6f) * q_scale;
  kinv = rsqrtf(kss + 1e-6f);
  kq = qk * qinv * kinv;
}

// The state layout of the warp kernels: a warp holds kPasses float4 pieces of a head's state,
// rows r0 + (32 / kLpr) * p, 4 value columns per lane, kLpr lanes per row.
//
// u = S^T k and sq = S^T q over those rows, summed over the warp's rows (lanes of a column meet
// through xor shuffles); a warp pair that splits the rows adds its partner's after this.
template <int kPasses, int kLpr>
__device__ __forceinline__ void DeltaRuleProducts(const float4 (&S)[kPasses], const float* k_s,
                                                  const float* q_s, int r0, float4& u, float4& sq) {
  constexpr int kRowsPerPass = 32 / kLpr;
  u = make_float4(0.f, 0.f, 0.f, 0.f);
  sq = u;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = r0 + kRowsPerPass * p;
    const float kr = k_s[r], qr = q_s[r];
    u.x += S[p].x * kr;
    u.y += S[p].y * kr;
    u.z += S[p].z * kr;
    u.w += S[p].w * kr;
    sq.x += S[p].x * qr;
    sq.y += S[p].y * qr;
    sq.z += S[p].z * qr;
    sq.w += S[p].w * qr;
  }
#pragma unroll
  for (int o = kLpr; o < 32; o <<= 1) {
    u.x += __shfl_xor_sync(0xffffffffu, u.x, o);
    u.y += __shfl_xor_sync(0xffffffffu, u.y, o);
    u.z += __shfl_xor_sync(0xffffffffu, u.z, o);
    u.w += __shfl_xor_sync(0xffffffffu, u.w, o);
    sq.x += __shfl_xor_sync(0xffffffffu, sq.x, o);
    sq.y += __shfl_xor_sync(0xffffffffu, sq.y, o);
    sq.z += __shfl_xor_sync(0xffffffffu, sq.z, o);
    sq.w += __shfl_xor_sync(0xffffffffu, sq.w, o);
  }
}

// When a warp pair splits the rows: each warp publishes its partial products in `part`
// ([warp][lane][u, sq]; callers alternate two buffers by token parity, so that the next token's
// writes cannot race this token's reads), meets its partner at a barrier and adds the partner's
// part to its own. The barrier is the block's (__syncthreads: call from uniform control flow) or,
// with kPairBarrier, the named barrier 1 + warp / 2 of the pair's 64 threads alone, so that a
// pair does not wait for the block's slowest warp at every token (the block must have at most
// 30 warps and use no other named barrier).
template <int kLpr, bool kPairBarrier = false>
__device__ __forceinline__ void DeltaRuleAddPartner(float4 (*part)[kLpr][2], int warp, int lane,
                                                    float4& u, float4& sq) {
  if (lane < kLpr) {
    part[warp][lane][0] = u;
    part[warp][lane][1] = sq;
  }
  if constexpr (kPairBarrier) {
    // bar.sync is barrier.sync.aligned: every lane of the warp must reach it together. The
    // stores above are guarded by lane < kLpr and the warp reconverges after them, as named
    // barriers after divergent code assume elsewhere too (CUTLASS). The non-.aligned form,
    // measured together with other changes, was slower (performance.md, session 34).
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + warp / 2) : "memory");
  } else {
    __syncthreads();
  }
  const float4 pu = part[warp ^ 1][lane % kLpr][0];
  const float4 pq = part[warp ^ 1][lane % kLpr][1];
  u.x += pu.x;
  u.y += pu.y;
  u.z += pu.z;
  u.w += pu.w;
  sq.x += pq.x;
  sq.y += pq.y;
  sq.z += pq.z;
  sq.w += pq.w;
}

// delta = beta (v - exp(g) S^T k) for the lane's 4 columns.
__device__ __forceinline__ float4 DeltaRuleDelta(float4 v, float4 u, float decay, float b) {
  float4 delta;
  delta.x = b * (v.x - decay * u.x);
  delta.y = b * (v.y - decay * u.y);
  delta.z = b * (v.z - decay * u.z);
  delta.w = b * (v.w - decay * u.w);
  return delta;
}

// o = S_new^T q = exp(g) S^T q + delta (k . q) for the lane's 4 columns.
__device__ __forceinline__ float4 DeltaRuleOutput(float4 sq, float4 delta, float decay, float kq) {
  return make_float4(decay * sq.x + delta.x * kq, decay * sq.y + delta.y * kq,
                     decay * sq.z + delta.z * kq, decay * sq.w + delta.w * kq);
}

// S = exp(g) S + k delta^T over the warp's rows.
template <int kPasses, int kLpr>
__device__ __forceinline__ void DeltaRuleUpdate(float4 (&S)[kPasses], const float* k_s, int r0,
                                                float decay, float4 delta) {
  constexpr int kRowsPerPass = 32 / kLpr;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const float kr = k_s[r0 + kRowsPerPass * p];
    S[p].x = decay * S[p].x + kr * delta.x;
    S[p].y = decay * S[p].y + kr * delta.y;
    S[p].z = decay * S[p].z + kr * delta.z;
    S[p].w = decay * S[p].w + kr * delta.w;
  }
}

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_DELTANET_RECURRENCE_CUH_
