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
//     o = qg S + P X and S = e^{G_last} S + kd^T X, with the next chunk's inputs copied
//     (cp.async) into shared memory while the current one is computed.
// Matrix products use mma.sync m16n8k16 bf16 with fp32 accumulation; S and X enter them as bf16
// (as in flash-linear-attention), so results carry bf16-level relative error (~1e-3).
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/common.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kC = 64;         // tokens per chunk
constexpr int kBV = 32;        // value columns per state block
constexpr int kThreads = 128;  // 4 warps in both kernels

// ---- mma.sync / ldmatrix helpers ----

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void Ldsm4T(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragment (16 x 16) at rows m0, cols k0 of row-major X[m][k] (ld elements per row).
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const uint16_t* x, int ld, int m0, int k0,
                                      int lane) {
  Ldsm4(a, x + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}
// A fragment of A = Xt^T, Xt stored row-major [k][m].
__device__ __forceinline__ void LoadAT(uint32_t (&a)[4], const uint16_t* xt, int ld, int m0, int k0,
                                       int lane) {
  Ldsm4T(a, xt + (k0 + (lane & 7) + ((lane >> 4) << 3)) * ld + m0 + ((lane >> 3) & 1) * 8);
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

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(smem)), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
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

// Scratch layout per (chunk, value head): bf16 w [C][Dk], qg [C][Dk], kd [C][Dk], u [C][Dv],
// P [C][C]; then, after all of those, fp32 e^{G_last} [chunks][Hv].
__host__ __device__ __forceinline__ int64_t ChunkElems(int dk, int dv) {
  return static_cast<int64_t>(kC) * (3 * dk + dv + kC);
}

template <int kDk>
struct PrepSmem {
  static constexpr int kLdK = kDk + 8;
  static constexpr int kLdC = kC + 8;
  uint16_t k[kC][kLdK];  // normalised k
  uint16_t q[kC][kLdK];  // normalised, scaled q; then T diag(beta) as bf16 [C][kLdC]
  uint16_t v[kC][128 + 8];
  float l[kC][kC + 1];  // L; then T diag(beta e^G) as bf16 [C][kLdC]
  float t[kC][kC + 1];  // T
  float gcum[kC];
  float beta[kC];
  int seg, local;
};

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

  // Cumulative log-decay (warp 0: pairs, then a shuffle scan) and beta; padding rows get
  // beta 0 and G = G_last.
  if (warp == 0) {
    const int a = 2 * lane, b = 2 * lane + 1;
    const float ga = a < len ? g[(t0 + a) * num_v_heads + h] : 0.f;
    const float gb = b < len ? g[(t0 + b) * num_v_heads + h] : 0.f;
    float incl = ga + gb;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    sm.gcum[a] = incl - gb;
    sm.gcum[b] = incl;
    sm.beta[a] = a < len ? beta[(t0 + a) * num_v_heads + h] : 0.f;
    sm.beta[b] = b < len ? beta[(t0 + b) * num_v_heads + h] : 0.f;
  }
  __syncthreads();

  uint16_t* out = scratch + (static_cast<int64_t>(chunk) * num_v_heads + h) * ChunkElems(kDk, dv);
  uint16_t* w_out = out;
  uint16_t* qg_out = out + kC * kDk;
  uint16_t* kd_out = out + 2 * kC * kDk;
  uint16_t* u_out = out + 3 * kC * kDk;
  uint16_t* p_out = u_out + kC * dv;
  const float g_last = sm.gcum[kC - 1];
  if (tid == 0) glast[static_cast<int64_t>(chunk) * num_v_heads + h] = __expf(g_last);

  // q, k rows: normalise in fp32, keep bf16 copies in shared memory, write qg and kd.
  {
    constexpr int kPer = kDk / 32;
    const float q_scale = rsqrtf(static_cast<float>(kDk));
    for (int r = warp; r < kC; r += 4) {
      float qv[kPer], kv[kPer];
      float qs = 0.f, ks = 0.f;
      const uint16_t* row = qkv + (t0 + r) * row_elems;
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const int d = lane * kPer + e;
        qv[e] = r < len ? Bf16ToF32(row[kh * kDk + d]) : 0.f;
        kv[e] = r < len ? Bf16ToF32(row[num_k_heads * kDk + kh * kDk + d]) : 0.f;
        qs += qv[e] * qv[e];
        ks += kv[e] * kv[e];
      }
      qs = WarpSum(qs);
      ks = WarpSum(ks);
      const float qi = rsqrtf(qs + 1e-6f) * q_scale, ki = rsqrtf(ks + 1e-6f);
      const float eg = __expf(sm.gcum[r]), ed = __expf(g_last - sm.gcum[r]);
#pragma unroll
      for (int e = 0; e < kPer; e += 2) {
        const int d = lane * kPer + e;
        const float q0 = qv[e] * qi, q1 = qv[e + 1] * qi, k0 = kv[e] * ki, k1 = kv[e + 1] * ki;
        *reinterpret_cast<uint32_t*>(&sm.q[r][d]) = PackBf16(q0, q1);
        *reinterpret_cast<uint32_t*>(&sm.k[r][d]) = PackBf16(k0, k1);
        *reinterpret_cast<uint32_t*>(&qg_out[r * kDk + d]) = PackBf16(q0 * eg, q1 * eg);
        *reinterpret_cast<uint32_t*>(&kd_out[r * kDk + d]) = PackBf16(k0 * ed, k1 * ed);
      }
    }
    // v rows (16-byte pieces; dv % 32 == 0).
    const int vec_per_row = dv / 8;
    for (int e = tid; e < kC * vec_per_row; e += kThreads) {
      const int r = e / vec_per_row, c = (e % vec_per_row) * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < len) {
        val = *reinterpret_cast<const uint4*>(qkv + (t0 + r) * row_elems + 2LL * num_k_heads * kDk +
                                              int64_t{h} * dv + c);
      }
      *reinterpret_cast<uint4*>(&sm.v[r][c]) = val;
    }
  }
  __syncthreads();

  // K K^T -> L (fp32, strictly lower, beta_t e^{G_t - G_j}) and Q K^T -> P (bf16, lower incl.
  // diagonal, e^{G_t - G_j}). Warp w computes rows 16w .. 16w + 15, all 64 columns.
  {
    float acc_k[8][4], acc_q[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_k[n][i] = acc_q[n][i] = 0.f;
    }
    const int m0 = warp * 16;
#pragma unroll
    for (int k0 = 0; k0 < kDk; k0 += 16) {
      uint32_t ak[4], aq[4];
      LoadA(ak, &sm.k[0][0], kLdK, m0, k0, lane);
      LoadA(aq, &sm.q[0][0], kLdK, m0, k0, lane);
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        uint32_t b[4];
        LoadBNK(b, &sm.k[0][0], kLdK, n * 8, k0, lane);
        Mma(acc_k[n], ak, b[0], b[1]);
        Mma(acc_k[n + 1], ak, b[2], b[3]);
        Mma(acc_q[n], aq, b[0], b[1]);
        Mma(acc_q[n + 1], aq, b[2], b[3]);
      }
    }
    const int gr = lane >> 2, tc = (lane & 3) * 2;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int t = m0 + gr + half * 8;
        const float gt = sm.gcum[t], bt = sm.beta[t];
        float pv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = n * 8 + tc + e;
          const float dec = __expf(fminf(gt - sm.gcum[j], 0.f));
          sm.l[t][j] = j < t ? bt * dec * acc_k[n][half * 2 + e] : 0.f;
          pv[e] = j <= t ? dec * acc_q[n][half * 2 + e] : 0.f;
        }
        *reinterpret_cast<uint32_t*>(&p_out[t * kC + n * 8 + tc]) = PackBf16(pv[0], pv[1]);
      }
    }
  }
  __syncthreads();

  // T = (I + L)^-1 by forward substitution, one column per pair of lanes:
  //   T[t][c] = [t == c] - sum_{c <= j < t} L[t][j] T[j][c].
  {
    const int c = tid >> 1, par = tid & 1;
    for (int t = 0; t < kC; ++t) {
      float s = 0.f;
      if (t > c) {
        for (int j = c + par; j < t; j += 2) s += sm.l[t][j] * sm.t[j][c];
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      if (par == 0) sm.t[t][c] = t == c ? 1.f : (t > c ? -s : 0.f);
      __syncwarp();
    }
  }
  __syncthreads();

  // T diag(beta e^G) into the L area and T diag(beta) into the q area, both bf16 [C][kLdC].
  uint16_t* tw = reinterpret_cast<uint16_t*>(&sm.l[0][0]);
  uint16_t* tu = &sm.q[0][0];
  for (int e = tid; e < kC * kC / 2; e += kThreads) {
    const int t = e / (kC / 2), j = (e % (kC / 2)) * 2;
    const float b0 = sm.beta[j], b1 = sm.beta[j + 1];
    const float x0 = sm.t[t][j], x1 = sm.t[t][j + 1];
    *reinterpret_cast<uint32_t*>(&tw[t * kLdC + j]) =
        PackBf16(x0 * b0 * __expf(sm.gcum[j]), x1 * b1 * __expf(sm.gcum[j + 1]));
    *reinterpret_cast<uint32_t*>(&tu[t * kLdC + j]) = PackBf16(x0 * b0, x1 * b1);
  }
  __syncthreads();

  // w = Tw K [C, Dk] and u = Tu V [C, Dv], warp w rows 16w .. 16w + 15, 64 columns at a time.
  {
    const int m0 = warp * 16, gr = lane >> 2, tc = (lane & 3) * 2;
    auto product = [&](const uint16_t* a_mat, const uint16_t* b_mat, int ldb, int ncols,
                       uint16_t* dst) {
      for (int n0 = 0; n0 < ncols; n0 += 64) {
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
            if (n0 + n * 8 < ncols) {
              uint32_t b[4];
              LoadBKN(b, b_mat, ldb, n0 + n * 8, k0, lane);
              Mma(acc[n], a, b[0], b[1]);
              Mma(acc[n + 1], a, b[2], b[3]);
            }
          }
        }
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int col = n0 + n * 8 + tc;
          if (col < ncols) {
            *reinterpret_cast<uint32_t*>(&dst[(m0 + gr) * ncols + col]) =
                PackBf16(acc[n][0], acc[n][1]);
            *reinterpret_cast<uint32_t*>(&dst[(m0 + gr + 8) * ncols + col]) =
                PackBf16(acc[n][2], acc[n][3]);
          }
        }
      }
    };
    product(tw, &sm.k[0][0], kLdK, kDk, w_out);
    product(tu, &sm.v[0][0], kLdV, dv, u_out);
  }
}

