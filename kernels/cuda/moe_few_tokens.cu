// The MoE layer's kernels for decode steps (LaunchMoeExpertsFewTokens, at most
// MoeFewTokensMaxPairs (token, expert) pairs): a gate-up and a down kernel stream each pair's
// expert rows directly, with no grouping, tiles or combine pass, and compute the shared expert's
// down projection where it pays; and the top-k kernel with extra blocks for those rows
// (LaunchTopKSoftmaxWithSharedRows). Many tokens take moe_kernels.cu's grouped path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/moe_common.cuh"
#include "kernels/cuda/topk_filter.cuh"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Few tokens (decode): every (token, expert) pair streams its expert's rows directly, like the
// skinny GEMM, with no routing pass, no tiles and no combine pass. At one token the grouped path
// spent 4.8 us routing, 14 + 9 us in GEMMs with 144-288 blocks of 128-row tiles (2.4 and
// 1.9 TB/s) and 6 us combining; here a layer is two launches over ~2000 warps each.

constexpr int kFewWarps = 8;

// The shared expert's down projection inside the few-token kernels, for kRows rows h0.. of token
// t: a block's threads take its (row, 16-byte piece) pairs pr = row * pieces + piece, thread i
// the pairs i, i + blockDim.x, ..., each adding w[h0 + row, piece] . silu(gate) * up (the act
// piece formed from the fan-out's gate/up row, as SiluAndMul rounds it) into sp[row]; the
// per-warp sums then meet in shared memory in warp order (SharedRowsSum). The down kernel (at
// most kMoeSharedExpertFusedMaxTokens tokens) and the gate-up kernel both compute it this way,
// so either gives the same bits.
// One (row, piece) product: w . a over the piece's eight elements, a = silu(g) * u.
__device__ __forceinline__ float SharedPieceDot(uint4 w, const float (&a)[8]) {
  float wf[8];
  UnpackBf16x8(w, wf);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += wf[i] * a[i];
  return sum;
}

__device__ __forceinline__ float SharedPairDot(uint4 w, uint4 g, uint4 u) {
  float a[8];
  SiluMulPiece(g, u, a);
  return SharedPieceDot(w, a);
}

template <int kRows>
__device__ __forceinline__ void AddSharedPair(int row, uint4 w, uint4 g, uint4 u,
                                              float (&sp)[kRows]) {
  const float sum = SharedPairDot(w, g, u);
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) sp[rr] += rr == row ? sum : 0.f;
}

// Pairs first, first + blockDim.x, ... below `pairs` of rows h0.. of token t.
template <int kRows>
__device__ __forceinline__ void AddSharedPairs(const MoeSharedTerm& shared, int64_t t, int64_t h0,
                                               int64_t first, int64_t pairs, float (&sp)[kRows]) {
  const int64_t pieces = shared.inter / 8;
  const uint4* gu = reinterpret_cast<const uint4*>(shared.gate_up + t * 2 * shared.inter);
  for (int64_t pr = first; pr < pairs; pr += blockDim.x) {
    const int row = static_cast<int>(pr / pieces);
    const int64_t q = pr % pieces;
    AddSharedPair<kRows>(
        row, __ldg(reinterpret_cast<const uint4*>(shared.down + (h0 + row) * shared.inter) + q),
        __ldcg(gu + q), __ldcg(gu + pieces + q), sp);
  }
}

// Each warp's sp into partial[warp]; after the barrier row r's sum (thread r < rows) is
// sum_w partial[w][r].
template <int kRows>
__device__ __forceinline__ float SharedRowsSum(float (&sp)[kRows], float (*partial)[kRows],
                                               int rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) sp[rr] = WarpSum(sp[rr]);
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) partial[warp][rr] = sp[rr];
  }
  __syncthreads();
  float value = 0.f;
  if (threadIdx.x < rows) {
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) value += partial[w][threadIdx.x];
  }
  return value;
}

// Rows of the shared expert's down projection a gate-up kernel computes before its PdlWait (the
// gate/up rows come from the fan-out, two launches back, the weights are constants): at one
// token the top-k kernel between them runs on one SM, so this 2 MB read overlaps it instead of
// lengthening the down kernel. The same four-row pieces as the default down kernel.
constexpr int kSharedRowsInGateUp = 4;
// Up to this many tokens every gate-up block takes shared-row units (SharedExpertInGateUp).
constexpr int kSharedRowsSpreadMaxTokens = 2;

// One unit: rows h0.. (up to four) of token t into shared_out, then a barrier, as partial is
// reused by the block's next unit.
__device__ __forceinline__ void SharedRowsUnit(const MoeSharedTerm& shared, int64_t t, int64_t h0,
                                               int64_t hidden,
                                               float (*partial)[kSharedRowsInGateUp],
                                               uint16_t* shared_out) {
  const int rows =
      static_cast<int>(hidden - h0 < kSharedRowsInGateUp ? hidden - h0 : kSharedRowsInGateUp);
  float sp[kSharedRowsInGateUp] = {};
  AddSharedPairs(shared, t, h0, threadIdx.x, rows * (shared.inter / 8), sp);
  const float value = SharedRowsSum(sp, partial, rows);
  if (threadIdx.x < rows) shared_out[t * hidden + h0 + threadIdx.x] = F32ToBf16(value);
  __syncthreads();
}

