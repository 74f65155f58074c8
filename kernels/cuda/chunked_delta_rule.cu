// The gated delta rule in its chunked WY/UT form, for prefill segments.
//
// Within a chunk of C = 64 tokens with entry state S0 [Dk, Dv] and cumulative log-decay
// G_t = g_0 + ... + g_t, the recurrence S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - e^{g_t}
// S_{t-1}^T k_t))^T unrolls to (see kernels/cpu/delta_rule_head.cc)
//   (I + L) X = diag(beta) (V - diag(e^G) K S0),   L_tj = beta_t e^{G_t - G_j} k_t.k_j  (j < t)
// for the rows X_t that token t writes into the state, so with T = (I + L)^-1 (unit lower
// triangular):
//   w = T diag(beta e^G) K,   u = T diag(beta) V,   X = u - w S0,
//   o_t = e^{G_t} q_t^T S0 + sum_{j <= t} e^{G_t - G_j} (q_t.k_j) X_j,
//   S_end = e^{G_last} S0 + sum_j e^{G_last - G_j} k_j X_j^T.
// Two kernels:
//  1. ChunkPrepKernel, one block per (chunk, value head), all chunks in parallel: l2-normalises
//     q and k, computes K K^T and Q K^T on the tensor cores, solves T in fp32, and writes w, u,
//     P = (e^{G_t - G_j} q_t.k_j)_{j<=t}, qg = e^G q, kd = e^{G_last - G} k (all bf16) and
//     e^{G_last} to scratch.
//  2. ChunkStateKernel, one block per (segment, value head, 32 value columns), serial over the
//     segment's chunks: keeps S (fp32) in mma accumulators, and per chunk computes X = u - w S,
//     o = qg S + P X and S = e^{G_last} S + kd^T X, with the next chunk's inputs brought into
//     shared memory by three bulk copies (the prep kernel writes them in the shared-memory
//     layout) while the current one is computed.
// Matrix products use mma.sync m16n8k16 bf16 with fp32 accumulation; S and X enter them as bf16
// (as in flash-linear-attention), so results carry bf16-level relative error (~1e-3).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/tuning_knobs.h"
#include "kernels/cuda/wgmma.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kC = 64;         // tokens per chunk
constexpr int kBV = 32;        // value columns per state block
constexpr int kThreads = 256;  // 8 warps in both kernels

// ---- mma.sync / ldmatrix helpers ----

__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(p)));
}
__device__ __forceinline__ void Ldsm4T(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(p)));
}

// Element offset of (row, col) in a [rows][kLd] tile swizzled as TileOffset's: no padding, so a
// whole matrix is one contiguous run for a bulk copy and every 32-byte sector is written by one
// warp, and ldmatrix stays free of bank conflicts.
template <int kLd>
__device__ __forceinline__ int Swizzled(int row, int col) {
  return TileOffset<kLd>(row, col >> 3) + (col & 7);
}
// Element offset of (row, col) in row-major X of `ld` columns, or, with kSwizzledLd (== ld), in
// the swizzled layout.
template <int kSwizzledLd>
__device__ __forceinline__ int OffsetOf(int ld, int row, int col) {
  if constexpr (kSwizzledLd > 0) {
    return Swizzled<kSwizzledLd>(row, col);
  } else {
    return row * ld + col;
  }
}

