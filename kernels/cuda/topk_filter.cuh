// The router top-k's register forms (k <= kListedTopK): the lists every lane keeps, their merge,
// and the filter that ranks only the logits at or above a threshold. Shared by the top-k kernels
// (topk_softmax.cu) and the MoE kernel whose extra blocks compute the shared expert's rows beside
// the top-k (moe_few_tokens.cu, TopKSoftmaxFilterSharedRowsKernel).
#ifndef MOBIUS_KERNELS_CUDA_TOPK_FILTER_CUH_
#define MOBIUS_KERNELS_CUDA_TOPK_FILTER_CUH_

#include <climits>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ranked_lists.cuh"

namespace mobius::kernels::cuda {

// MOBIUS_TOPK=block / warp (read once) forces the block-per-token or the warp-per-token kernel
// where both apply, for timing and tests (TopKOverride).
TopKOverride TopKOverrideFromEnv();

// For k <= kRegTopK (the released configs route each token to 8 experts) the logits are read
// into registers, kRegTopKLoads per lane of a 512-thread block, all loads issued before anything
// is compared. Up to 4096 experts TopKSoftmaxFilterKernel ranks the few above a threshold; above
// that TopKSoftmaxRegKernel streams chunks, each lane keeping a sorted list of its kRegTopK best
// (with a softmax max and sum per chunk), a warp merging its lanes' lists head by head, and
// warp 0 the warps' lists. No shared-memory scans per round. The first register kernel (128
// threads, one load per iteration, each waiting for the previous insert) took 16.6 us per call
// at one token (ncu, release shapes): 0.67 ms of a 4.2 ms decode step.
constexpr int kRegTopK = 8;
constexpr int kRegTopKThreads = 512;
constexpr int kRegTopKLoads = 8;
// k of 9-16 (Qwen3-Next routes each token to 10 experts) take the filter and warp-per-token forms
// with lists of kListedTopK (the streaming kRegTopK-list kernel for more than 4096 experts stays
// k <= 8). Each form is instantiated for kRegTopK and kListedTopK; ListSizeFor picks one.
constexpr int kListedTopK = 16;
constexpr int ListSizeFor(int k) { return k <= kRegTopK ? kRegTopK : kListedTopK; }

// The k merged logits (wv, ids wi: the same in every lane) as softmax probabilities over all
// experts (maximum mx, sum of exp(v - mx) total), renormalised over the k or not; lane j < k
// writes token t's j-th id and weight.
template <int kList>
__device__ __forceinline__ void WriteMergedTopK(float (&wv)[kList], const int (&wi)[kList], int k,
                                                float mx, float total, bool renormalize, int lane,
                                                int64_t t, int32_t* ids, float* weights) {
  float selected = 0.0f;
#pragma unroll
  for (int j = 0; j < kList; ++j) {
    if (j < k) {
      wv[j] = expf(wv[j] - mx) / total;
      selected += wv[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kList; ++j) {
    if (j < k && lane == j) {
      ids[t * k + j] = wi[j];
      weights[t * k + j] = renormalize ? wv[j] / selected : wv[j];
    }
  }
}

// The end of the register top-k kernels: every thread holds a sorted list (lv, li) of its best
// kList logits and its softmax statistics (m, sum: the sum of exp(v - m) over its logits); each
// warp merges its lanes' lists, warp 0 merges the warps' lists and writes token t's ids and
// weights.
template <int kList>
__device__ __forceinline__ void FinishTopKFromLists(float (&lv)[kList], int (&li)[kList], float m,
                                                    float sum, int k, bool renormalize, int64_t t,
                                                    int32_t* ids, float* weights) {
  constexpr int kWarps = kRegTopKThreads / 32;
  static_assert(kWarps <= 32, "warp 0 merges one list per lane");
  __shared__ float m_s[kWarps], s_s[kWarps];
  __shared__ float cand_v[kWarps][kList];
  __shared__ int cand_i[kWarps][kList];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Softmax statistics over the block: combine (max, sum) pairs.
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, m, o);
    const float os = __shfl_xor_sync(0xffffffffu, sum, o);
    const float nm = fmaxf(m, om);
    sum = (m == -INFINITY ? 0.0f : sum * expf(m - nm)) +
          (om == -INFINITY ? 0.0f : os * expf(om - nm));
    m = nm;
  }
  float wv[kList];
  int wi[kList];
  WarpMergeLists(lv, li, k, wv, wi);
  if (lane == 0) {
    m_s[warp] = m;
    s_s[warp] = sum;
#pragma unroll
    for (int j = 0; j < kList; ++j) {
      cand_v[warp][j] = j < k ? wv[j] : -INFINITY;
      cand_i[warp][j] = j < k ? wi[j] : INT_MAX;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w]);
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += m_s[w] == -INFINITY ? 0.0f : s_s[w] * expf(m_s[w] - mx);
    // Lane w < kWarps holds warp w's (sorted) list; the other lanes hold empty lists.
#pragma unroll
  for (int q = 0; q < kList; ++q) {
    lv[q] = lane < kWarps ? cand_v[lane][q] : -INFINITY;
    li[q] = lane < kWarps ? cand_i[lane][q] : INT_MAX;
  }
  WarpMergeLists(lv, li, k, wv, wi);
  WriteMergedTopK(wv, wi, k, mx, total, renormalize, lane, t, ids, weights);
}
// Up to kRegTopKThreads * kRegTopKLoads experts (2560 at release scale): the logits stay in
// registers, and only those at or above a threshold are ranked. The threshold is the k-th
// largest of the warps' maxima: k warps hold a logit at least that large, so the k best are all
// at or above it, and with near-uniform logits only a few more are (an estimate). Warp 0
// ranks the candidates by counting the better ones (no merge rounds). Many ties at the threshold
// (more than kTopKCandidates candidates: equal or -inf logits) fall back to the register lists.
// At one token and 2560 experts the list merge took 8.5 us (ncu).
constexpr int kTopKCandidates = 512;

// Token t's top-k by the filter (the body of TopKSoftmaxFilterKernel, after its PDL wait), for
// k <= kList.
template <int kList>
__device__ __forceinline__ void TopKFilterToken(AnyPtr logits, int num_experts, int k,
                                                bool renormalize, int32_t* ids, float* weights,
                                                int64_t t) {
  constexpr int kWarps = kRegTopKThreads / 32;
  static_assert(kList <= kWarps, "the threshold is the k-th of the warps' maxima");
  __shared__ float wmax_s[kWarps], wsum_s[kWarps];
  __shared__ float cand_v[kTopKCandidates];
  __shared__ int cand_i[kTopKCandidates];
  __shared__ float sel_p[kList];
  __shared__ int sel_i[kList];
  __shared__ int count_s;
  const int64_t base = t * num_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) count_s = 0;
  float v[kRegTopKLoads];
  float tm = -INFINITY;
#pragma unroll
  for (int u = 0; u < kRegTopKLoads; ++u) {
    const int e = threadIdx.x + u * kRegTopKThreads;
    v[u] = e < num_experts ? Load(logits, base + e) : -INFINITY;
    tm = fmaxf(tm, v[u]);
  }
  tm = WarpMax(tm);
  if (lane == 0) wmax_s[warp] = tm;
  __syncthreads();
  // Every warp: the block maximum, and the threshold from lane w's rank of warp w's maximum.
  const float mine = lane < kWarps ? wmax_s[lane] : -INFINITY;
  float mx = -INFINITY;
  int rank = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float o = wmax_s[w];
    mx = fmaxf(mx, o);
    rank += Better(o, w, mine, lane) ? 1 : 0;
  }
  const unsigned at = __ballot_sync(0xffffffffu, lane < kWarps && rank == k - 1);
  const float threshold = __shfl_sync(0xffffffffu, mine, __ffs(at) - 1);
  float own_sum = 0.0f;