// Up to kSharedRowsSpreadMaxTokens tokens a unit is (token, four rows) and every block of the grid
// takes units (at one token the 512 units are one wave's worth). With more tokens
// (shared.unit_blocks > 0) a unit is four rows of every token, one token after another, and only
// the first unit_blocks blocks take units: the blocks resident in the first wave, whose work here
// overlaps the top-k, where units spread over the whole grid would put the rest in front of the
// later waves' weight streams. The per-token arithmetic is the same either way (and the same as the
// down kernel's).
__device__ __forceinline__ void SharedExpertInGateUp(const MoeSharedTerm& shared,
                                                     int64_t num_tokens, int64_t hidden,
                                                     uint16_t* shared_out) {
  __shared__ float partial[kFewWarps][kSharedRowsInGateUp];
  const int64_t row_blocks = (hidden + kSharedRowsInGateUp - 1) / kSharedRowsInGateUp;
  const int64_t block = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  if (shared.unit_blocks > 0) {
    if (block >= shared.unit_blocks) return;
    for (int64_t u = block; u < row_blocks; u += shared.unit_blocks) {
      for (int64_t t = 0; t < num_tokens; ++t) {
        SharedRowsUnit(shared, t, u * kSharedRowsInGateUp, hidden, partial, shared_out);
      }
    }
    return;
  }
  const int64_t blocks = static_cast<int64_t>(gridDim.x) * gridDim.y;
  for (int64_t u = block; u < num_tokens * row_blocks; u += blocks) {
    SharedRowsUnit(shared, u / row_blocks, (u % row_blocks) * kSharedRowsInGateUp, hidden, partial,
                   shared_out);
  }
}

// The shared expert's rows computed beside the top-k (TopKSoftmaxFilterSharedRowsKernel), for
// 4-8 tokens, where the gate-up kernel's first wave hides them less well or not at all
// (performance.md, twenty-sixth version). The top-k grid gets extra blocks; each holds
// kSharedRowGroups groups of kFewWarps warps, and a group takes kSharedUnitsPerGroup four-row
// units for every token (one unit: 256 blocks at hidden 2048, two per SM; four units, 64
// blocks, measured slower than the separate projection: the blocks finished well after the
// top-k, performance.md twenty-sixth version). A
// block loads its weight pieces before the PDL wait (constants), then forms every token's
// silu(gate) * up once into shared memory (SiluMulPiece, as the gate-up kernel rounds it) and
// takes the (row, piece) products from there. A group computes each (token, row) as a gate-up
// block's SharedRowsUnit does (thread tid's pair tid, the per-warp sums in warp order), so the
// rows have the same bits as the gate-up and down kernels' placements. The launcher requires one
// pair per thread: 4 rows x inter / 8 pieces <= kFewWarps * 32 (inter <= 512).
constexpr int kSharedRowGroups = 2;  // of kFewWarps * 32 threads, in a top-k block's 512
constexpr int kSharedUnitsPerGroup = 1;
constexpr int kSharedBesideTopKMaxTokens = kMoeSharedBesideTopKMaxTokens;            // (launch.h)
constexpr int kSharedBesideTopKMaxInter = kFewWarps * 32 / kSharedRowsInGateUp * 8;  // 512
static_assert(kSharedRowGroups * kFewWarps * 32 == kRegTopKThreads);

