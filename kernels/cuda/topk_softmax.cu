// The router's top-k softmax (Backend::TopKSoftmax, LaunchTopKSoftmax): one block per token for
// decode batches (the filter form at the release shapes, register lists or shared memory where
// its limits are not met, a generic loop over any expert count) and one warp per token from
// kWarpTopKMinTokens tokens (prefill).
#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ranked_lists.cuh"
#include "kernels/cuda/topk_filter.cuh"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {
namespace {

constexpr int kTopKThreads = 256;

// ---------------------------------------------------------------------------------------------
// TopKSoftmax: one block per token, looping over any number of experts.

__global__ void TopKSoftmaxKernel(AnyPtr logits, int num_experts, int k, bool renormalize,
                                  int32_t* ids, float* weights) {
  extern __shared__ int chosen[];  // [k]
  __shared__ float red[32];
  __shared__ float best_v_s[32];
  __shared__ int best_i_s[32];
  const int64_t t = blockIdx.x;
  const int64_t base = t * num_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  float mx = -INFINITY;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    mx = fmaxf(mx, Load(logits, base + e));
  mx = BlockMax(mx, red);
  float sum = 0.0f;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    sum += expf(Load(logits, base + e) - mx);
  }
  sum = BlockSum(sum, red);

  float selected_sum = 0.0f;  // meaningful in thread 0
  for (int j = 0; j < k; ++j) {
    float best_v = -INFINITY;
    int best_i = INT_MAX;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      bool taken = false;
      for (int c = 0; c < j; ++c) taken |= chosen[c] == e;
      const float v = Load(logits, base + e);
      if (!taken && Better(v, e, best_v, best_i)) {
        best_v = v;
        best_i = e;
      }
    }
    WarpArgBest(best_v, best_i);
    if (lane == 0) {
      best_v_s[warp] = best_v;
      best_i_s[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
        if (Better(best_v_s[w], best_i_s[w], best_v, best_i)) {
          best_v = best_v_s[w];
          best_i = best_i_s[w];
        }
      }
      chosen[j] = best_i;
      const float p = expf(best_v - mx) / sum;
      ids[t * k + j] = best_i;
      weights[t * k + j] = p;
      selected_sum += p;
    }
    __syncthreads();
  }
  if (renormalize && threadIdx.x == 0) {
    const float inv = 1.0f / selected_sum;
    for (int j = 0; j < k; ++j) weights[t * k + j] *= inv;
  }
}

// The same result from shared memory, for up to kSmemTopKExperts experts and k <= 32: the
// token's logits are read once; each warp picks the k best of its contiguous share (k rounds of
// a warp argmax, no block barrier), then warp 0 picks the k best of the warps' candidates. The
// kernel above re-reads every logit k times from global memory, which made it the slowest op of
// a batch-1 decode step (23 us per layer for 2560 experts).
constexpr int kSmemTopKExperts = 8192;
constexpr int kSmemTopKMaxK = 32;

__global__ void TopKSoftmaxSmemKernel(AnyPtr logits, int num_experts, int k, bool renormalize,
                                      int32_t* ids, float* weights) {
  extern __shared__ float topk_smem[];
  float* vals = topk_smem;                                               // [E]
  float* cand_v = vals + num_experts;                                    // [warps * k]
  int* cand_i = reinterpret_cast<int*>(cand_v + (blockDim.x >> 5) * k);  // [warps * k]
  unsigned char* taken = reinterpret_cast<unsigned char*>(cand_i + (blockDim.x >> 5) * k);  // [E]
  __shared__ float red[32];
  const int64_t t = blockIdx.x;
  const int64_t base = t * num_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;

  float mx = -INFINITY;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const float v = Load(logits, base + e);
    vals[e] = v;
    taken[e] = 0;
    mx = fmaxf(mx, v);
  }
  mx = BlockMax(mx, red);  // its barriers also publish vals and taken
  float sum = 0.0f;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) sum += expf(vals[e] - mx);
  sum = BlockSum(sum, red);

  const int chunk = (num_experts + num_warps - 1) / num_warps;
  const int begin = warp * chunk, end = min(num_experts, begin + chunk);
  for (int j = 0; j < k; ++j) {
    float best_v = -INFINITY;
    int best_i = INT_MAX;
    for (int e = begin + lane; e < end; e += 32) {
      if (!taken[e] && Better(vals[e], e, best_v, best_i)) {
        best_v = vals[e];
        best_i = e;
      }
    }
    WarpArgBest(best_v, best_i);
    if (lane == 0) {
      cand_v[warp * k + j] = best_v;
      cand_i[warp * k + j] = best_i;
      if (best_i != INT_MAX) taken[best_i] = 1;
    }
    __syncwarp();
  }
  __syncthreads();
  if (warp != 0) return;
  const int num_cand = num_warps * k;
  uint32_t used = 0;  // bit c: candidate lane + 32 c already chosen
  float selected_sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    float best_v = -INFINITY;
    int best_i = INT_MAX;
    for (int c = lane, bit = 0; c < num_cand; c += 32, ++bit) {
      if (!(used >> bit & 1u) && cand_i[c] != INT_MAX &&
          Better(cand_v[c], cand_i[c], best_v, best_i)) {
        best_v = cand_v[c];
        best_i = cand_i[c];
      }
    }
    WarpArgBest(best_v, best_i);
    for (int c = lane, bit = 0; c < num_cand; c += 32, ++bit) {
      if (cand_i[c] == best_i) used |= 1u << bit;
    }
    const float p = expf(best_v - mx) / sum;
    if (lane == 0) {
      ids[t * k + j] = best_i;
      weights[t * k + j] = p;
    }
    selected_sum += p;
  }
  if (renormalize && lane < k) {
    __syncwarp();
    weights[t * k + lane] /= selected_sum;
  }
}

