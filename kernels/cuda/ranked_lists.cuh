// Ranking (value, id) pairs on the device: the larger value first, the lower id among equals
// (std::max_element's and the host references' order). Each thread keeps a sorted list of its
// best kList pairs in registers; a warp merges its lanes' lists head by head. Used by the MoE
// router's top-k (topk_softmax.cu, topk_filter.cuh) and the top-n logits of sampling
// (sampling_kernels.cu).
#ifndef MOBIUS_KERNELS_CUDA_RANKED_LISTS_CUH_
#define MOBIUS_KERNELS_CUDA_RANKED_LISTS_CUH_

#include <climits>
#include <cmath>

namespace mobius::kernels::cuda {

__device__ __forceinline__ bool Better(float v, int i, float best_v, int best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

// The warp's best (v, i) in every lane.
__device__ __forceinline__ void WarpArgBest(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (Better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// An empty sorted list (every slot worse than any pair with a real id).
template <int kList>
__device__ __forceinline__ void ClearList(float (&lv)[kList], int (&li)[kList]) {
#pragma unroll
  for (int q = 0; q < kList; ++q) {
    lv[q] = -INFINITY;
    li[q] = INT_MAX;
  }
}

// Inserts (v, e) if it ranks among the list's kList best.
template <int kList>
__device__ __forceinline__ void InsertSorted(float v, int e, float (&lv)[kList], int (&li)[kList]) {
  if (!Better(v, e, lv[kList - 1], li[kList - 1])) return;
  lv[kList - 1] = v;
  li[kList - 1] = e;
#pragma unroll
  for (int q = kList - 1; q > 0; --q) {
    if (Better(lv[q], li[q], lv[q - 1], li[q - 1])) {
      const float tv = lv[q];
      lv[q] = lv[q - 1];
      lv[q - 1] = tv;
      const int ti = li[q];
      li[q] = li[q - 1];
      li[q - 1] = ti;
    }
  }
}

// k (<= kList) rounds of "best head of the warp's lists" (ids distinct across lanes): the results
// land in out_v / out_i of every lane, and the lists lose them.
template <int kList>
__device__ __forceinline__ void WarpMergeLists(float (&lv)[kList], int (&li)[kList], int k,
                                               float (&out_v)[kList], int (&out_i)[kList]) {
#pragma unroll
  for (int j = 0; j < kList; ++j) {
    if (j >= k) break;
    float bv = lv[0];
    int bi = li[0];
    WarpArgBest(bv, bi);
    out_v[j] = bv;
    out_i[j] = bi;
    if (li[0] == bi && bi != INT_MAX) {  // this lane's head was taken: pop it
#pragma unroll
      for (int q = 0; q + 1 < kList; ++q) {
        lv[q] = lv[q + 1];
        li[q] = li[q + 1];
      }
      lv[kList - 1] = -INFINITY;
      li[kList - 1] = INT_MAX;
    }
  }
}

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_RANKED_LISTS_CUH_