template <int kDk>
struct StateSmem {
  static constexpr int kLdK = kDk + 8;
  static constexpr int kLdV = kBV + 8;
  static constexpr int kLdC = kC + 8;
  struct Stage {
    uint16_t w[kC][kLdK];
    uint16_t qg[kC][kLdK];
    uint16_t kd[kC][kLdK];
    uint16_t u[kC][kLdV];
    uint16_t p[kC][kLdC];
  };
  Stage stage[2];
  uint16_t s[kDk][kLdV];  // state as bf16
  uint16_t x[kC][kLdV];   // X = u - w S as bf16
  int first_chunk;
};

template <int kDk>
__device__ __forceinline__ void PrefetchChunk(typename StateSmem<kDk>::Stage& st,
                                              const uint16_t* src, int dv, int v0, int tid) {
  constexpr int kRowVec = kDk / 8;  // 16-byte pieces per row of w / qg / kd
  for (int e = tid; e < 3 * kC * kRowVec; e += kThreads) {
    const int m = e / (kC * kRowVec), r = (e / kRowVec) % kC, c = (e % kRowVec) * 8;
    uint16_t* dst = m == 0 ? &st.w[r][c] : m == 1 ? &st.qg[r][c] : &st.kd[r][c];
    CpAsync16(dst, src + (m * kC + r) * kDk + c);
  }
  const uint16_t* u = src + 3 * kC * kDk;
  for (int e = tid; e < kC * (kBV / 8); e += kThreads) {
    const int r = e / (kBV / 8), c = (e % (kBV / 8)) * 8;
    CpAsync16(&st.u[r][c], u + r * dv + v0 + c);
  }
  const uint16_t* p = u + kC * dv;
  for (int e = tid; e < kC * (kC / 8); e += kThreads) {
    const int r = e / (kC / 8), c = (e % (kC / 8)) * 8;
    CpAsync16(&st.p[r][c], p + r * kC + c);
  }
}