// A fragment (16 x 16) at rows m0, cols k0 of row-major X[m][k] (ld elements per row).
template <int kSwizzledLd = 0>
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const uint16_t* x, int ld, int m0, int k0,
                                      int lane) {
  Ldsm4(a, x + OffsetOf<kSwizzledLd>(ld, m0 + (lane & 15), k0 + (lane >> 4) * 8));
}
// A fragment of A = Xt^T, Xt stored row-major [k][m].
template <int kSwizzledLd = 0>
__device__ __forceinline__ void LoadAT(uint32_t (&a)[4], const uint16_t* xt, int ld, int m0, int k0,
                                       int lane) {
  Ldsm4T(a, xt + OffsetOf<kSwizzledLd>(ld, k0 + (lane & 7) + ((lane >> 4) << 3),
                                       m0 + ((lane >> 3) & 1) * 8));
}
// B fragments of two n-tiles (n0, n0 + 8) at k0, B stored as Bt[n][k]: {b0, b1} of tile n0 in
// r[0], r[1], of tile n0 + 8 in r[2], r[3].
__device__ __forceinline__ void LoadBNK(uint32_t (&r)[4], const uint16_t* bt, int ld, int n0,
                                        int k0, int lane) {
  Ldsm4(r, bt + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + ((lane >> 3) & 1) * 8);
}
// The same, B stored row-major B[k][n].
__device__ __forceinline__ void LoadBKN(uint32_t (&r)[4], const uint16_t* b, int ld, int n0, int k0,
                                        int lane) {
  Ldsm4T(r, b + (k0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * ld + n0 + (lane >> 4) * 8);
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  return static_cast<uint32_t>(F32ToBf16(lo)) | (static_cast<uint32_t>(F32ToBf16(hi)) << 16);
}

// ---- chunk bookkeeping ----

__device__ __forceinline__ int NumChunks(int len, int min_tokens) {
  return (len >= min_tokens && len > 0) ? (len + kC - 1) / kC : 0;
}

// Warp-cooperative: the chunked segment that global chunk `c` belongs to and its chunk index
// within it. Every lane gets the answer.
__device__ void FindChunk(const SegmentMeta& segs, int min_tokens, int c, int* seg, int* local) {
  const int lane = threadIdx.x & 31;
  int base = 0;
  for (int s0 = 0; s0 < segs.num_segments; s0 += 32) {
    const int s = s0 + lane;
    const int n = s < segs.num_segments ? NumChunks(segs.num_tokens[s], min_tokens) : 0;
    int incl = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    const int lo = base + incl - n;
    const unsigned hit = __ballot_sync(0xffffffffu, n > 0 && c >= lo && c < lo + n);
    if (hit != 0) {
      const int src = __ffs(hit) - 1;
      *seg = s0 + src;
      *local = c - __shfl_sync(0xffffffffu, lo, src);
      return;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  *seg = -1;
  *local = 0;
}

// Warp-cooperative: the global index of the first chunk of segment `seg`.
__device__ int FirstChunk(const SegmentMeta& segs, int min_tokens, int seg) {
  const int lane = threadIdx.x & 31;
  int sum = 0;
  for (int s = lane; s < seg; s += 32) sum += NumChunks(segs.num_tokens[s], min_tokens);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  return sum;
}

// Scratch per (chunk, value head), bf16, laid out as a stage of the state kernel's shared memory
// so that one bulk copy moves each part: w, qg, kd [C][Dk] and P [C][C] swizzled (`Swizzled`);
// u in blocks of kUCols value columns [Dv / kUCols][C][kUCols] (a state block takes one or two).
// After all chunks: fp32 e^{G_last} [chunks][Hv].
constexpr int kUCols = 32;  // col >> 5 and col & 31 below are col / kUCols and col % kUCols
static_assert(kUCols == 32, "u block indexing uses shifts");
__host__ __device__ constexpr int64_t WqkElems(int dk) { return 3LL * kC * dk; }
constexpr int64_t kUBlockElems = int64_t{kC} * kUCols;
__host__ __device__ constexpr int64_t ChunkElems(int dk, int dv) {
  return WqkElems(dk) + (dv / kUCols) * kUBlockElems + int64_t{kC} * kC;
}

template <int kDk>
struct PrepSmem {
  static constexpr int kLdK = kDk + 8;
  static constexpr int kLdC = kC + 8;
  uint16_t k[kC][kLdK];  // normalised k
  uint16_t q[kC][kLdK];  // normalised, scaled q; then T diag(beta) as bf16 [C][kLdC]
  uint16_t v[kC][128 + 8];
  static constexpr int kLdF = kC + 4;  // 16-byte aligned rows
  float l[kC][kLdF];                   // L; then T diag(beta e^G) as bf16 [C][kLdC]
  float t[kC][kLdF];                   // T
  float gcum[kC];
  float beta[kC];
  float bw[kC];  // beta e^G
  int seg, local;
};

// 8 warps. Warp w owns token rows 16 (w % 4) .. + 15 in the [C, *] products and the column half
// w / 4 of their outputs.
template <int kDk>
__global__ void __launch_bounds__(kThreads)
    ChunkPrepKernel(const uint16_t* __restrict__ qkv, const float* __restrict__ g,
                    const float* __restrict__ beta, int num_k_heads, int num_v_heads, int dv,
                    SegmentMeta segs, int min_tokens, uint16_t* __restrict__ scratch,
                    float* __restrict__ glast) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  PrepSmem<kDk>& sm = *reinterpret_cast<PrepSmem<kDk>*>(smem_raw);
  constexpr int kLdK = PrepSmem<kDk>::kLdK, kLdC = PrepSmem<kDk>::kLdC, kLdV = 128 + 8;
  const int chunk = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kh = h / (num_v_heads / num_k_heads);
  const int64_t row_elems = 2LL * num_k_heads * kDk + static_cast<int64_t>(num_v_heads) * dv;
  const int gr = lane >> 2, tc = (lane & 3) * 2;
  const int m0 = 16 * (warp & 3), half_col = warp >> 2;

  if (warp == 0) {
    int seg, local;
    FindChunk(segs, min_tokens, chunk, &seg, &local);
    if (lane == 0) {
      sm.seg = seg;
      sm.local = local;
    }
  }
  __syncthreads();
  const int seg = sm.seg;
  if (seg < 0) return;
  const int64_t t0 = segs.token_begin[seg] + static_cast<int64_t>(sm.local) * kC;
  const int len = min(kC, segs.num_tokens[seg] - sm.local * kC);

  // Issue every q, k, v load of the chunk first (one memory latency, not one per row): thread
  // (row tid / 4, quarter tid % 4) loads a quarter of that row's q, k and v as 16-byte pieces.
  constexpr int kQkVec = kDk / 32;  // 16-byte pieces per quarter row of q or k
  const int lrow = tid >> 2, lq = tid & 3;
  const int vq = dv / 4;  // a multiple of 8
  uint4 qraw[kQkVec], kraw[kQkVec], vraw[4];
  {
    const uint16_t* row = qkv + (t0 + lrow) * row_elems;
    const bool valid = lrow < len;
#pragma unroll
    for (int e = 0; e < kQkVec; ++e) {
      const int d = lq * (kDk / 4) + e * 8;
      qraw[e] =
          valid ? *reinterpret_cast<const uint4*>(row + kh * kDk + d) : make_uint4(0, 0, 0, 0);
      kraw[e] = valid ? *reinterpret_cast<const uint4*>(row + num_k_heads * kDk + kh * kDk + d)
                      : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      vraw[e] = (valid && e * 8 < vq)
                    ? *reinterpret_cast<const uint4*>(row + 2LL * num_k_heads * kDk +
                                                      int64_t{h} * dv + lq * vq + e * 8)
                    : make_uint4(0, 0, 0, 0);
    }
  }

  // Cumulative log-decay (warp 0: pairs, then a shuffle scan) and beta; padding rows get
  // beta 0 and G = G_last.
  if (warp == 0) {
    const int a = 2 * lane, b = 2 * lane + 1;
    const float ga = a < len ? g[(t0 + a) * num_v_heads + h] : 0.f;
    const float gb = b < len ? g[(t0 + b) * num_v_heads + h] : 0.f;
    const float ba = a < len ? beta[(t0 + a) * num_v_heads + h] : 0.f;
    const float bb = b < len ? beta[(t0 + b) * num_v_heads + h] : 0.f;
    float incl = ga + gb;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    sm.gcum[a] = incl - gb;
    sm.gcum[b] = incl;
    sm.beta[a] = ba;
    sm.beta[b] = bb;
    sm.bw[a] = ba * __expf(incl - gb);
    sm.bw[b] = bb * __expf(incl);
  }
  __syncthreads();

  uint16_t* out = scratch + (static_cast<int64_t>(chunk) * num_v_heads + h) * ChunkElems(kDk, dv);
  uint16_t* w_out = out;
  uint16_t* qg_out = out + kC * kDk;
  uint16_t* kd_out = out + 2 * kC * kDk;
  uint16_t* u_out = out + WqkElems(kDk);
  uint16_t* p_out = u_out + (dv / kUCols) * kUBlockElems;
  const float g_last = sm.gcum[kC - 1];
  if (tid == 0) glast[static_cast<int64_t>(chunk) * num_v_heads + h] = __expf(g_last);

  // Normalise q and k in fp32 (a row's quarters are lanes 4i .. 4i + 3), keep bf16 copies in
  // shared memory, write qg = e^G q and kd = e^{G_last - G} k.
  {
    auto unpack = [](const uint4& v, float(&f)[8]) {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    };
    float qs = 0.f, ks = 0.f;
#pragma unroll
    for (int e = 0; e < kQkVec; ++e) {
      float fq[8], fk[8];
      unpack(qraw[e], fq);
      unpack(kraw[e], fk);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        qs += fq[i] * fq[i];
        ks += fk[i] * fk[i];
      }
    }
    qs += __shfl_xor_sync(0xffffffffu, qs, 1);
    ks += __shfl_xor_sync(0xffffffffu, ks, 1);
    qs += __shfl_xor_sync(0xffffffffu, qs, 2);
    ks += __shfl_xor_sync(0xffffffffu, ks, 2);
    const float qi = rsqrtf(qs + 1e-6f) * rsqrtf(static_cast<float>(kDk)), ki = rsqrtf(ks + 1e-6f);
    const float eg = __expf(sm.gcum[lrow]), ed = __expf(g_last - sm.gcum[lrow]);
#pragma unroll
    for (int e = 0; e < kQkVec; ++e) {
      const int d = lq * (kDk / 4) + e * 8;
      float fq[8], fk[8];
      unpack(qraw[e], fq);
      unpack(kraw[e], fk);
      uint4 qn, kn, qgv, kdv;
      uint32_t* pq = &qn.x;
      uint32_t* pk = &kn.x;
      uint32_t* pqg = &qgv.x;
      uint32_t* pkd = &kdv.x;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float q0 = fq[2 * i] * qi, q1 = fq[2 * i + 1] * qi;
        const float k0 = fk[2 * i] * ki, k1 = fk[2 * i + 1] * ki;
        pq[i] = PackBf16(q0, q1);
        pk[i] = PackBf16(k0, k1);
        pqg[i] = PackBf16(q0 * eg, q1 * eg);
        pkd[i] = PackBf16(k0 * ed, k1 * ed);
      }
      *reinterpret_cast<uint4*>(&sm.q[lrow][d]) = qn;
      *reinterpret_cast<uint4*>(&sm.k[lrow][d]) = kn;
      *reinterpret_cast<uint4*>(&qg_out[Swizzled<kDk>(lrow, d)]) = qgv;
      *reinterpret_cast<uint4*>(&kd_out[Swizzled<kDk>(lrow, d)]) = kdv;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e * 8 < vq) *reinterpret_cast<uint4*>(&sm.v[lrow][lq * vq + e * 8]) = vraw[e];
    }
  }
  __syncthreads();

  // K K^T -> L (fp32, strictly lower, beta_t e^{G_t - G_j}) and Q K^T -> P (bf16, lower incl.
  // diagonal, e^{G_t - G_j}): warp w computes rows m0 .. m0 + 15, columns 32 half_col .. + 31.
  {
    float acc_k[4][4], acc_q[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_k[n][i] = acc_q[n][i] = 0.f;
    }
    const int nb = 32 * half_col;
#pragma unroll
    for (int k0 = 0; k0 < kDk; k0 += 16) {
      uint32_t ak[4], aq[4], b[4], b2[4];
      LoadA(ak, &sm.k[0][0], kLdK, m0, k0, lane);
      LoadA(aq, &sm.q[0][0], kLdK, m0, k0, lane);
      LoadBNK(b, &sm.k[0][0], kLdK, nb, k0, lane);
      LoadBNK(b2, &sm.k[0][0], kLdK, nb + 16, k0, lane);
      MmaBf16(acc_k[0], ak, b[0], b[1]);
      MmaBf16(acc_k[1], ak, b[2], b[3]);
      MmaBf16(acc_k[2], ak, b2[0], b2[1]);
      MmaBf16(acc_k[3], ak, b2[2], b2[3]);
      MmaBf16(acc_q[0], aq, b[0], b[1]);
      MmaBf16(acc_q[1], aq, b[2], b[3]);
      MmaBf16(acc_q[2], aq, b2[0], b2[1]);
      MmaBf16(acc_q[3], aq, b2[2], b2[3]);
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = m0 + gr + half * 8;
        const float gt = sm.gcum[t], bt = sm.beta[t];
        float pv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = nb + n * 8 + tc + e;
          const float dec = __expf(fminf(gt - sm.gcum[j], 0.f));
          sm.l[t][j] = j < t ? bt * dec * acc_k[n][half * 2 + e] : 0.f;
          pv[e] = j <= t ? dec * acc_q[n][half * 2 + e] : 0.f;
        }
        *reinterpret_cast<uint32_t*>(&p_out[Swizzled<kC>(t, nb + n * 8 + tc)]) =
            PackBf16(pv[0], pv[1]);
      }
    }
  }
  __syncthreads();

  // T = (I + L)^-1, blocked by 16. The diagonal blocks by forward substitution: thread
  // tid < 64 keeps column tid % 16 of diagonal block tid / 16 in registers,
  //   T_tc = [t == c] - sum_{j < t} L_tj T_jc,
  // and reads row t of L as its block's 16 threads all do (a broadcast): no shuffles, no barriers,
  // one dependent FMA per row. Then the off-diagonal blocks level by level:
  //   T_ij = -T_ii M_ij,  M_ij = sum_{j <= k < i} L_ik T_kj  (i > j, block indices),
  // with M kept in the unused upper blocks (0, 1 + n) of sm.l. Blocks above the diagonal of T
  // are never written: the bf16 conversion below treats them as zero.
  if (tid < 64) {
    const int base = 16 * (tid >> 4), cl = tid & 15;
    float x[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) x[t] = 0.f;
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      // L is zero on and above the diagonal, and x[j >= t] is still zero: whole float4s add
      // nothing extra.
      float acc = 0.f;
#pragma unroll
      for (int j4 = 0; j4 < t; j4 += 4) {
        const float4 l4 = *reinterpret_cast<const float4*>(&sm.l[base + t][base + j4]);
        acc += l4.x * x[j4];
        acc += l4.y * x[j4 + 1];
        acc += l4.z * x[j4 + 2];
        acc += l4.w * x[j4 + 3];
      }
      x[t] = t == cl ? 1.f : (t > cl ? -acc : 0.f);
    }