__device__ __forceinline__ void SharedRowsBesideTopK(const MoeSharedTerm& shared,
                                                     int64_t num_tokens, int64_t hidden,
                                                     int64_t block, uint16_t* shared_out) {
  constexpr int kUnits = kSharedUnitsPerGroup, kMaxT = kSharedBesideTopKMaxTokens;
  constexpr int kGroupThreads = kFewWarps * 32;
  __shared__ float partial[kSharedRowGroups][kUnits][kMaxT][kFewWarps][kSharedRowsInGateUp];
  __shared__ __align__(16) float act[kMaxT * kSharedBesideTopKMaxInter];
  const int group = static_cast<int>(threadIdx.x) / kGroupThreads;
  const int tid = static_cast<int>(threadIdx.x) % kGroupThreads;
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t inter = shared.inter, pieces = inter / 8;
  const int64_t pairs = kSharedRowsInGateUp * pieces;  // <= kGroupThreads (launcher)
  const int row = static_cast<int>(tid / pieces);
  const int64_t q = tid % pieces;
  const int64_t unit0 = (block * kSharedRowGroups + group) * kUnits;
  uint4 w[kUnits];
  bool has[kUnits];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int64_t h = (unit0 + u) * kSharedRowsInGateUp + row;
    has[u] = tid < pairs && h < hidden;
    w[u] = has[u] ? __ldg(reinterpret_cast<const uint4*>(shared.down + h * inter) + q)
                  : make_uint4(0, 0, 0, 0);
  }
  PdlWait();
  PdlTrigger();
  for (int64_t i = threadIdx.x; i < num_tokens * pieces; i += blockDim.x) {
    const int64_t t = i / pieces, p = i % pieces;
    const uint4* gu = reinterpret_cast<const uint4*>(shared.gate_up + t * 2 * inter);
    float a[8];
    SiluMulPiece(__ldcg(gu + p), __ldcg(gu + pieces + p), a);
    float4* dst = reinterpret_cast<float4*>(act + t * inter + p * 8);
    dst[0] = make_float4(a[0], a[1], a[2], a[3]);
    dst[1] = make_float4(a[4], a[5], a[6], a[7]);
  }
  __syncthreads();
  // A warp's pairs lie in one row when a row's pieces are a multiple of 32: one sum per
  // (token, unit), the warp's other rows +0 as in SharedRowsSum.
  const bool row_per_warp = pieces % 32 == 0;
  const int warp_row = static_cast<int>((static_cast<int64_t>(warp) * 32) / pieces);
  for (int t = 0; t < num_tokens; ++t) {
    float a[8];
    if (tid < pairs) {
      const float4* src = reinterpret_cast<const float4*>(act + t * inter + q * 8);
      const float4 lo = src[0], hi = src[1];
      a[0] = lo.x, a[1] = lo.y, a[2] = lo.z, a[3] = lo.w;
      a[4] = hi.x, a[5] = hi.y, a[6] = hi.z, a[7] = hi.w;
    }
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      const float s = has[u] ? 0.f + SharedPieceDot(w[u], a) : 0.f;
      if (row_per_warp) {
        const float sum = WarpSum(s);
        if (lane < kSharedRowsInGateUp) {
          partial[group][u][t][warp][lane] = lane == warp_row ? sum : 0.f;
        }
      } else {
#pragma unroll
        for (int rr = 0; rr < kSharedRowsInGateUp; ++rr) {
          const float sum = WarpSum(rr == row ? s : 0.f);
          if (lane == 0) partial[group][u][t][warp][rr] = sum;
        }
      }
    }
  }
  __syncthreads();
  const int64_t outputs = static_cast<int64_t>(kUnits) * num_tokens * kSharedRowsInGateUp;
  for (int64_t i = tid; i < outputs; i += kGroupThreads) {
    const int r = static_cast<int>(i % kSharedRowsInGateUp);
    const int64_t t = (i / kSharedRowsInGateUp) % num_tokens;
    const int u = static_cast<int>(i / (kSharedRowsInGateUp * num_tokens));
    const int64_t h = (unit0 + u) * kSharedRowsInGateUp + r;
    if (h >= hidden) continue;
    float value = 0.f;
    for (int wi = 0; wi < kFewWarps; ++wi) value += partial[group][u][t][wi][r];
    shared_out[t * hidden + h] = F32ToBf16(value);
  }
}

// Blocks 0 .. num_tokens - 1: TopKSoftmaxFilterKernel's; the rest: SharedRowsBesideTopK.
// Two blocks per SM (at most 64 registers; 56 used), so that blocks can become resident beside the
// fan-out's and the gate-up kernel's. k <= kRegTopK only: with kListedTopK lists its filter
// spills under that register cap.
__global__ void __launch_bounds__(kRegTopKThreads, 2)
    TopKSoftmaxFilterSharedRowsKernel(AnyPtr logits, int num_experts, int k, bool renormalize,
                                      int32_t* ids, float* weights, const MoeSharedTerm shared,
                                      int64_t num_tokens, int64_t hidden, uint16_t* shared_out) {
  if (blockIdx.x < num_tokens) {
    PdlWait();
    PdlTrigger();
    TopKFilterToken<kRegTopK>(logits, num_experts, k, renormalize, ids, weights, blockIdx.x);
    return;
  }
  SharedRowsBesideTopK(shared, num_tokens, hidden, blockIdx.x - num_tokens, shared_out);
}

// act[p, i] = silu(x[t] . gate[e, i]) * (x[t] . up[e, i]) for pair p = (t, j), e = ids[p]: kSplit
// warps compute kCols columns i (2 kCols weight rows) together, each taking every kSplit-th
// 32-piece stretch of the hidden dimension, each lane keeping kUnroll 16-byte pieces of each row in
// flight; with kSplit > 1 the warps' sums meet in shared memory. Grid (ceil(I / (8 kCols /
// kSplit)), pairs).
template <int kCols, int kUnroll, int kSplit, bool kSharedRows = false>
__global__ void __launch_bounds__(kFewWarps * 32)
    MoeFewGateUpKernel(const uint16_t* x, const int32_t* ids, const uint16_t* gate_up,
                       int64_t hidden, int64_t inter, int k, int first_expert, int num_local,
                       uint16_t* act, const MoeSharedTerm shared, int64_t num_tokens,
                       uint16_t* shared_out) {
  static_assert(kFewWarps % kSplit == 0);
  constexpr int kRows = 2 * kCols;
  // (A template flag, so the other variants keep their 40 registers: 6 blocks per SM.)
  if constexpr (kSharedRows) SharedExpertInGateUp(shared, num_tokens, hidden, shared_out);
  PdlWait();
  PdlTrigger();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int slice = warp % kSplit;
  const int64_t p = blockIdx.y;
  const int e = ids[p] - first_expert;
  if (e < 0 || e >= num_local) return;  // another rank's expert: the down kernel skips it too
  const int64_t i0 =
      (static_cast<int64_t>(blockIdx.x) * (kFewWarps / kSplit) + warp / kSplit) * kCols;
  if (kSplit == 1 && i0 >= inter) return;  // (with kSplit > 1 every warp reaches the barrier)
  const uint16_t* w = gate_up + static_cast<int64_t>(e) * 2 * inter * hidden;
  const uint4* rows[kRows];  // gate rows of the columns, then their up rows
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t i = i0 + c < inter ? i0 + c : 0;
    rows[c] = reinterpret_cast<const uint4*>(w + i * hidden);
    rows[kCols + c] = reinterpret_cast<const uint4*>(w + (inter + i) * hidden);
  }
  const uint4* xr = reinterpret_cast<const uint4*>(x + (p / k) * hidden);
  const int64_t pieces = hidden / 8;
  constexpr int kStride = 32 * kSplit;
  float acc[kRows] = {};
  for (int64_t base = slice * 32 + lane; base < pieces; base += kStride * kUnroll) {
    uint4 wv[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t q = base + kStride * u;
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        wv[u][r] = q < pieces ? __ldg(rows[r] + q) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t q = base + kStride * u;
      if (q >= pieces) break;
      float xv[8];
      UnpackBf16x8(__ldg(xr + q), xv);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float wf[8];
        UnpackBf16x8(wv[u][r], wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r] += wf[i] * xv[i];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = WarpSum(acc[r]);
  if constexpr (kSplit > 1) {
    __shared__ float partial[kFewWarps][kRows];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) partial[warp][r] = acc[r];
    }
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float sum = partial[warp][r];
#pragma unroll
      for (int j = 1; j < kSplit; ++j) sum += partial[warp + j][r];
      acc[r] = sum;
    }
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    if (lane == c && i0 + c < inter) {
      act[p * inter + i0 + c] = F32ToBf16(Silu(acc[c]) * acc[kCols + c]);
    }
  }
}