__global__ void __launch_bounds__(kRegTopKThreads)
    TopKSoftmaxRegKernel(AnyPtr logits, int num_experts, int k, bool renormalize, int32_t* ids,
                         float* weights) {
  PdlWait();
  PdlTrigger();
  const int64_t t = blockIdx.x;
  const int64_t base = t * num_experts;
  float lv[kRegTopK];
  int li[kRegTopK];
  ClearList(lv, li);
  float m = -INFINITY, sum = 0.0f;
  for (int e0 = threadIdx.x; e0 < num_experts; e0 += kRegTopKThreads * kRegTopKLoads) {
    float v[kRegTopKLoads];
#pragma unroll
    for (int u = 0; u < kRegTopKLoads; ++u) {
      const int e = e0 + u * kRegTopKThreads;
      v[u] = e < num_experts ? Load(logits, base + e) : -INFINITY;
    }
    float cm = m;
#pragma unroll
    for (int u = 0; u < kRegTopKLoads; ++u) cm = fmaxf(cm, v[u]);
    if (cm != -INFINITY) {
      sum = m == -INFINITY ? 0.0f : sum * expf(m - cm);
#pragma unroll
      for (int u = 0; u < kRegTopKLoads; ++u) {
        if (v[u] != -INFINITY) sum += expf(v[u] - cm);
      }
      m = cm;
    }
#pragma unroll
    for (int u = 0; u < kRegTopKLoads; ++u) {
      const int e = e0 + u * kRegTopKThreads;
      if (e < num_experts) InsertSorted(v[u], e, lv, li);
    }
  }
  FinishTopKFromLists(lv, li, m, sum, k, renormalize, t, ids, weights);
}

template <int kList>
__global__ void __launch_bounds__(kRegTopKThreads)
    TopKSoftmaxFilterKernel(AnyPtr logits, int num_experts, int k, bool renormalize, int32_t* ids,
                            float* weights) {
  PdlWait();
  PdlTrigger();
  TopKFilterToken<kList>(logits, num_experts, k, renormalize, ids, weights, blockIdx.x);
}

// Many tokens (prefill, large decode batches): one warp per token, so that a 256-thread block
// keeps eight tokens' logits in flight where the block-per-token kernels keep one, and no
// barrier. (At 8192 tokens and 2560 experts the filter kernel moved 0.92 TB/s: ncu of an 8K
// prefill, 3.66 ms over 40 layers.) Each lane holds up to kWarpTopKGroups groups of 8 logits in
// registers, all loads issued at once. The threshold is the k-th largest of the lanes' maxima: k
// lanes hold a logit at least that large, so the k best are all at or above it, and with
// near-uniform logits few others are. The candidates go to shared memory, each ranked by
// counting the better ones; more than kWarpTopKCandidates (ties, -inf rows) fall back to sorted
// register lists merged across the warp. (A first form that kept a sorted list per lane for
// every logit measured 53 us at 4096 tokens against the filter kernel's 49 us, and 21 against 6
// at 64: the insertions, not the loads, set its time.)
constexpr int kWarpTopKWarps = 8;
constexpr int kWarpTopKGroups = 10;  // experts <= 32 * 8 * kWarpTopKGroups (2560)
constexpr int kWarpTopKCandidates = 64;