#pragma unroll
    for (int t = 0; t < 16; ++t) sm.t[base + t][base + cl] = x[t];
  }
  __syncthreads();
  // Each thread computes 4 adjacent columns (n, row a, columns 4 b4 .. + 3) of a level.
  for (int level = 1; level < 4; ++level) {
    const int items = (4 - level) * 64;
    const int n = tid >> 6, a = (tid >> 2) & 15, b4 = 4 * (tid & 3);
    const int i = level + n, j = n;
    if (tid < items) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int k = j; k < i; ++k) {
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const float l = sm.l[16 * i + a][16 * k + c];
          const float4 t4 = *reinterpret_cast<const float4*>(&sm.t[16 * k + c][16 * j + b4]);
          acc.x += l * t4.x;
          acc.y += l * t4.y;
          acc.z += l * t4.z;
          acc.w += l * t4.w;
        }
      }
      *reinterpret_cast<float4*>(&sm.l[a][16 * (1 + n) + b4]) = acc;
    }
    __syncthreads();
    if (tid < items) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        const float t = sm.t[16 * i + a][16 * i + c];
        const float4 m4 = *reinterpret_cast<const float4*>(&sm.l[c][16 * (1 + n) + b4]);
        acc.x += t * m4.x;
        acc.y += t * m4.y;
        acc.z += t * m4.z;
        acc.w += t * m4.w;
      }
      *reinterpret_cast<float4*>(&sm.t[16 * i + a][16 * j + b4]) =
          make_float4(-acc.x, -acc.y, -acc.z, -acc.w);
    }
    __syncthreads();
  }

  // T diag(beta e^G) into the L area and T diag(beta) into the q area, both bf16 [C][kLdC].
  uint16_t* tw = reinterpret_cast<uint16_t*>(&sm.l[0][0]);
  uint16_t* tu = &sm.q[0][0];
  for (int e = tid; e < kC * kC / 2; e += kThreads) {
    const int t = e / (kC / 2), j = (e % (kC / 2)) * 2;
    const bool upper = (j >> 4) > (t >> 4);  // j, j + 1 share a 16-block
    const float x0 = upper ? 0.f : sm.t[t][j], x1 = upper ? 0.f : sm.t[t][j + 1];
    *reinterpret_cast<uint32_t*>(&tw[t * kLdC + j]) = PackBf16(x0 * sm.bw[j], x1 * sm.bw[j + 1]);
    *reinterpret_cast<uint32_t*>(&tu[t * kLdC + j]) =
        PackBf16(x0 * sm.beta[j], x1 * sm.beta[j + 1]);
  }
  __syncthreads();

  // w = Tw K [C, Dk] and u = Tu V [C, Dv]: warp w rows m0 .. m0 + 15, column half half_col;
  // `at(row, col)` is where an output pair goes.
  {
    auto product = [&](const uint16_t* a_mat, const uint16_t* b_mat, int ldb, int ncols, auto at) {
      const int width = ncols / 2, n0 = half_col * width;  // width <= 64, a multiple of 16
      float acc[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
      }
#pragma unroll
      for (int k0 = 0; k0 < kC; k0 += 16) {
        uint32_t a[4];
        LoadA(a, a_mat, kLdC, m0, k0, lane);
#pragma unroll
        for (int n = 0; n < 8; n += 2) {
          if (n * 8 < width) {
            uint32_t b[4];
            LoadBKN(b, b_mat, ldb, n0 + n * 8, k0, lane);
            MmaBf16(acc[n], a, b[0], b[1]);
            MmaBf16(acc[n + 1], a, b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        if (n * 8 < width) {
          const int col = n0 + n * 8 + tc;
          *reinterpret_cast<uint32_t*>(at(m0 + gr, col)) = PackBf16(acc[n][0], acc[n][1]);
          *reinterpret_cast<uint32_t*>(at(m0 + gr + 8, col)) = PackBf16(acc[n][2], acc[n][3]);
        }
      }
    };
    product(tw, &sm.k[0][0], kLdK, kDk,
            [&](int r, int col) { return w_out + Swizzled<kDk>(r, col); });
    product(tu, &sm.v[0][0], kLdV, dv,
            [&](int r, int col) { return u_out + ((col >> 5) * kC + r) * kUCols + (col & 31); });
  }
}

template <int kDk, int kBVt>
struct StateSmem {
  static constexpr int kLdV = kBVt + 8;
  // A stage holds one chunk's scratch in its layout: w, qg, kd and P whole, u's blocks
  // v0 / kUCols .. (v0 + kBVt) / kUCols - 1.
  struct Stage {
    uint16_t w[kC][kDk];
    uint16_t qg[kC][kDk];
    uint16_t kd[kC][kDk];
    uint16_t u[kBVt / kUCols][kC][kUCols];
    uint16_t p[kC][kC];
  };
  Stage stage[2];
  // Chunk c uses s[c % 2] and x[c % 2], so that the next chunk's writes need no barrier after
  // this chunk's reads: two barriers per chunk.
  uint16_t s[2][kDk][kLdV];     // state as bf16
  uint16_t x[2][kC][kLdV];      // X = u - w S as bf16
  alignas(8) uint64_t full[2];  // stage i's copies have landed
  int first_chunk;
};

// One thread copies chunk `src`'s w, qg and kd, its u columns v0 .. v0 + kBVt - 1 and P into
// `st`: three bulk copies (the scratch has the stage's layout), completing on `bar`. Every
// thread must have finished reading the stage before (a block barrier).
template <int kDk, int kBVt>
__device__ __forceinline__ void PrefetchChunk(typename StateSmem<kDk, kBVt>::Stage& st,
                                              uint32_t bar, const uint16_t* src, int dv, int v0) {
  constexpr uint32_t kWqkBytes = 2 * WqkElems(kDk);
  constexpr uint32_t kUBytes = 2 * (kBVt / kUCols) * kUBlockElems;
  constexpr uint32_t kPBytes = 2 * kC * kC;
  static_assert(sizeof(st) == kWqkBytes + kUBytes + kPBytes, "a stage is one chunk's scratch");
  BarrierArriveExpect(bar, kWqkBytes + kUBytes + kPBytes);
  // The stage was last read through the generic proxy; the copies write through the async one.
  wgmma::FenceProxyAsync();
  const uint16_t* u = src + WqkElems(kDk);
  BulkLoad(SharedAddress(&st.w[0][0]), src, kWqkBytes, bar);
  BulkLoad(SharedAddress(&st.u[0][0][0]), u + (v0 / kUCols) * kUBlockElems, kUBytes, bar);
  BulkLoad(SharedAddress(&st.p[0][0]), u + (dv / kUCols) * kUBlockElems, kPBytes, bar);
}

// 8 warps, kBVt (32 or 64) value columns per block. Token side (X, o): warp w owns rows
// 16 (w % 4) .. + 15 and value columns (kBVt / 2) (w / 4) .. + kBVt / 2 - 1. State side:
// Dk = 128: state rows 16 w .. + 15, all kBVt columns; Dk = 64: rows 16 (w % 4) .. + 15, the
// same column half as the token side.
template <int kDk, int kBVt>
__global__ void __launch_bounds__(kThreads)
    ChunkStateKernel(const uint16_t* __restrict__ scratch, const float* __restrict__ glast,
                     int num_v_heads, int dv, float* states, SegmentMeta segs, int min_tokens,
                     uint16_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using Smem = StateSmem<kDk, kBVt>;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  constexpr int kLdV = Smem::kLdV;
  constexpr int kTN = kBVt / 16;                          // token-side n-tiles per warp
  constexpr int kSN = kDk == 128 ? kBVt / 8 : kBVt / 16;  // state n-tiles per warp
  const int seg = blockIdx.x, h = blockIdx.y, v0 = blockIdx.z * kBVt;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int len = segs.num_tokens[seg];
  const int nchunks = NumChunks(len, min_tokens);
  if (nchunks == 0) return;
  if (warp == 0) {
    const int first = FirstChunk(segs, min_tokens, seg);
    if (lane == 0) {
      sm.first_chunk = first;
      BarrierInit(SharedAddress(&sm.full[0]), 1);
      BarrierInit(SharedAddress(&sm.full[1]), 1);
      wgmma::FenceProxyAsync();  // the initialised barriers, visible to the copy engine
    }
  }
  auto full = [&](int c) { return SharedAddress(&sm.full[c & 1]); };
  const int begin = segs.token_begin[seg], slot = segs.state_slot[seg];
  const int gr = lane >> 2, tc = (lane & 3) * 2;
  const int64_t chunk_elems = ChunkElems(kDk, dv);
  const int m0 = 16 * (warp & 3), c0 = (kBVt / 2) * (warp >> 2);
  const int s_row0 = kDk == 128 ? 16 * warp : 16 * (warp & 3);
  const int s_col0 = kDk == 128 ? 0 : c0;

  // State element (s_row0 + gr + 8 half, v0 + s_col0 + 8 n + tc (+1)).
  float* state =
      slot < 0 ? nullptr : states + (static_cast<int64_t>(slot) * num_v_heads + h) * kDk * dv;
  float acc_s[kSN][4];
#pragma unroll
  for (int n = 0; n < kSN; ++n) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int d = s_row0 + gr + 8 * half;
      float2 v = make_float2(0.f, 0.f);
      if (state != nullptr) {
        v = *reinterpret_cast<const float2*>(state + static_cast<int64_t>(d) * dv + v0 + s_col0 +
                                             n * 8 + tc);
      }
      acc_s[n][2 * half] = v.x;
      acc_s[n][2 * half + 1] = v.y;
    }
  }
  __syncthreads();
  const int first = sm.first_chunk;
  const uint16_t* src0 = scratch + (static_cast<int64_t>(first) * num_v_heads + h) * chunk_elems;
  const int64_t chunk_stride = static_cast<int64_t>(num_v_heads) * chunk_elems;
  if (tid == 0) PrefetchChunk<kDk, kBVt>(sm.stage[0], full(0), src0, dv, v0);

  // e^{G_last} one chunk ahead: its load latency hides behind a chunk's products.
  float decay_next = glast[static_cast<int64_t>(first) * num_v_heads + h];
  for (int c = 0; c < nchunks; ++c) {
    typename Smem::Stage& st = sm.stage[c & 1];
    uint16_t(&s_bf)[kDk][kLdV] = sm.s[c & 1];
    uint16_t(&x_bf)[kC][kLdV] = sm.x[c & 1];
    const float decay = decay_next;
    if (c + 1 < nchunks) {
      decay_next = glast[(static_cast<int64_t>(first) + c + 1) * num_v_heads + h];
    }
    // S as bf16 into shared memory (s[c % 2] was last read in chunk c - 2).
#pragma unroll
    for (int n = 0; n < kSN; ++n) {
      const int d = s_row0 + gr, col = s_col0 + n * 8 + tc;
      *reinterpret_cast<uint32_t*>(&s_bf[d][col]) = PackBf16(acc_s[n][0], acc_s[n][1]);
      *reinterpret_cast<uint32_t*>(&s_bf[d + 8][col]) = PackBf16(acc_s[n][2], acc_s[n][3]);
    }
    BarrierWait(full(c), (c >> 1) & 1);  // this chunk's stage has landed
    __syncthreads();  // s[c % 2] is written, and every thread is done with chunk c - 1
    // So the stage chunk c - 1 used takes chunk c + 1.
    if (tid == 0 && c + 1 < nchunks) {
      PrefetchChunk<kDk, kBVt>(sm.stage[(c + 1) & 1], full(c + 1), src0 + (c + 1) * chunk_stride,
                               dv, v0);
    }

    // X = u - w S and o = qg S for token rows m0 .. + 15, columns c0 .. + kBVt / 2 - 1.
    float acc_x[kTN][4], acc_o[kTN][4];
#pragma unroll
    for (int n = 0; n < kTN; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_x[n][i] = acc_o[n][i] = 0.f;
    }
#pragma unroll
    for (int k0 = 0; k0 < kDk; k0 += 16) {
      uint32_t aw[4], aq[4];
      LoadA<kDk>(aw, &st.w[0][0], kDk, m0, k0, lane);
      LoadA<kDk>(aq, &st.qg[0][0], kDk, m0, k0, lane);
#pragma unroll
      for (int n = 0; n < kTN; n += 2) {
        uint32_t b[4];
        LoadBKN(b, &s_bf[0][0], kLdV, c0 + n * 8, k0, lane);
        MmaBf16(acc_x[n], aw, b[0], b[1]);
        MmaBf16(acc_x[n + 1], aw, b[2], b[3]);
        MmaBf16(acc_o[n], aq, b[0], b[1]);
        MmaBf16(acc_o[n + 1], aq, b[2], b[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < kTN; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + gr + 8 * half, col = c0 + n * 8 + tc;
        const uint32_t uu = *reinterpret_cast<const uint32_t*>(&st.u[col >> 5][r][col & 31]);
        const float x0 = __uint_as_float(uu << 16) - acc_x[n][2 * half];
        const float x1 = __uint_as_float(uu & 0xffff0000u) - acc_x[n][2 * half + 1];
        *reinterpret_cast<uint32_t*>(&x_bf[r][col]) = PackBf16(x0, x1);
      }
    }
    __syncthreads();

    // o += P X, then store the chunk's valid rows.
#pragma unroll
    for (int k0 = 0; k0 < kC; k0 += 16) {
      uint32_t a[4];
      LoadA<kC>(a, &st.p[0][0], kC, m0, k0, lane);
#pragma unroll
      for (int n = 0; n < kTN; n += 2) {
        uint32_t b[4];
        LoadBKN(b, &x_bf[0][0], kLdV, c0 + n * 8, k0, lane);
        MmaBf16(acc_o[n], a, b[0], b[1]);
        MmaBf16(acc_o[n + 1], a, b[2], b[3]);
      }
    }
    const int valid = min(kC, len - c * kC);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = m0 + gr + 8 * half;
      if (r < valid) {
        uint16_t* dst = out + (static_cast<int64_t>(begin) + c * kC + r) * num_v_heads * dv +
                        int64_t{h} * dv + v0 + c0;
#pragma unroll
        for (int n = 0; n < kTN; ++n) {
          *reinterpret_cast<uint32_t*>(dst + n * 8 + tc) =
              PackBf16(acc_o[n][2 * half], acc_o[n][2 * half + 1]);
        }
      }
    }

    // S = e^{G_last} S + kd^T X.
#pragma unroll
    for (int n = 0; n < kSN; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_s[n][i] *= decay;
    }
#pragma unroll
    for (int k0 = 0; k0 < kC; k0 += 16) {
      uint32_t a[4];
      LoadAT<kDk>(a, &st.kd[0][0], kDk, s_row0, k0, lane);
#pragma unroll
      for (int n = 0; n < kSN; n += 2) {
        uint32_t b[4];
        LoadBKN(b, &x_bf[0][0], kLdV, s_col0 + n * 8, k0, lane);
        MmaBf16(acc_s[n], a, b[0], b[1]);
        MmaBf16(acc_s[n + 1], a, b[2], b[3]);
      }
    }
  }

  if (state != nullptr) {
#pragma unroll
    for (int n = 0; n < kSN; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = s_row0 + gr + 8 * half;
        *reinterpret_cast<float2*>(state + static_cast<int64_t>(d) * dv + v0 + s_col0 + n * 8 +
                                   tc) = make_float2(acc_s[n][2 * half], acc_s[n][2 * half + 1]);
      }
    }
  }
}