// The few-token down kernels' result for out[i] (row t) from its routed sum: out + sum, or, when
// the shared expert's finished term is fused in, RoutedPlusShared (out is then written without
// being read, so it needs no zero fill).
__device__ __forceinline__ uint16_t FewDownResult(const uint16_t* out, const MoeSharedTerm& shared,
                                                  int64_t t, int64_t i, float sum) {
  if (shared.value == nullptr) return F32ToBf16(Bf16ToF32(out[i]) + sum);
  return RoutedPlusShared(sum, Bf16ToF32(shared.value[i]), Load(shared.gate_logits, t));
}

// out[t, h] += sum_j weights[t, j] * (act[(t, j)] . down[e_j, h]): a warp computes two rows h of
// one token over all its k experts, one expert after another. Grid (ceil(H / 16), tokens). The
// first few-token down kernel, kept for A/B runs (MOBIUS_MOE_FEW=v1); it takes a finished shared
// term only.
__global__ void __launch_bounds__(kFewWarps * 32)
    MoeFewDownKernel(const uint16_t* act, const int32_t* ids, const float* weights,
                     const uint16_t* down, int64_t hidden, int64_t inter, int k, int first_expert,
                     int num_local, uint16_t* out, const MoeSharedTerm shared) {
  PdlWait();
  PdlTrigger();
  const int lane = threadIdx.x & 31;
  const int64_t t = blockIdx.y;
  const int64_t h0 = (static_cast<int64_t>(blockIdx.x) * kFewWarps + (threadIdx.x >> 5)) * 2;
  if (h0 >= hidden) return;
  const bool second = h0 + 1 < hidden;
  const int64_t pieces = inter / 8;
  float acc[2] = {};
#pragma unroll 4
  for (int j = 0; j < k; ++j) {
    const int64_t p = t * k + j;
    const int e = ids[p] - first_expert;
    if (e < 0 || e >= num_local) continue;
    const float wj = weights[p];
    const uint16_t* w = down + static_cast<int64_t>(e) * hidden * inter;
    const uint4* r0 = reinterpret_cast<const uint4*>(w + h0 * inter);
    const uint4* r1 = reinterpret_cast<const uint4*>(w + (second ? h0 + 1 : h0) * inter);
    const uint4* ar = reinterpret_cast<const uint4*>(act + p * inter);
    float part[2] = {};
    for (int64_t q = lane; q < pieces; q += 32) {
      float av[8], w0[8], w1[8];
      UnpackBf16x8(__ldg(r0 + q), w0);
      UnpackBf16x8(__ldg(r1 + q), w1);
      UnpackBf16x8(ar[q], av);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        part[0] += w0[i] * av[i];
        part[1] += w1[i] * av[i];
      }
    }
    acc[0] += wj * part[0];
    acc[1] += wj * part[1];
  }
  acc[0] = WarpSum(acc[0]);
  acc[1] = WarpSum(acc[1]);
  if (lane < 2 && (lane == 0 || second)) {
    const int64_t i = t * hidden + h0 + lane;
    out[i] = FewDownResult(out, shared, t, i, acc[lane]);
  }
}

// The few-token down kernel's work for one expert slot of one token, rows h0.. of which `rows`
// are valid (the others repeat row h0 and are not stored), in three helpers.
//
// Row h0 of expert e's (local index) down weights, or null when e is another rank's; row h0 + rr
// follows at rr * pieces 16-byte pieces.
__device__ __forceinline__ const uint4* DownExpertRows(int e, int num_local, const uint16_t* down,
                                                       int64_t hidden, int64_t inter, int64_t h0) {
  if (e < 0 || e >= num_local) return nullptr;
  return reinterpret_cast<const uint4*>(down + (static_cast<int64_t>(e) * hidden + h0) * inter);
}