template <int kList>
__global__ void __launch_bounds__(kWarpTopKWarps * 32, 2)
    TopKSoftmaxWarpKernel(AnyPtr logits, int64_t num_tokens, int num_experts, int k,
                          bool renormalize, int32_t* ids, float* weights) {
  __shared__ float cand_v[kWarpTopKWarps][kWarpTopKCandidates];
  __shared__ int cand_i[kWarpTopKWarps][kWarpTopKCandidates];
  __shared__ float sel_p[kWarpTopKWarps][kList];
  __shared__ int sel_i[kWarpTopKWarps][kList];
  PdlWait();
  PdlTrigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.x * int64_t{kWarpTopKWarps} + warp;
  if (t >= num_tokens) return;
  const int64_t base = t * num_experts;
  const int groups = num_experts / 8;  // num_experts % 8 == 0 (launcher)
  float v[kWarpTopKGroups][8];
#pragma unroll
  for (int j = 0; j < kWarpTopKGroups; ++j) {
    const int g = lane + 32 * j;
    if (g < groups) {
      Load8(logits, base + 8 * int64_t{g}, v[j]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[j][i] = -INFINITY;
    }
  }
  float lmax = -INFINITY;
#pragma unroll
  for (int j = 0; j < kWarpTopKGroups; ++j) {
#pragma unroll
    for (int i = 0; i < 8; ++i) lmax = fmaxf(lmax, v[j][i]);
  }
  // The warp's maximum and the rank of this lane's maximum (ties to the lower lane).
  float mx = lmax;
  int rank = 0;
  for (int o = 0; o < 32; ++o) {
    const float other = __shfl_sync(0xffffffffu, lmax, o);
    mx = fmaxf(mx, other);
    rank += (other > lmax || (other == lmax && o < lane)) ? 1 : 0;
  }
  const unsigned at = __ballot_sync(0xffffffffu, rank == k - 1);
  const float threshold = __shfl_sync(0xffffffffu, lmax, __ffs(at) - 1);
  float sum = 0.0f;
  int mine = 0;
#pragma unroll
  for (int j = 0; j < kWarpTopKGroups; ++j) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (v[j][i] != -INFINITY) sum += expf(v[j][i] - mx);
      mine += v[j][i] >= threshold && lane + 32 * j < groups ? 1 : 0;
    }
  }
  sum = WarpSum(sum);
  int before = mine;  // inclusive prefix over the lanes, then exclusive
  for (int o = 1; o < 32; o <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, before, o);
    if (lane >= o) before += other;
  }
  const int count = __shfl_sync(0xffffffffu, before, 31);
  before -= mine;
  if (count > kWarpTopKCandidates || threshold == -INFINITY) {
    float lv[kList], wv[kList];
    int li[kList], wi[kList];
    ClearList(lv, li);
#pragma unroll
    for (int j = 0; j < kWarpTopKGroups; ++j) {
      const int g = lane + 32 * j;
      if (g < groups) {
#pragma unroll
        for (int i = 0; i < 8; ++i) InsertSorted(v[j][i], 8 * g + i, lv, li);
      }
    }
    WarpMergeLists(lv, li, k, wv, wi);
    WriteMergedTopK(wv, wi, k, mx, sum, renormalize, lane, t, ids, weights);
    return;
  }
#pragma unroll
  for (int j = 0; j < kWarpTopKGroups; ++j) {
    const int g = lane + 32 * j;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (g < groups && v[j][i] >= threshold) {
        cand_v[warp][before] = v[j][i];
        cand_i[warp][before] = 8 * g + i;
        ++before;
      }
    }
  }
  __syncwarp();
  for (int c = lane; c < count; c += 32) {
    const float cv = cand_v[warp][c];
    const int ci = cand_i[warp][c];
    int better = 0;
    for (int o = 0; o < count; ++o) better += Better(cand_v[warp][o], cand_i[warp][o], cv, ci);
    if (better < k) {
      sel_p[warp][better] = expf(cv - mx) / sum;
      sel_i[warp][better] = ci;
    }
  }
  __syncwarp();
  if (lane < k) {
    float selected = 0.0f;
    for (int q = 0; q < k; ++q) selected += sel_p[warp][q];
    ids[t * k + lane] = sel_i[warp][lane];
    weights[t * k + lane] = renormalize ? sel_p[warp][lane] / selected : sel_p[warp][lane];
  }
}

}  // namespace