#pragma unroll
  for (int u = 0; u < kRegTopKLoads; ++u) {
    const int e = threadIdx.x + u * kRegTopKThreads;
    if (v[u] != -INFINITY) own_sum += expf(v[u] - mx);
    if (e < num_experts && v[u] >= threshold) {
      const int pos = atomicAdd(&count_s, 1);
      if (pos < kTopKCandidates) {
        cand_v[pos] = v[u];
        cand_i[pos] = e;
      }
    }
  }
  const float warp_sum = WarpSum(own_sum);
  if (lane == 0) wsum_s[warp] = warp_sum;
  __syncthreads();
  const int count = count_s;
  if (count > kTopKCandidates) {
    float lv[kList];
    int li[kList];
    ClearList(lv, li);
#pragma unroll
    for (int u = 0; u < kRegTopKLoads; ++u) {
      const int e = threadIdx.x + u * kRegTopKThreads;
      if (e < num_experts) InsertSorted(v[u], e, lv, li);
    }
    FinishTopKFromLists(lv, li, mx, own_sum, k, renormalize, t, ids, weights);
    return;
  }
  if (warp != 0) return;
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += wsum_s[w];
  for (int c = lane; c < count; c += 32) {
    const float cv = cand_v[c];
    const int ci = cand_i[c];
    int better = 0;
    for (int o = 0; o < count; ++o) better += Better(cand_v[o], cand_i[o], cv, ci) ? 1 : 0;
    if (better < k) {
      sel_p[better] = expf(cv - mx) / total;
      sel_i[better] = ci;
    }
  }
  __syncwarp();
  if (lane < k) {
    float selected = 0.0f;
    for (int j = 0; j < k; ++j) selected += sel_p[j];
    ids[t * k + lane] = sel_i[lane];
    weights[t * k + lane] = renormalize ? sel_p[lane] / selected : sel_p[lane];
  }
}

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_TOPK_FILTER_CUH_