template <int kDk>
__global__ void __launch_bounds__(kThreads)
    ChunkStateKernel(const uint16_t* __restrict__ scratch, const float* __restrict__ glast,
                     int num_v_heads, int dv, float* states, SegmentMeta segs, int min_tokens,
                     uint16_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using Smem = StateSmem<kDk>;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  constexpr int kLdK = Smem::kLdK, kLdV = Smem::kLdV, kLdC = Smem::kLdC;
  constexpr int kMT = kDk / 64;  // 16-row state tiles per warp
  const int seg = blockIdx.x, h = blockIdx.y, v0 = blockIdx.z * kBV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int len = segs.num_tokens[seg];
  const int nchunks = NumChunks(len, min_tokens);
  if (nchunks == 0) return;
  if (warp == 0) {
    const int first = FirstChunk(segs, min_tokens, seg);
    if (lane == 0) sm.first_chunk = first;
  }
  const int begin = segs.token_begin[seg], slot = segs.state_slot[seg];
  const int gr = lane >> 2, tc = (lane & 3) * 2;
  const int64_t chunk_elems = ChunkElems(kDk, dv);

  // State rows d = 16 (kMT warp + mt) + gr (+8), columns v0 + 8 n + tc (+1).
  float* state =
      slot < 0 ? nullptr : states + (static_cast<int64_t>(slot) * num_v_heads + h) * kDk * dv;
  float acc_s[kMT][4][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = 16 * (kMT * warp + mt) + gr + 8 * half;
        float2 v = make_float2(0.f, 0.f);
        if (state != nullptr) {
          v = *reinterpret_cast<const float2*>(state + static_cast<int64_t>(d) * dv + v0 + n * 8 +
                                               tc);
        }
        acc_s[mt][n][2 * half] = v.x;
        acc_s[mt][n][2 * half + 1] = v.y;
      }
    }
  }
  __syncthreads();
  const int first = sm.first_chunk;
  const uint16_t* src0 = scratch + (static_cast<int64_t>(first) * num_v_heads + h) * chunk_elems;
  const int64_t chunk_stride = static_cast<int64_t>(num_v_heads) * chunk_elems;
  PrefetchChunk<kDk>(sm.stage[0], src0, dv, v0, tid);
  CpAsyncCommit();

  for (int c = 0; c < nchunks; ++c) {
    typename Smem::Stage& st = sm.stage[c & 1];
    if (c + 1 < nchunks) {
      PrefetchChunk<kDk>(sm.stage[(c + 1) & 1], src0 + (c + 1) * chunk_stride, dv, v0, tid);
    }
    CpAsyncCommit();
    // S as bf16 into shared memory.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int d = 16 * (kMT * warp + mt) + gr;
        *reinterpret_cast<uint32_t*>(&sm.s[d][n * 8 + tc]) =
            PackBf16(acc_s[mt][n][0], acc_s[mt][n][1]);
        *reinterpret_cast<uint32_t*>(&sm.s[d + 8][n * 8 + tc]) =
            PackBf16(acc_s[mt][n][2], acc_s[mt][n][3]);
      }
    }
    CpAsyncWait<1>();  // this chunk's stage has landed (the next one may still be in flight)
    __syncthreads();

    // X = u - w S and o = qg S for token rows 16 warp .. + 15.
    const int m0 = 16 * warp;
    float acc_x[4][4], acc_o[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_x[n][i] = acc_o[n][i] = 0.f;
    }