TopKOverride TopKOverrideFromEnv() {
  // The choices in TopKOverride's order (0 = unset: kNone).
  static const TopKOverride forced =
      static_cast<TopKOverride>(KnobChoice("MOBIUS_TOPK", {"block", "warp"}));
  return forced;
}

// By default the warp kernel from kWarpTopKMinTokens tokens. Measured on the H200 (session 15,
// mobius_kernel_bench, 2560 experts, fp32 logits, graph-replayed us, block / warp): 6.6 / 12.0 at
// 256 tokens, 15.7 / 14.0 at 1024, 26.9 / 17.5 at 2048, 48.9 / 29.1 at 4096, 91.5 / 50.0 at
// 8192 (crossover near 850 tokens); in the engine the warp kernel cost batch 64 and 256 decode
// 0.3 ms a step each when it took them (session 14).
constexpr int64_t kWarpTopKMinTokens = 1024;

TopKKernel SelectTopKKernel(int64_t num_tokens, int num_experts, int k, bool logits_aligned16,
                            TopKOverride forced) {
  const bool few_k = k <= kRegTopK && k <= num_experts;
  const bool listed_k = k <= kListedTopK && k <= num_experts;  // the warp and filter forms
  if (listed_k && num_experts % 8 == 0 && num_experts <= 32 * 8 * kWarpTopKGroups &&
      logits_aligned16 &&
      (forced == TopKOverride::kWarp ||
       (forced == TopKOverride::kNone && num_tokens >= kWarpTopKMinTokens))) {
    return TopKKernel::kWarpPerToken;
  }
  if (listed_k && num_experts <= kRegTopKThreads * kRegTopKLoads) return TopKKernel::kBlockFilter;
  if (few_k) return TopKKernel::kBlockRegisterLists;
  if (num_experts <= kSmemTopKExperts && k <= kSmemTopKMaxK && k <= num_experts) {
    return TopKKernel::kBlockSharedMemory;
  }
  return TopKKernel::kBlockGeneric;
}

void LaunchTopKSoftmax(AnyPtr logits, int64_t num_tokens, int num_experts, int k, bool renormalize,
                       int32_t* ids, float* weights, cudaStream_t stream) {
  if (num_tokens == 0 || k == 0) return;
  const auto tokens = static_cast<unsigned>(num_tokens);
  switch (SelectTopKKernel(num_tokens, num_experts, k, IsAligned16(logits.data),
                           TopKOverrideFromEnv())) {
    case TopKKernel::kWarpPerToken:
      LaunchPdl("TopKSoftmaxWarpKernel",
                ListSizeFor(k) == kRegTopK ? TopKSoftmaxWarpKernel<kRegTopK>
                                           : TopKSoftmaxWarpKernel<kListedTopK>,
                static_cast<unsigned>((num_tokens + kWarpTopKWarps - 1) / kWarpTopKWarps),
                kWarpTopKWarps * 32, 0, stream, logits, num_tokens, num_experts, k, renormalize,
                ids, weights);
      break;
    case TopKKernel::kBlockFilter:
      LaunchPdl("TopKSoftmaxFilterKernel",
                ListSizeFor(k) == kRegTopK ? TopKSoftmaxFilterKernel<kRegTopK>
                                           : TopKSoftmaxFilterKernel<kListedTopK>,
                tokens, kRegTopKThreads, 0, stream, logits, num_experts, k, renormalize, ids,
                weights);
      break;
    case TopKKernel::kBlockRegisterLists:
      LaunchPdl("TopKSoftmaxRegKernel", TopKSoftmaxRegKernel, tokens, kRegTopKThreads, 0, stream,
                logits, num_experts, k, renormalize, ids, weights);
      break;
    case TopKKernel::kBlockSharedMemory: {
      const int warps = kTopKThreads / 32;
      const size_t smem =
          (sizeof(float) + 1) * num_experts + (sizeof(float) + sizeof(int)) * warps * k;
      TopKSoftmaxSmemKernel<<<tokens, kTopKThreads, smem, stream>>>(logits, num_experts, k,
                                                                    renormalize, ids, weights);
      break;
    }
    case TopKKernel::kBlockGeneric:
      TopKSoftmaxKernel<<<tokens, kTopKThreads, sizeof(int) * k, stream>>>(
          logits, num_experts, k, renormalize, ids, weights);
      break;
  }
  CheckLaunch("TopKSoftmax");
}

}  // namespace mobius::kernels::cuda