// Pieces base and base + 32 of rows 0..kRows-1 from r (rows past `rows` repeat row 0; zero past
// a row's end).
template <int kRows>
__device__ __forceinline__ void LoadDownPieces(const uint4* r, int rows, int64_t base,
                                               int64_t pieces, uint4 (&wv)[2][kRows]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int64_t q = base + 32 * u;
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      wv[u][rr] =
          q < pieces ? __ldg(r + (rr < rows ? rr : 0) * pieces + q) : make_uint4(0, 0, 0, 0);
    }
  }
}

// part[rr] = this lane's share of row rr . act (ar): pieces lane, lane + 32, lane + 64, ...,
// two per step. wv holds the first step's weight pieces on entry.
template <int kRows>
__device__ __forceinline__ void DownSlotPartial(const uint4* r, int rows, const uint4* ar,
                                                int64_t pieces, int lane, uint4 (&wv)[2][kRows],
                                                float (&part)[kRows]) {
  for (int64_t base = lane; base < pieces; base += 64) {
    if (base != lane) LoadDownPieces(r, rows, base, pieces, wv);
    uint4 av[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t q = base + 32 * u;
      av[u] = q < pieces ? ar[q] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      float a[8];
      UnpackBf16x8(av[u], a);
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        float wf[8];
        UnpackBf16x8(wv[u][rr], wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) part[rr] += wf[i] * a[i];
      }
    }
  }
}

// The same sum with the experts spread over the warps: a block computes kRows rows h of one
// token, warp w the expert slots j = w, w + 8, ... At one token the kernel above ran H / 16 = 128
// blocks, one per SM, each warp walking its k experts with two short loads per lane in flight;
// here H / 4 = 512 blocks, and each warp issues its rows of one expert and the act row at once.
// The warps' weighted partials meet in shared memory; out is read and written once per row.
//
// With kSharedExpert the block also computes its rows of the shared expert's down projection
// from the shared expert's gate/up row (MoeSharedTerm): its (row, 16-byte piece) products are
// spread over all threads (at kRows = 4 and I = 512, one piece per thread), the weight piece
// loaded before PdlWait (weights are no kernel's output) and the gate/up pieces right after it,
// ahead of the routed loads. At batch 1 that projection as its own launch took 5.1 us for a
// ~0.5 us weight read. (A ninth warp per block for it instead measured 7.8 -> 10.6 us for this
// kernel: 92 registers x 288 threads leave two blocks per SM, two waves of the 512 blocks.)
// At 4 rows the registers are held to 3 blocks per SM (80); 4 per SM (64 registers, one wave
// of 512 blocks) spills here and measured slower: batch 1 3.72 vs 3.62 ms, batch 8 9.36 vs
// 8.59 ms. The shared expert's part costs each block a little latency, which batch 8 (4096
// blocks, ~10 waves) pays ~10 times: there the fused form measured 8.59 ms against 8.39 ms
// with the separate projection, at batch 1 3.62 against 3.70 ms (LaunchMoeExpertsFewTokens
// takes it up to kMoeSharedExpertFusedMaxTokens). By default those rows now come from the
// gate-up kernel (SharedExpertInGateUp) and this kernel adds them as a finished term; this form
// stays for MOBIUS_MOE_SHARED_IN_GATEUP=0 and the non-default gate-up shapes.
template <int kFewDownRows, bool kSharedExpert>
__global__ void __launch_bounds__(kFewWarps * 32, kFewDownRows <= 4 ? 3 : 1)
    MoeFewDownRowsKernel(const uint16_t* act, const int32_t* ids, const float* weights,
                         const uint16_t* down, int64_t hidden, int64_t inter, int k,
                         int first_expert, int num_local, uint16_t* out,
                         const MoeSharedTerm shared) {
  __shared__ float partial[kFewWarps][kFewDownRows];
  __shared__ float shared_partial[kSharedExpert ? kFewWarps : 1][kFewDownRows];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.y;
  const int64_t h0 = static_cast<int64_t>(blockIdx.x) * kFewDownRows;
  const int rows = hidden - h0 < kFewDownRows ? static_cast<int>(hidden - h0) : kFewDownRows;

  // The shared expert's first (row, piece) pair of this thread.
  const int64_t s_pieces = kSharedExpert ? shared.inter / 8 : 0;
  const int64_t s_pairs = rows * s_pieces;
  const bool s_first = kSharedExpert && threadIdx.x < s_pairs;
  int s_row = 0;
  int64_t s_piece = 0;
  uint4 s_w = make_uint4(0, 0, 0, 0), s_g = s_w, s_u = s_w;
  const uint4* s_gu = nullptr;
  if constexpr (kSharedExpert) {
    s_gu = reinterpret_cast<const uint4*>(shared.gate_up + t * 2 * shared.inter);
    if (s_first) {
      s_row = static_cast<int>(threadIdx.x / s_pieces);
      s_piece = threadIdx.x % s_pieces;
      s_w = __ldg(reinterpret_cast<const uint4*>(shared.down + (h0 + s_row) * shared.inter) +
                  s_piece);
    }
  }
  // This warp's first expert slot (j = warp) and its first 64 pieces of weight rows are loaded
  // before PdlWait: the ids and routing weights come from the top-k two launches back (the
  // gate-up kernel between waited for it before this grid could launch, PdlTrigger following
  // its PdlWait) and the expert weights are constants; only act is the gate-up's output. At one
  // token (I = 512) that is the block's whole weight read, which then overlaps the gate-up
  // kernel's tail instead of following it.
  const int64_t pieces = inter / 8;
  const uint4* first_rows = warp < k ? DownExpertRows(ids[t * k + warp] - first_expert, num_local,
                                                      down, hidden, inter, h0)
                                     : nullptr;
  const float first_weight = first_rows != nullptr ? weights[t * k + warp] : 0.f;
  uint4 first_wv[2][kFewDownRows];
  if (first_rows != nullptr) LoadDownPieces(first_rows, rows, lane, pieces, first_wv);

  PdlWait();
  PdlTrigger();
  if (s_first) {
    s_g = s_gu[s_piece];
    s_u = s_gu[s_pieces + s_piece];
  }

  float acc[kFewDownRows] = {};
  if (first_rows != nullptr) {
    float part[kFewDownRows] = {};
    DownSlotPartial(first_rows, rows, reinterpret_cast<const uint4*>(act + (t * k + warp) * inter),
                    pieces, lane, first_wv, part);
#pragma unroll
    for (int rr = 0; rr < kFewDownRows; ++rr) acc[rr] += first_weight * part[rr];
  }
  for (int j = warp + kFewWarps; j < k; j += kFewWarps) {
    const int64_t p = t * k + j;
    const uint4* r = DownExpertRows(ids[p] - first_expert, num_local, down, hidden, inter, h0);
    if (r == nullptr) continue;
    const float wj = weights[p];
    uint4 wv[2][kFewDownRows];
    LoadDownPieces(r, rows, lane, pieces, wv);
    float part[kFewDownRows] = {};
    DownSlotPartial(r, rows, reinterpret_cast<const uint4*>(act + p * inter), pieces, lane, wv,
                    part);
#pragma unroll
    for (int rr = 0; rr < kFewDownRows; ++rr) acc[rr] += wj * part[rr];
  }
#pragma unroll
  for (int rr = 0; rr < kFewDownRows; ++rr) acc[rr] = WarpSum(acc[rr]);
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < kFewDownRows; ++rr) partial[warp][rr] = acc[rr];
  }

  float shared_value = 0.f;
  if constexpr (kSharedExpert) {
    float sp[kFewDownRows] = {};
    if (s_first) AddSharedPair<kFewDownRows>(s_row, s_w, s_g, s_u, sp);
    AddSharedPairs(shared, t, h0, threadIdx.x + blockDim.x, s_pairs, sp);
    shared_value = SharedRowsSum(sp, shared_partial, rows);  // (its barrier covers partial too)
  } else {
    __syncthreads();
  }
  if (threadIdx.x < rows) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kFewWarps; ++w) sum += partial[w][threadIdx.x];
    const int64_t i = t * hidden + h0 + threadIdx.x;
    if constexpr (kSharedExpert) {
      // Rounded to bf16 as the separate projection (and SharedExpertInGateUp) stores it.
      out[i] =
          RoutedPlusShared(sum, Bf16ToF32(F32ToBf16(shared_value)), Load(shared.gate_logits, t));
    } else {
      out[i] = FewDownResult(out, shared, t, i, sum);
    }
  }
}

}  // namespace