#pragma unroll
    for (int k0 = 0; k0 < kDk; k0 += 16) {
      uint32_t aw[4], aq[4], b[4], b2[4];
      LoadA(aw, &st.w[0][0], kLdK, m0, k0, lane);
      LoadA(aq, &st.qg[0][0], kLdK, m0, k0, lane);
      LoadBKN(b, &sm.s[0][0], kLdV, 0, k0, lane);
      LoadBKN(b2, &sm.s[0][0], kLdV, 16, k0, lane);
      Mma(acc_x[0], aw, b[0], b[1]);
      Mma(acc_x[1], aw, b[2], b[3]);
      Mma(acc_x[2], aw, b2[0], b2[1]);
      Mma(acc_x[3], aw, b2[2], b2[3]);
      Mma(acc_o[0], aq, b[0], b[1]);
      Mma(acc_o[1], aq, b[2], b[3]);
      Mma(acc_o[2], aq, b2[0], b2[1]);
      Mma(acc_o[3], aq, b2[2], b2[3]);
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + gr + 8 * half, col = n * 8 + tc;
        const uint32_t uu = *reinterpret_cast<const uint32_t*>(&st.u[r][col]);
        const float x0 = __uint_as_float(uu << 16) - acc_x[n][2 * half];
        const float x1 = __uint_as_float(uu & 0xffff0000u) - acc_x[n][2 * half + 1];
        *reinterpret_cast<uint32_t*>(&sm.x[r][col]) = PackBf16(x0, x1);
      }
    }
    __syncthreads();

    // o += P X, then store the chunk's valid rows.