template <int kDk, int kBVt>
void LaunchStateKernel(const uint16_t* chunks, const float* glast, int hv, int dv, float* states,
                       const SegmentMeta& segs, int min_tokens, uint16_t* out,
                       cudaStream_t stream) {
  const size_t smem = sizeof(StateSmem<kDk, kBVt>);
  // The shared-memory limit is an attribute of the function in the current device's context:
  // set once per device.
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((configured.load(std::memory_order_acquire) & bit) == 0) {
    cudaFuncSetAttribute(ChunkStateKernel<kDk, kBVt>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem));
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  ChunkStateKernel<kDk, kBVt><<<dim3(segs.num_segments, hv, dv / kBVt), kThreads, smem, stream>>>(
      chunks, glast, hv, dv, states, segs, min_tokens, out);
  CheckLaunch("GatedDeltaRule chunk state");
}

template <int kDk>
void LaunchChunked(const uint16_t* qkv, const float* g, const float* beta, int hk, int hv, int dv,
                   float* states, const SegmentMeta& segs, int min_tokens, int64_t num_chunks,
                   int num_chunked_segments, void* scratch, uint16_t* out, cudaStream_t stream) {
  uint16_t* chunks = static_cast<uint16_t*>(scratch);
  float* glast = reinterpret_cast<float*>(chunks + num_chunks * hv * ChunkElems(kDk, dv));
  const size_t prep_smem = sizeof(PrepSmem<kDk>);
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((configured.load(std::memory_order_acquire) & bit) == 0) {
    cudaFuncSetAttribute(ChunkPrepKernel<kDk>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(prep_smem));
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  // State blocks of 32 value columns while they fit in one wave (a long segment or two: more
  // SMs on the serial chunk chain), of 64 beyond (each chunk's w / qg / kd then travels from L2
  // to half as many SMs). Measured on the H200: 1 x 4096 tokens 324 us (32) vs 371 us (64);
  // 8 x 1024 655 us vs 550 us.
  // Profiling knobs: MOBIUS_CHUNKED_STAGE=prep|state runs one of the two kernels;
  // MOBIUS_CHUNKED_BV=32|64 forces the value columns per state block.
  static const int stage = KnobChoice("MOBIUS_CHUNKED_STAGE", {"prep", "state"});
  const bool prep = stage != 2;
  const bool state = stage != 1;
  static const int forced_bv = KnobChoice("MOBIUS_CHUNKED_BV", {"32", "64"}) * 32;
  int num_sms = 132;
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t blocks32 = int64_t{num_chunked_segments} * hv * (dv / 32);
  const bool wide = forced_bv == 64 || (forced_bv != 32 && blocks32 > num_sms);
  const int bv = wide && dv % 64 == 0 ? 64 : 32;
  if (prep) {
    ChunkPrepKernel<kDk>
        <<<dim3(static_cast<unsigned>(num_chunks), hv), kThreads, prep_smem, stream>>>(
            qkv, g, beta, hk, hv, dv, segs, min_tokens, chunks, glast);
    CheckLaunch("GatedDeltaRule chunk prep");
  }
  if (state) {
    if (bv == 64) {
      LaunchStateKernel<kDk, 64>(chunks, glast, hv, dv, states, segs, min_tokens, out, stream);
    } else {
      LaunchStateKernel<kDk, 32>(chunks, glast, hv, dv, states, segs, min_tokens, out, stream);
    }
  }
}

}  // namespace