bool LaunchTopKSoftmaxWithSharedRows(AnyPtr logits, int64_t num_tokens, int num_experts, int k,
                                     bool renormalize, int32_t* ids, float* weights,
                                     const MoeSharedTerm& shared, int64_t hidden,
                                     uint16_t* shared_out, cudaStream_t stream) {
  if (num_tokens < 1 || num_tokens > kSharedBesideTopKMaxTokens || k < 1 || k > kRegTopK ||
      hidden < 1 || shared.gate_up == nullptr || shared.down == nullptr || shared.inter < 8 ||
      shared.inter % 8 != 0 || shared.inter > kSharedBesideTopKMaxInter ||
      !IsAligned16(shared.gate_up) || !IsAligned16(shared.down) || shared_out == nullptr ||
      SelectTopKKernel(num_tokens, num_experts, k, IsAligned16(logits.data),
                       TopKOverrideFromEnv()) != TopKKernel::kBlockFilter) {
    return false;
  }
  constexpr int64_t kRowsPerBlock =
      int64_t{kSharedRowGroups} * kSharedUnitsPerGroup * kSharedRowsInGateUp;
  const int64_t shared_blocks = (hidden + kRowsPerBlock - 1) / kRowsPerBlock;
  LaunchPdl("TopKSoftmaxFilterSharedRowsKernel", TopKSoftmaxFilterSharedRowsKernel,
            static_cast<unsigned>(num_tokens + shared_blocks), kRegTopKThreads, 0, stream, logits,
            num_experts, k, renormalize, ids, weights, shared, num_tokens, hidden, shared_out);
  CheckLaunch("TopKSoftmaxWithSharedRows");
  return true;
}