#pragma unroll
    for (int k0 = 0; k0 < kC; k0 += 16) {
      uint32_t a[4], b[4], b2[4];
      LoadA(a, &st.p[0][0], kLdC, m0, k0, lane);
      LoadBKN(b, &sm.x[0][0], kLdV, 0, k0, lane);
      LoadBKN(b2, &sm.x[0][0], kLdV, 16, k0, lane);
      Mma(acc_o[0], a, b[0], b[1]);
      Mma(acc_o[1], a, b[2], b[3]);
      Mma(acc_o[2], a, b2[0], b2[1]);
      Mma(acc_o[3], a, b2[2], b2[3]);
    }
    const int valid = min(kC, len - c * kC);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = m0 + gr + 8 * half;
      if (r < valid) {
        uint16_t* dst = out + (static_cast<int64_t>(begin) + c * kC + r) * num_v_heads * dv +
                        int64_t{h} * dv + v0;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          *reinterpret_cast<uint32_t*>(dst + n * 8 + tc) =
              PackBf16(acc_o[n][2 * half], acc_o[n][2 * half + 1]);
        }
      }
    }

    // S = e^{G_last} S + kd^T X.
    const float decay = glast[(static_cast<int64_t>(first) + c) * num_v_heads + h];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_s[mt][n][i] *= decay;
      }
    }
#pragma unroll
    for (int k0 = 0; k0 < kC; k0 += 16) {
      uint32_t b[4], b2[4];
      LoadBKN(b, &sm.x[0][0], kLdV, 0, k0, lane);
      LoadBKN(b2, &sm.x[0][0], kLdV, 16, k0, lane);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t a[4];
        LoadAT(a, &st.kd[0][0], kLdK, 16 * (kMT * warp + mt), k0, lane);
        Mma(acc_s[mt][0], a, b[0], b[1]);
        Mma(acc_s[mt][1], a, b[2], b[3]);
        Mma(acc_s[mt][2], a, b2[0], b2[1]);
        Mma(acc_s[mt][3], a, b2[2], b2[3]);
      }
    }
    __syncthreads();  // sm.s, sm.x and this stage are rewritten next
  }
  CpAsyncWait<0>();

  if (state != nullptr) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int d = 16 * (kMT * warp + mt) + gr + 8 * half;
          *reinterpret_cast<float2*>(state + static_cast<int64_t>(d) * dv + v0 + n * 8 + tc) =
              make_float2(acc_s[mt][n][2 * half], acc_s[mt][n][2 * half + 1]);
        }
      }
    }
  }
}

template <int kDk>
void LaunchChunked(const uint16_t* qkv, const float* g, const float* beta, int hk, int hv, int dv,
                   float* states, const SegmentMeta& segs, int min_tokens, int64_t num_chunks,
                   void* scratch, uint16_t* out, cudaStream_t stream) {
  uint16_t* chunks = static_cast<uint16_t*>(scratch);
  float* glast = reinterpret_cast<float*>(chunks + num_chunks * hv * ChunkElems(kDk, dv));
  const size_t prep_smem = sizeof(PrepSmem<kDk>);
  const size_t state_smem = sizeof(StateSmem<kDk>);
  // Set on every call: the attribute belongs to the current device's context.
  cudaFuncSetAttribute(ChunkPrepKernel<kDk>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(prep_smem));
  cudaFuncSetAttribute(ChunkStateKernel<kDk>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       static_cast<int>(state_smem));
  ChunkPrepKernel<kDk>
      <<<dim3(static_cast<unsigned>(num_chunks), hv), kThreads, prep_smem, stream>>>(
          qkv, g, beta, hk, hv, dv, segs, min_tokens, chunks, glast);
  CheckLaunch("GatedDeltaRule chunk prep");
  ChunkStateKernel<kDk><<<dim3(segs.num_segments, hv, dv / kBV), kThreads, state_smem, stream>>>(
      chunks, glast, hv, dv, states, segs, min_tokens, out);
  CheckLaunch("GatedDeltaRule chunk state");
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
                                 int64_t num_chunks, void* scratch, uint16_t* out,
                                 cudaStream_t stream) {
  if (num_chunks == 0 || segments.num_segments == 0) return;
  if (!ChunkedDeltaRuleSupports(k_head_dim, v_head_dim)) {
    std::fprintf(stderr, "mobius cuda: chunked delta rule does not take Dk=%d Dv=%d\n", k_head_dim,
                 v_head_dim);
    std::abort();
  }
  if (k_head_dim == 128) {
    LaunchChunked<128>(qkv, g, beta, num_k_heads, num_v_heads, v_head_dim, states, segments,
                       min_tokens, num_chunks, scratch, out, stream);
  } else {
    LaunchChunked<64>(qkv, g, beta, num_k_heads, num_v_heads, v_head_dim, states, segments,
                      min_tokens, num_chunks, scratch, out, stream);
  }
}

}  // namespace mobius::kernels::cuda