bool ChunkedDeltaRuleSupports(int k_head_dim, int v_head_dim) {
  return (k_head_dim == 64 || k_head_dim == 128) && v_head_dim % kBV == 0 && v_head_dim > 0 &&
         v_head_dim <= 128;
}

size_t ChunkedDeltaRuleScratchBytes(int64_t num_chunks, int num_v_heads, int k_head_dim,
                                    int v_head_dim) {
  const int64_t n = num_chunks * num_v_heads;
  return static_cast<size_t>(n * ChunkElems(k_head_dim, v_head_dim) * 2 + n * 4 + 256);
}

void LaunchGatedDeltaRuleChunked(const uint16_t* qkv, const float* g, const float* beta,
                                 int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                                 float* states, const SegmentMeta& segments, int min_tokens,
                                 int64_t num_chunks, int num_chunked_segments, void* scratch,
                                 uint16_t* out, cudaStream_t stream) {
  if (num_chunks == 0 || segments.num_segments == 0) return;
  if (!ChunkedDeltaRuleSupports(k_head_dim, v_head_dim)) {
    std::fprintf(stderr, "mobius cuda: chunked delta rule does not take Dk=%d Dv=%d\n", k_head_dim,
                 v_head_dim);
    std::abort();
  }
  if (k_head_dim == 128) {
    LaunchChunked<128>(qkv, g, beta, num_k_heads, num_v_heads, v_head_dim, states, segments,
                       min_tokens, num_chunks, num_chunked_segments, scratch, out, stream);
  } else {
    LaunchChunked<64>(qkv, g, beta, num_k_heads, num_v_heads, v_head_dim, states, segments,
                      min_tokens, num_chunks, num_chunked_segments, scratch, out, stream);
  }
}

}  // namespace mobius::kernels::cuda