namespace {

using FewGateUpFn = void (*)(const uint16_t*, const int32_t*, const uint16_t*, int64_t, int64_t,
                             int, int, int, uint16_t*, MoeSharedTerm, int64_t, uint16_t*);
using FewDownFn = void (*)(const uint16_t*, const int32_t*, const float*, const uint16_t*, int64_t,
                           int64_t, int, int, int, uint16_t*, MoeSharedTerm);

// The few-token kernels' shape: gate-up columns per warp group, pieces in flight per row, warps
// per column group (split hidden), down rows per block (0: the first, expert-serial down kernel).
struct FewConfig {
  int cols = 1, unroll = 2, split = 1, down_rows = 4;
};

// MOBIUS_MOE_FEW (A/B runs): "v1" = the first kernels (2 columns, unroll 2, expert-serial down);
// otherwise tokens c1/c2 (columns), u2/u4/u8 (unroll), s2/s4 (split), d2/d4/d8 (down rows)
// override the default.
FewConfig FewConfigFor() {
  static const std::string variant = [] {
    const char* env = std::getenv("MOBIUS_MOE_FEW");
    return std::string(env != nullptr ? env : "");
  }();
  FewConfig c;
  if (variant == "v1") return FewConfig{2, 2, 1, 0};
  auto has = [](std::string_view token) { return variant.find(token) != std::string::npos; };
  if (has("c1")) c.cols = 1;
  if (has("c2")) c.cols = 2;
  if (has("u2")) c.unroll = 2;
  if (has("u4")) c.unroll = 4;
  if (has("u8")) c.unroll = 8;
  if (has("s2")) c.split = 2;
  if (has("s4")) c.split = 4;
  if (has("d2")) c.down_rows = 2;
  if (has("d4")) c.down_rows = 4;
  if (has("d8")) c.down_rows = 8;
  return c;
}

template <int kSplit>
FewGateUpFn FewGateUpSplit(const FewConfig& c) {
  if (c.cols == 1) {
    return c.unroll == 4   ? MoeFewGateUpKernel<1, 4, kSplit>
           : c.unroll == 8 ? MoeFewGateUpKernel<1, 8, kSplit>
                           : MoeFewGateUpKernel<1, 2, kSplit>;
  }
  return c.unroll == 4   ? MoeFewGateUpKernel<2, 4, kSplit>
         : c.unroll == 8 ? MoeFewGateUpKernel<2, 8, kSplit>
                         : MoeFewGateUpKernel<2, 2, kSplit>;
}

// The gate-up kernel that also computes the shared expert's rows: one or two columns per warp
// at the default unroll and split, with the default four-row down blocks whose per-row sums it
// reproduces (null otherwise, and the down kernel computes them).
FewGateUpFn FewGateUpWithSharedRows(const FewConfig& c) {
  const FewConfig d;
  if (c.unroll != d.unroll || c.split != d.split || c.down_rows != kSharedRowsInGateUp) {
    return nullptr;
  }
  return c.cols == 1   ? MoeFewGateUpKernel<1, 2, 1, true>
         : c.cols == 2 ? MoeFewGateUpKernel<2, 2, 1, true>
                       : nullptr;
}

// Blocks of the gate-up kernel with the shared rows resident at once: one wave. Queried once,
// as TcGemvSplit does (the variant is fixed per process by FewConfigFor); a failed query leaves
// one block per SM, a smaller first wave.
int64_t SharedRowsFirstWave(FewGateUpFn kernel) {
  static const int64_t blocks = [kernel] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kFewWarps * 32, 0);
    return static_cast<int64_t>(std::max(1, sms)) * std::max(1, per_sm);
  }();
  return blocks;
}

FewGateUpFn FewGateUp(const FewConfig& c) {
  return c.split == 4   ? FewGateUpSplit<4>(c)
         : c.split == 2 ? FewGateUpSplit<2>(c)
                        : FewGateUpSplit<1>(c);
}

template <int kFewDownRows>
FewDownFn FewDownRows(bool shared_expert) {
  return shared_expert ? MoeFewDownRowsKernel<kFewDownRows, true>
                       : MoeFewDownRowsKernel<kFewDownRows, false>;
}

// The down kernel of `c`, with the shared expert's projection inside (kSharedExpert) or not;
// null where that combination does not exist (the first kernel takes a finished term only).
FewDownFn FewDown(const FewConfig& c, bool shared_expert) {
  switch (c.down_rows) {
    case 0:
      return shared_expert ? nullptr : MoeFewDownKernel;
    case 2:
      return FewDownRows<2>(shared_expert);
    case 8:
      return FewDownRows<8>(shared_expert);
    default:
      return FewDownRows<4>(shared_expert);
  }
}

}  // namespace

namespace {

// MoeFewTokensMaxPairs without the knob: the most pairs at which the few-token kernels' extra
// reads stay within the grouped path's costs (launch.h).
int PairLimitFor(int64_t num_experts) {
  if (num_experts <= 1) return kMoeFewTokensMinPairs;
  // n pairs drawn uniformly over E experts touch d(n) = E (1 - (1 - 1/E)^n) distinct experts; the
  // other n - d(n) pairs share one. (A token's own k are distinct, so this slightly overcounts.)
  // excess(n) = n - d(n) - fixed - per_expert d(n) is convex in n and negative at n = 0, so the
  // pairs that fit form one interval from 0 and its end is found by bisection.
  const double e = static_cast<double>(num_experts), log_miss = std::log1p(-1.0 / e);
  auto fits = [&](int n) {
    const double distinct = e * -std::expm1(n * log_miss);
    return n - distinct <= kMoeGroupedFixedCost + kMoeGroupedCostPerExpert * distinct;
  };
  int lo = kMoeFewTokensMinPairs, hi = kMoeFewTokensMaxPairs;
  if (fits(hi)) return hi;
  while (hi - lo > 1) {  // hi does not fit; lo is the answer if nothing above it fits
    const int mid = (lo + hi) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace

int MoeFewTokensMaxPairs(int64_t num_experts) {
  static const int forced = KnobInt("MOBIUS_MOE_FEW_MAX_PAIRS", 0, 1, 1024);
  if (forced > 0) return forced;
  // Asked twice per MoE op (the backend, then the launcher), with one bank size a model: the last
  // answer is kept.
  thread_local int64_t last_experts = -1;
  thread_local int last_limit = 0;
  if (num_experts != last_experts) {
    last_limit = PairLimitFor(num_experts);
    last_experts = num_experts;
  }
  return last_limit;
}

bool LaunchMoeExpertsFewTokens(const uint16_t* x, const int32_t* ids, const float* weights,
                               const uint16_t* gate_up, const uint16_t* down, int64_t num_tokens,
                               int k, int num_local_experts, int first_expert, int64_t hidden,
                               int64_t inter, uint16_t* act_scratch, uint16_t* out,
                               const MoeSharedTerm* shared, cudaStream_t stream) {
  static const bool grouped_only = MoeGemmKnob() == 2;
  const int64_t pairs = num_tokens * k;
  if (pairs == 0 || pairs > MoeFewTokensMaxPairs(num_local_experts) || hidden % 8 != 0 ||
      inter % 8 != 0 || !IsAligned16(x) || !IsAligned16(gate_up) || !IsAligned16(down) ||
      !IsAligned16(act_scratch) || ForcedFma() || grouped_only) {
    return false;
  }
  const bool shared_expert = shared != nullptr && shared->value == nullptr;
  if (shared_expert && (num_tokens > shared->fused_max_tokens || shared->gate_up == nullptr ||
                        shared->down == nullptr || shared->inter <= 0 || shared->inter % 8 != 0 ||
                        !IsAligned16(shared->gate_up) || !IsAligned16(shared->down))) {
    return false;
  }
  const FewConfig c = FewConfigFor();
  // The shared expert's down projection: in the gate-up kernel (before its PdlWait) by default,
  // the down kernel then adding the finished rows; MOBIUS_MOE_SHARED_IN_GATEUP=0 leaves it to
  // the down kernel (A/B runs). Both give the same bits.
  static const bool in_gate_up = KnobChoice("MOBIUS_MOE_SHARED_IN_GATEUP", {"0", "1"}) != 1;
  const MoeSharedTerm term = shared == nullptr ? MoeSharedTerm{} : *shared;
  MoeSharedTerm down_term = term;
  uint16_t* shared_out = nullptr;
  FewGateUpFn gate_up_kernel = FewGateUp(c);
  FewDownFn down_kernel = FewDown(c, shared_expert);
  const FewGateUpFn with_rows = FewGateUpWithSharedRows(c);
  const int64_t cols_per_block = static_cast<int64_t>(c.cols) * kFewWarps / c.split;
  const dim3 gate_up_grid(static_cast<unsigned>((inter + cols_per_block - 1) / cols_per_block),
                          static_cast<unsigned>(pairs));
  MoeSharedTerm gate_up_term = term;
  if (shared_expert && in_gate_up && term.rows_in_gate_up && with_rows != nullptr) {
    shared_out = act_scratch + MoeFewTokensSharedRowsOffset(num_tokens, k, inter);
    down_term.value = shared_out;
    gate_up_kernel = with_rows;
    down_kernel = FewDown(c, /*shared_expert=*/false);
    // Beyond kSharedRowsSpreadMaxTokens only the first wave's blocks take the shared rows
    // (SharedExpertInGateUp); MOBIUS_MOE_SHARED_SPREAD=grid spreads them over the grid.
    static const bool spread = KnobChoice("MOBIUS_MOE_SHARED_SPREAD", {"wave", "grid"}) == 1;
    if (num_tokens > kSharedRowsSpreadMaxTokens && !spread) {
      gate_up_term.unit_blocks = static_cast<int>(std::min<int64_t>(
          static_cast<int64_t>(gate_up_grid.x) * gate_up_grid.y, SharedRowsFirstWave(with_rows)));
    }
  }
  if (down_kernel == nullptr) return false;
  LaunchPdl("MoeFewGateUpKernel", gate_up_kernel, gate_up_grid, kFewWarps * 32, 0, stream, x, ids,
            gate_up, hidden, inter, k, first_expert, num_local_experts, act_scratch, gate_up_term,
            num_tokens, shared_out);
  CheckLaunch("MoeFewGateUp");
  // The first down kernel: two rows per warp, 16 per block.
  const int64_t rows_per_block = c.down_rows == 0 ? 2 * kFewWarps : c.down_rows;
  LaunchPdl("MoeFewDownKernel", down_kernel,
            dim3(static_cast<unsigned>((hidden + rows_per_block - 1) / rows_per_block),
                 static_cast<unsigned>(num_tokens)),
            kFewWarps * 32, 0, stream, act_scratch, ids, weights, down, hidden, inter, k,
            first_expert, num_local_experts, out, down_term);
  CheckLaunch("MoeFewDown");
  return true;
}

}  // namespace mobius::kernels::cuda
