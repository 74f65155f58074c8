// Gated DeltaNet kernels: the causal depthwise conv (+ SiLU) with its rolling state, the gate
// activations, and the gated delta rule in its recurrent form.
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/deltanet_recurrence.cuh"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kDeltaCols = 32;
constexpr int kDeltaThreads = 4 * kDeltaCols;

// out[t, c] = silu(sum_j w[c, j] * x[t - K + 1 + j, c]); inputs before the segment start come
// from conv_states[slot, c, :] (oldest first). Reads the states only: the update runs after.
__global__ void CausalConvKernel(const uint16_t* x, AnyPtr w, const float* conv_states,
                                 int64_t num_tokens, int64_t channels, int kernel_size,
                                 TokenMeta tokens, SegmentMeta segs, uint16_t* out) {
  const int64_t n = num_tokens * channels;
  const int hist = kernel_size - 1;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / channels, c = e % channels;
    const int seg = tokens.token_segment[t];
    const int begin = segs.token_begin[seg];
    const int i = static_cast<int>(t) - begin;
    const int slot = segs.state_slot[seg];
    const float* state = slot < 0 ? nullptr : conv_states + (slot * channels + c) * hist;
    float acc = 0.0f;
    for (int j = 0; j < kernel_size; ++j) {
      const int p = i - hist + j;  // position relative to the segment start
      const float xv = p >= 0             ? Bf16ToF32(x[(begin + p) * channels + c])
                       : state != nullptr ? state[hist + p]
                                          : 0.0f;
      acc += Load(w, c * kernel_size + j) * xv;
    }
    out[e] = F32ToBf16(Silu(acc));
  }
}

// conv_states[slot, c, :] = the last K-1 inputs of (old state ++ segment inputs).
__global__ void ConvStateUpdateKernel(const uint16_t* x, float* conv_states, int64_t channels,
                                      int kernel_size, SegmentMeta segs) {
  const int64_t n = segs.num_segments * channels;
  const int hist = kernel_size - 1;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int seg = static_cast<int>(e / channels);
    const int64_t c = e % channels;
    const int begin = segs.token_begin[seg], len = segs.num_tokens[seg];
    if (segs.state_slot[seg] < 0) continue;
    const float* state = conv_states + (segs.state_slot[seg] * channels + c) * hist;
    float* next = conv_states + (StateOutSlot(segs, seg) * channels + c) * hist;
    float old[kMaxConvKernel];
    for (int j = 0; j < hist; ++j) old[j] = state[j];
    for (int j = 0; j < hist; ++j) {
      const int p = len - hist + j;
      next[j] = p >= 0 ? Bf16ToF32(x[(begin + p) * channels + c]) : old[j + len];
    }
  }
}

// The conv for kernel size kK over eight channels per thread (channels % 8 == 0, x, out and w
// 16-byte aligned): grid (token chunks of kConvTokens, channel blocks). A thread loads its
// channels' kK x 8 weights once and slides a window of the last kK - 1 input rows down its chunk,
// so every input row is read once per thread rather than kK times (the window restarts from the
// state, or zeros, where a segment starts). With `update_state` every segment has exactly one
// token (a decode step): the thread that read a channel's state also writes its successor,
// which saves the separate update kernel; otherwise ConvStateUpdateVecKernel runs after.
constexpr int kConvTokens = 16;
constexpr int kConvVecThreads = 64;

// wk[j][c] = w[c0 + c, j] for the 8 channels from c0 (w [C, kK], 16-byte aligned): at kK = 4 two
// channels' taps per 16-byte load.
template <int kK>
__device__ __forceinline__ void LoadConvWeights(AnyPtr w, int64_t c0, float (&wk)[kK][8]) {
#pragma unroll
  for (int c = 0; c < 8; c += 2) {
    if constexpr (kK == 4) {
      float pair[8];  // w[c0 + c, 0..4) and w[c0 + c + 1, 0..4)
      Load8(w, (c0 + c) * kK, pair);
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        wk[j][c] = pair[j];
        wk[j][c + 1] = pair[kK + j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        wk[j][c] = Load(w, (c0 + c) * kK + j);
        wk[j][c + 1] = Load(w, (c0 + c + 1) * kK + j);
      }
    }
  }
}

template <int kK>
__global__ void __launch_bounds__(kConvVecThreads)
    CausalConvVecKernel(const uint16_t* x, AnyPtr w, float* conv_states, int64_t num_tokens,
                        int64_t channels, TokenMeta tokens, SegmentMeta segs, bool update_state,
                        uint16_t* out) {
  PdlWait();
  PdlTrigger();
  constexpr int kHist = kK - 1;
  // Every thread of the block walks the same tokens: their segment data comes from shared memory.
  __shared__ int tok_seg[kConvTokens], tok_begin[kConvTokens], tok_slot[kConvTokens],
      tok_out_slot[kConvTokens];
  const int64_t t_begin = static_cast<int64_t>(blockIdx.x) * kConvTokens;
  const int64_t t_end = t_begin + kConvTokens < num_tokens ? t_begin + kConvTokens : num_tokens;
  if (threadIdx.x < t_end - t_begin) {
    const int s = tokens.token_segment[t_begin + threadIdx.x];
    tok_seg[threadIdx.x] = s;
    tok_begin[threadIdx.x] = segs.token_begin[s];
    tok_slot[threadIdx.x] = segs.state_slot[s];
    tok_out_slot[threadIdx.x] = StateOutSlot(segs, s);
  }
  __syncthreads();
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (c0 >= channels) return;
  // This thread's 8 channels of the chunk's rows and of the kHist rows before it, all requested
  // at once into shared memory (row r at rows[r - r0]): loading one row ahead in registers kept a
  // single 16-byte load in flight per thread, and the loads ran latency-bound at ~1.5 TB/s. Each
  // thread reads back only its own column, so no barrier is needed.
  __shared__ uint4 rows[kConvTokens + kHist][kConvVecThreads];
  const int64_t r0 = t_begin - kHist;
  for (int64_t r = r0 < 0 ? 0 : r0; r < t_end; ++r) {
    CopyAsync16(&rows[r - r0][threadIdx.x], x + r * channels + c0, true);
  }
  CopyAsyncCommit();
  float wk[kK][8];  // wk[j][c] = w[c0 + c, j]
  LoadConvWeights<kK>(w, c0, wk);
  float win[kHist + 1][8];  // win[kHist] = row t; win[j] = row t - kHist + j
  int seg = -1;
  CopyAsyncWait<0>();
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int local = static_cast<int>(t - t_begin);
    const uint4 cur = rows[local + kHist][threadIdx.x];
    const int s = tok_seg[local], begin = tok_begin[local], slot = tok_slot[local];
    const int i = static_cast<int>(t) - begin;
    if (s != seg) {
      // A new segment (or the chunk's first token): rebuild the window's history from the
      // inputs before t in this segment and, before the segment, from the state.
      seg = s;
      const float* state = slot < 0 ? nullptr : conv_states + (slot * channels + c0) * kHist;
#pragma unroll
      for (int j = 0; j < kHist; ++j) {
        const int p = i - kHist + j;
        if (p >= 0) {
          UnpackBf16x8(rows[local + j][threadIdx.x], win[j]);  // row t - kHist + j = begin + p
        } else {
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            win[j][c] = state != nullptr ? state[c * kHist + kHist + p] : 0.0f;
          }
        }
      }
    }
    UnpackBf16x8(cur, win[kHist]);
    float acc[8] = {};
#pragma unroll
    for (int j = 0; j <= kHist; ++j) {
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] += wk[j][c] * win[j][c];
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = Silu(acc[c]);
    *reinterpret_cast<uint4*>(out + t * channels + c0) = PackBf16x8(acc);
    if (update_state && slot >= 0) {
      float* state = conv_states + (tok_out_slot[local] * channels + c0) * kHist;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
#pragma unroll
        for (int j = 0; j < kHist; ++j) state[c * kHist + j] = win[j + 1][c];
      }
    }
#pragma unroll
    for (int j = 0; j < kHist; ++j) {
#pragma unroll
      for (int c = 0; c < 8; ++c) win[j][c] = win[j + 1][c];
    }
  }
}

// The decode step of the conv (every segment one token, kernel size 4, states updated in place:
// the host sends segments with out slots to the kernel above): a block per segment and
// 8 x 32 channels, eight channels per thread. Everything but the token's input row is loaded
// before PdlWait: the weights are constants, the segment metadata is staged by a copy, and the
// conv state of a layer is written only by this layer's conv, which finished a step ago (PDL lets
// a grid start early only while its immediate predecessor runs). The state window of the token
// and the weights are then in registers when the input projection finishes; the chunk kernel
// above waits first and then walks metadata -> state -> input as dependent round trips.
constexpr int kConvDecodeThreads = 32;

__global__ void __launch_bounds__(kConvDecodeThreads)
    CausalConvDecodeKernel(const uint16_t* x, AnyPtr w, float* conv_states, int64_t channels,
                           SegmentMeta segs, uint16_t* out) {
  constexpr int kK = 4, kHist = kK - 1;
  const int seg = blockIdx.x;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (c0 >= channels) return;
  const int64_t t = segs.token_begin[seg];
  const int slot = segs.state_slot[seg];
  float wk[kK][8];  // wk[j][c] = w[c0 + c, j]
  LoadConvWeights<kK>(w, c0, wk);
  // state[c * kHist + j] for the 8 channels: 24 consecutive floats, 16-byte aligned (c0 % 8 == 0
  // and the base is).
  float hist[8 * kHist];
  float* state = slot < 0 ? nullptr : conv_states + (slot * channels + c0) * kHist;
  if (state != nullptr) {
#pragma unroll
    for (int q = 0; q < 8 * kHist / 4; ++q) {
      const float4 v = reinterpret_cast<const float4*>(state)[q];
      hist[4 * q] = v.x, hist[4 * q + 1] = v.y, hist[4 * q + 2] = v.z, hist[4 * q + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8 * kHist; ++i) hist[i] = 0.0f;
  }
  PdlWait();  // the input row comes from the in-projection
  PdlTrigger();
  float cur[8];
  UnpackBf16x8(*reinterpret_cast<const uint4*>(x + t * channels + c0), cur);
  float acc[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    float a = 0.0f;  // the chunk kernel's order: oldest input first
#pragma unroll
    for (int j = 0; j < kHist; ++j) a += wk[j][c] * hist[c * kHist + j];
    acc[c] = Silu(a + wk[kHist][c] * cur[c]);
  }
  *reinterpret_cast<uint4*>(out + t * channels + c0) = PackBf16x8(acc);
  if (state != nullptr) {
    float next[8 * kHist];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
#pragma unroll
      for (int j = 0; j < kHist; ++j) {
        next[c * kHist + j] = j + 1 < kHist ? hist[c * kHist + j + 1] : cur[c];
      }
    }
#pragma unroll
    for (int q = 0; q < 8 * kHist / 4; ++q) {
      reinterpret_cast<float4*>(state)[q] =
          make_float4(next[4 * q], next[4 * q + 1], next[4 * q + 2], next[4 * q + 3]);
    }
  }
}

// conv_states[slot, c, :] = the last K-1 inputs of (old state ++ segment inputs); grid
// (segments, channel blocks).
__global__ void ConvStateUpdateVecKernel(const uint16_t* x, float* conv_states, int64_t channels,
                                         int kernel_size, SegmentMeta segs) {
  const int seg = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= channels || segs.state_slot[seg] < 0) return;
  const int hist = kernel_size - 1;
  const int begin = segs.token_begin[seg], len = segs.num_tokens[seg];
  const float* state = conv_states + (segs.state_slot[seg] * channels + c) * hist;
  float* next = conv_states + (StateOutSlot(segs, seg) * channels + c) * hist;
  float old[kMaxConvKernel];
  for (int j = 0; j < hist; ++j) old[j] = state[j];
  for (int j = 0; j < hist; ++j) {
    const int p = len - hist + j;
    next[j] = p >= 0 ? Bf16ToF32(x[(begin + p) * channels + c]) : old[j + len];
  }
}

__global__ void DeltaRuleGatesKernel(const uint16_t* a, const uint16_t* b, AnyPtr a_log,
                                     AnyPtr dt_bias, int64_t n, int num_v_heads, float* g,
                                     float* beta) {
  PdlWait();
  PdlTrigger();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(i % num_v_heads);
    g[i] = DeltaGateG(Bf16ToF32(a[i]), Load(a_log, h), Load(dt_bias, h));
    beta[i] = DeltaGateBeta(Bf16ToF32(b[i]));
  }
}

// Columns of the state evolve independently (u_j, o_j and the update of column j read only
// column j, k, q and v_j), so one block handles kDeltaCols columns of one value head of one
// segment: grid (Hv, segments, Dv / kDeltaCols). Thread (j, s) = (tid / 4, tid % 4) owns rows
// i = s, s + 4, s + 8, ... of column j of the state S [Dk, Dv], kept in registers for the whole
// segment; the reductions over i are two shuffles inside each group of 4 lanes. Generic fallback
// for dims the warp kernel below does not take (Dv % 4 != 0 or Dk > 256).
template <int kRows, bool kOutSlots>
__global__ void __launch_bounds__(kDeltaThreads)
    GatedDeltaRuleKernel(const uint16_t* qkv, const float* g, const float* beta, int num_k_heads,
                         int num_v_heads, int dk, int dv, float* states, SegmentMeta segs,
                         int max_tokens, uint16_t* out) {
  extern __shared__ float smem[];
  float* q_s = smem;
  float* k_s = smem + dk;
  float* v_s = smem + 2 * dk;

  const int h = blockIdx.x, seg = blockIdx.y;
  const int slot = segs.state_slot[seg];
  const int begin = segs.token_begin[seg], len = segs.num_tokens[seg];
  if (len == 0 || len > max_tokens) return;
  const int kh = h / (num_v_heads / num_k_heads);
  const int64_t row_elems = 2LL * num_k_heads * dk + static_cast<int64_t>(num_v_heads) * dv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int j = blockIdx.z * kDeltaCols + (tid >> 2), s = tid & 3;
  const bool active = j < dv;

  // A segment without a state slot starts from zeros and keeps no final state.
  float* state =
      slot < 0 ? nullptr : states + (static_cast<int64_t>(slot) * num_v_heads + h) * dk * dv;
  float S[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = s + 4 * r;
    S[r] = (state != nullptr && active && i < dk) ? state[static_cast<int64_t>(i) * dv + j] : 0.0f;
  }
  const float q_scale = rsqrtf(static_cast<float>(dk));

  for (int step = 0; step < len; ++step) {
    const int64_t t = begin + step;
    const uint16_t* row = qkv + t * row_elems;
    // Warp 0 normalises q, warp 1 normalises k, the other warps (and all, for v) load v.
    if (warp < 2) {
      const uint16_t* src = row + (warp == 0 ? 0 : num_k_heads * dk) + kh * dk;
      float* dst = warp == 0 ? q_s : k_s;
      float sum = 0.0f;
      for (int d = lane; d < dk; d += 32) {
        const float v = Bf16ToF32(src[d]);
        dst[d] = v;
        sum += v * v;
      }
      sum = WarpSum(sum);
      const float inv = rsqrtf(sum + 1e-6f) * (warp == 0 ? q_scale : 1.0f);
      for (int d = lane; d < dk; d += 32) dst[d] *= inv;
    }
    if (tid < kDeltaCols && blockIdx.z * kDeltaCols + tid < dv) {
      v_s[tid] = Bf16ToF32(row[2 * num_k_heads * dk + h * dv + blockIdx.z * kDeltaCols + tid]);
    }
    __syncthreads();

    const float decay = expf(g[t * num_v_heads + h]);
    const float b = beta[t * num_v_heads + h];
    float u = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = s + 4 * r;
      if (i < dk) u += S[r] * k_s[i];
    }
    u += __shfl_xor_sync(0xffffffffu, u, 1);
    u += __shfl_xor_sync(0xffffffffu, u, 2);
    const float delta = active ? b * (v_s[tid >> 2] - decay * u) : 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = s + 4 * r;
      if (i < dk) {
        S[r] = decay * S[r] + k_s[i] * delta;
        o += S[r] * q_s[i];
      }
    }
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    o += __shfl_xor_sync(0xffffffffu, o, 2);
    if (active && s == 0) {
      out[t * num_v_heads * dv + static_cast<int64_t>(h) * dv + j] = F32ToBf16(o);
    }
    __syncthreads();  // q_s, k_s, v_s are rewritten by the next token
  }

  if (kOutSlots && state != nullptr) {
    state = states + (static_cast<int64_t>(StateOutSlot(segs, seg)) * num_v_heads + h) * dk * dv;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = s + 4 * r;
    if (state != nullptr && active && i < dk) state[static_cast<int64_t>(i) * dv + j] = S[r];
  }
}

// The recurrent form for Dv % 4 == 0 and Dk <= kMaxDk: every warp is independent and owns
// kCols (8 or 16) value columns of one value head of one segment (no block barriers at all).
// With kLpr = kCols / 4 lanes per state row, lane l holds rows r = l / kLpr + (32 / kLpr) p of
// columns c0 + 4 (l % kLpr) .. + 3 as float4, so each state row slice is kLpr 16-byte loads. Per
// token the two reductions over rows (S^T k and S^T q of the decayed old state) run together, since
//   o = S'^T q = decay S^T q + delta (k . q),  delta = beta (v - decay S^T k),
// and need log2(32 / kLpr) shuffle rounds; the next token's q, k, v, g, beta are loaded before
// the current token's arithmetic. With kRowSplit = 2 the two warps of a pair share their columns
// and each keeps half of the rows (twice the warps, half the state per lane, for few sequences):
// their partial S^T k and S^T q meet in shared memory, one block barrier per token.
// Grid (Hv, segments, ceil(Dv / (kCols * kWarpsPerBlock / kRowSplit))).
constexpr int kWarpsPerBlock = 4;

//
// With kGates the kernel computes g and beta from the raw a and b itself (DeltaGateG/Beta) and
// stores them to g and beta for the step's keepers (one block per head does), instead of reading
// what a gates kernel wrote.
//
// The segment metadata and the state are read before PdlWait: the metadata is staged by a copy,
// not by a kernel, and no kernel that may still run when this one starts writes the states (PDL
// lets this grid start early only while its immediate predecessor runs, and the predecessor
// itself waited for everything before it; the predecessor of a delta rule is the conv or the gates
// kernel). So the state's trip from memory overlaps the conv's tail.
template <int kMaxDk, int kCols, int kRowSplit, bool kGates>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    GatedDeltaRuleWarpKernel(const uint16_t* __restrict__ qkv, float* g, float* beta,
                             DeltaGateInputs gates, int num_k_heads, int num_v_heads, int dk,
                             int dv, float* states, SegmentMeta segs, int max_tokens,
                             uint16_t* __restrict__ out) {
  constexpr int kLpr = kCols / 4;
  constexpr int kRowsPerPass = 32 / kLpr;
  constexpr int kPasses = kMaxDk / kRowsPerPass / kRowSplit;  // this warp's share
  static_assert(kRowSplit == 1 || kRowSplit == 2);
  __shared__ float qk_s[kWarpsPerBlock][2][kMaxDk];
  __shared__ float4 part_s[2][kWarpsPerBlock][kLpr][2];  // [token parity][warp][slot] (u, sq)
  const int h = blockIdx.x, seg = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c0 = (blockIdx.z * (kWarpsPerBlock / kRowSplit) + warp / kRowSplit) * kCols;
  const int row_base = (warp % kRowSplit) * kPasses;  // first pass of this warp's rows
  // A split pair meets at block barriers: its warps stay to the end even without columns.
  if (kRowSplit == 1 && c0 >= dv) return;
  // The three loads are independent: issue them together, before the early return.
  const int len = segs.num_tokens[seg];
  const int begin = segs.token_begin[seg], slot = segs.state_slot[seg];
  // Every step stores to the out slot (the slot read where a step has none): an in-place
  // instantiation for decode steps measured 0.3-1% slower than this one at batches 16-127
  // (performance.md, session 48).
  const int out_slot = StateOutSlot(segs, seg);
  if (len == 0 || len > max_tokens) return;
  float a_log = 0.f, dt_bias = 0.f;
  if constexpr (kGates) {
    a_log = Load(gates.a_log, h);
    dt_bias = Load(gates.dt_bias, h);
  }
  const int kh = h / (num_v_heads / num_k_heads);
  const int64_t row_elems = 2LL * num_k_heads * dk + static_cast<int64_t>(num_v_heads) * dv;
  const int col = c0 + 4 * (lane % kLpr);  // first of this lane's 4 columns
  const bool col_ok = col < dv;            // dv % 4 == 0: all 4 or none
  const int r0 = lane / kLpr + kRowsPerPass * row_base;

  float* state =
      slot < 0 ? nullptr : states + (static_cast<int64_t>(slot) * num_v_heads + h) * dk * dv;
  float4 S[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = r0 + kRowsPerPass * p;
    S[p] = (state != nullptr && col_ok && r < dk)
               ? *reinterpret_cast<const float4*>(state + static_cast<int64_t>(r) * dv + col)
               : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  PdlWait();  // q, k, v (and the gates' inputs) come from the kernels before this one
  PdlTrigger();
  const float q_scale = rsqrtf(static_cast<float>(dk));
  float* q_s = qk_s[warp][0];
  float* k_s = qk_s[warp][1];

  // Lane l loads q and k elements l, l + 32, ... (kPasses / 2 of each) and 4 values of v.
  constexpr int kPer = (kMaxDk + 31) / 32;
  float qn[kPer], kn[kPer];
  float4 vn = make_float4(0.f, 0.f, 0.f, 0.f);
  float gn = 0.f, bn = 0.f;
  auto load = [&](int64_t t) {
    const uint16_t* row = qkv + t * row_elems;
    const uint16_t* qsrc = row + kh * dk;
    const uint16_t* ksrc = row + num_k_heads * dk + kh * dk;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int d = lane + 32 * e;
      qn[e] = d < dk ? Bf16ToF32(qsrc[d]) : 0.f;
      kn[e] = d < dk ? Bf16ToF32(ksrc[d]) : 0.f;
    }
    if (col_ok) {
      const uint2 raw =
          *reinterpret_cast<const uint2*>(row + 2LL * num_k_heads * dk + int64_t{h} * dv + col);
      vn = make_float4(__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                       __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u));
    }
    if constexpr (kGates) {
      gn = DeltaGateG(Bf16ToF32(gates.a[t * num_v_heads + h]), a_log, dt_bias);
      bn = DeltaGateBeta(Bf16ToF32(gates.b[t * num_v_heads + h]));
      if (blockIdx.z == 0 && threadIdx.x == 0) {
        g[t * num_v_heads + h] = gn;
        beta[t * num_v_heads + h] = bn;
      }
    } else {
      gn = g[t * num_v_heads + h];
      bn = beta[t * num_v_heads + h];
    }
  };
  load(begin);

  for (int step = 0; step < len; ++step) {
    const int64_t t = begin + step;
    float qinv, kinv, kq;
    DeltaRuleQkNorms<kPer>(qn, kn, q_scale, qinv, kinv, kq);
    __syncwarp();  // the previous token's reads of q_s / k_s are done
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int d = lane + 32 * e;
      if (d < kMaxDk) {
        q_s[d] = qn[e] * qinv;
        k_s[d] = kn[e] * kinv;
      }
    }
    const float4 v = vn;
    const float decay = __expf(gn), b = bn;
    __syncwarp();
    if (step + 1 < len) load(t + 1);

    float4 u, sq;  // k_s and q_s are zero beyond dk
    DeltaRuleProducts<kPasses, kLpr>(S, k_s, q_s, r0, u, sq);
    if constexpr (kRowSplit == 2) DeltaRuleAddPartner<kLpr>(part_s[step & 1], warp, lane, u, sq);
    const float4 delta = DeltaRuleDelta(v, u, decay, b);
    if (lane < kLpr && col_ok && (kRowSplit == 1 || warp % 2 == 0)) {
      const float4 o = DeltaRuleOutput(sq, delta, decay, kq);
      uint2 packed;
      packed.x = PackBf16x2(o.x, o.y);
      packed.y = PackBf16x2(o.z, o.w);
      *reinterpret_cast<uint2*>(out + t * num_v_heads * dv + int64_t{h} * dv + col) = packed;
    }
    DeltaRuleUpdate<kPasses, kLpr>(S, k_s, r0, decay, delta);
  }

  if (state != nullptr && col_ok) {
    state += static_cast<int64_t>(out_slot - slot) * num_v_heads * dk * dv;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = r0 + kRowsPerPass * p;
      if (r < dk) *reinterpret_cast<float4*>(state + static_cast<int64_t>(r) * dv + col) = S[p];
    }
  }
}

template <int kRows>
void LaunchDeltaRule(dim3 grid, int threads, size_t smem, cudaStream_t stream, const uint16_t* qkv,
                     const float* g, const float* beta, int hk, int hv, int dk, int dv,
                     float* states, const SegmentMeta& segs, int max_tokens, bool out_slots,
                     uint16_t* out) {
  if (out_slots) {
    GatedDeltaRuleKernel<kRows, true><<<grid, threads, smem, stream>>>(
        qkv, g, beta, hk, hv, dk, dv, states, segs, max_tokens, out);
  } else {
    GatedDeltaRuleKernel<kRows, false><<<grid, threads, smem, stream>>>(
        qkv, g, beta, hk, hv, dk, dv, states, segs, max_tokens, out);
  }
}

template <int kMaxDk, int kCols, int kRowSplit>
void LaunchDeltaRuleWarp(const uint16_t* qkv, float* g, float* beta, const DeltaGateInputs* gates,
                         int hk, int hv, int dk, int dv, float* states, const SegmentMeta& segs,
                         int max_tokens, uint16_t* out, cudaStream_t stream) {
  const int cols_per_block = kCols * kWarpsPerBlock / kRowSplit;
  const dim3 grid(hv, segs.num_segments, (dv + cols_per_block - 1) / cols_per_block);
  if (gates != nullptr) {
    LaunchPdl("GatedDeltaRuleWarpKernel (gates)",
              GatedDeltaRuleWarpKernel<kMaxDk, kCols, kRowSplit, true>, grid, 32 * kWarpsPerBlock,
              0, stream, qkv, g, beta, *gates, hk, hv, dk, dv, states, segs, max_tokens, out);
  } else {
    LaunchPdl("GatedDeltaRuleWarpKernel", GatedDeltaRuleWarpKernel<kMaxDk, kCols, kRowSplit, false>,
              grid, 32 * kWarpsPerBlock, 0, stream, qkv, g, beta, DeltaGateInputs{}, hk, hv, dk, dv,
              states, segs, max_tokens, out);
  }
}

}  // namespace

namespace {
// MOBIUS_CONV_DECODE=0 runs decode steps through the chunk kernel (A/B runs; read once).
bool ConvDecodeKernelOff() {
  static const bool off = KnobChoice("MOBIUS_CONV_DECODE", {"0", "1"}) == 1;
  return off;
}
}  // namespace

void LaunchCausalConv1dSilu(const uint16_t* x, AnyPtr w, float* conv_states, int64_t num_tokens,
                            int64_t channels, int kernel_size, const TokenMeta& tokens,
                            const SegmentMeta& segments, bool single_token_segments, uint16_t* out,
                            cudaStream_t stream) {
  if (num_tokens == 0 || channels == 0) return;
  if (kernel_size < 1 || kernel_size > kMaxConvKernel) {
    std::fprintf(stderr, "mobius cuda: conv kernel size %d outside [1, %d]\n", kernel_size,
                 kMaxConvKernel);
    std::abort();
  }
  if (kernel_size == 4 && channels % 8 == 0 && IsAligned16(x) && IsAligned16(out) &&
      IsAligned16(w.data)) {
    // (as many tokens as segments also holds with empty segments beside longer ones: the chunk
    // kernel below handles those, its update_state walking each segment's tokens in order)
    const bool decode = num_tokens == segments.num_segments;
    if (decode && single_token_segments && IsAligned16(conv_states) && !ConvDecodeKernelOff()) {
      const dim3 grid(
          static_cast<unsigned>(segments.num_segments),
          static_cast<unsigned>((channels / 8 + kConvDecodeThreads - 1) / kConvDecodeThreads));
      LaunchPdl("CausalConvDecodeKernel", CausalConvDecodeKernel, grid, kConvDecodeThreads, 0,
                stream, x, w, conv_states, channels, segments, out);
      CheckLaunch("CausalConv1dSilu (decode)");
      return;
    }
    const dim3 grid(static_cast<unsigned>((num_tokens + kConvTokens - 1) / kConvTokens),
                    static_cast<unsigned>((channels / 8 + kConvVecThreads - 1) / kConvVecThreads));
    LaunchPdl("CausalConvVecKernel", CausalConvVecKernel<4>, grid, kConvVecThreads, 0, stream, x, w,
              conv_states, num_tokens, channels, tokens, segments, decode, out);
    CheckLaunch("CausalConv1dSilu");
    if (!decode) {
      const dim3 update_grid(static_cast<unsigned>(segments.num_segments),
                             static_cast<unsigned>((channels + kThreads - 1) / kThreads));
      ConvStateUpdateVecKernel<<<update_grid, kThreads, 0, stream>>>(x, conv_states, channels,
                                                                     kernel_size, segments);
      CheckLaunch("ConvStateUpdate");
    }
    return;
  }
  CausalConvKernel<<<GridFor(num_tokens * channels, kThreads), kThreads, 0, stream>>>(
      x, w, conv_states, num_tokens, channels, kernel_size, tokens, segments, out);
  CheckLaunch("CausalConv1dSilu");
  if (kernel_size > 1) {
    ConvStateUpdateKernel<<<GridFor(segments.num_segments * channels, kThreads), kThreads, 0,
                            stream>>>(x, conv_states, channels, kernel_size, segments);
    CheckLaunch("ConvStateUpdate");
  }
}

void LaunchDeltaRuleGates(const uint16_t* a, const uint16_t* b, AnyPtr a_log, AnyPtr dt_bias,
                          int64_t num_tokens, int num_v_heads, float* g, float* beta,
                          cudaStream_t stream) {
  const int64_t n = num_tokens * num_v_heads;
  if (n == 0) return;
  LaunchPdl("DeltaRuleGatesKernel", DeltaRuleGatesKernel, GridFor(n, kThreads), kThreads, 0, stream,
            a, b, a_log, dt_bias, n, num_v_heads, g, beta);
  CheckLaunch("DeltaRuleGates");
}

DeltaRuleLayout SelectDeltaRuleLayout(int num_segments) {
  // MOBIUS_DELTA_RULE_GENERIC=1 forces the generic block kernel (for before/after timings).
  static const bool force_generic = KnobChoice("MOBIUS_DELTA_RULE_GENERIC", {"0", "1"}) == 2;
  if (force_generic) return {0, 1};
  // Value columns per warp: 8 keeps more warps busy for a few sequences, 16 (64-byte state row
  // pieces) moves the state faster once there are several (measured on the H200, see
  // docs/cuda-backend.md). MOBIUS_DELTA_RULE_COLS=8|16 forces one (timing).
  static const int forced_cols = KnobChoice("MOBIUS_DELTA_RULE_COLS", {"8", "16"}) * 8;
  const int cols = forced_cols == 8 || forced_cols == 16 ? forced_cols : num_segments >= 4 ? 16 : 8;
  // Rows split over warp pairs: MOBIUS_DELTA_RULE_SPLIT=1|2 forces off/on (timing); default on
  // below kRowSplitMaxSegments sequences.
  static const int forced_split = KnobChoice("MOBIUS_DELTA_RULE_SPLIT", {"1", "2"});
  constexpr int kRowSplitMaxSegments = 16;
  const bool split =
      forced_split == 2 || (forced_split != 1 && num_segments < kRowSplitMaxSegments);
  return {cols, split ? 2 : 1};
}

void LaunchGatedDeltaRuleRecurrent(const uint16_t* qkv, float* g, float* beta,
                                   const DeltaGateInputs* gates, int64_t num_tokens,
                                   int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                                   float* states, const SegmentMeta& segments, int max_tokens,
                                   bool out_slots, uint16_t* out, cudaStream_t stream) {
  if (segments.num_segments == 0 || num_v_heads == 0) return;
  if (k_head_dim > kMaxDeltaRuleKeyHeadDim || k_head_dim < 1 || v_head_dim < 1) {
    std::fprintf(stderr, "mobius cuda: delta rule key head dim %d outside [1, %d]\n", k_head_dim,
                 kMaxDeltaRuleKeyHeadDim);
    std::abort();
  }
  const int hk = num_k_heads, hv = num_v_heads, dk = k_head_dim, dv = v_head_dim;
  const bool aligned = reinterpret_cast<uintptr_t>(qkv) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(states) % 16 == 0 && (hk * dk) % 2 == 0;
  const DeltaRuleLayout layout = SelectDeltaRuleLayout(segments.num_segments);
  const int warp_cols = layout.cols;
  const bool row_split = layout.row_split == 2;
  if (dv % 4 == 0 && aligned && warp_cols != 0) {
    auto launch = [&](auto max_dk) {
      constexpr int kMaxDk = decltype(max_dk)::value;
      if (row_split && warp_cols == 16) {
        LaunchDeltaRuleWarp<kMaxDk, 16, 2>(qkv, g, beta, gates, hk, hv, dk, dv, states, segments,
                                           max_tokens, out, stream);
      } else if (row_split) {
        LaunchDeltaRuleWarp<kMaxDk, 8, 2>(qkv, g, beta, gates, hk, hv, dk, dv, states, segments,
                                          max_tokens, out, stream);
      } else if (warp_cols == 16) {
        LaunchDeltaRuleWarp<kMaxDk, 16, 1>(qkv, g, beta, gates, hk, hv, dk, dv, states, segments,
                                           max_tokens, out, stream);
      } else {
        LaunchDeltaRuleWarp<kMaxDk, 8, 1>(qkv, g, beta, gates, hk, hv, dk, dv, states, segments,
                                          max_tokens, out, stream);
      }
    };
    if (dk <= 32) {
      launch(std::integral_constant<int, 32>());
    } else if (dk <= 64) {
      launch(std::integral_constant<int, 64>());
    } else if (dk <= 128) {
      launch(std::integral_constant<int, 128>());
    } else {
      launch(std::integral_constant<int, 256>());
    }
    CheckLaunch("GatedDeltaRule (warp)");
    return;
  }
  // The generic kernel reads its gates: compute them first.
  if (gates != nullptr) {
    LaunchDeltaRuleGates(gates->a, gates->b, gates->a_log, gates->dt_bias, num_tokens, hv, g, beta,
                         stream);
  }
  const int threads = kDeltaThreads;
  const size_t smem = sizeof(float) * (2 * dk + kDeltaCols);
  const dim3 grid(hv, segments.num_segments, (dv + kDeltaCols - 1) / kDeltaCols);
  const int rows = (dk + 3) / 4;
  if (rows <= 16) {
    LaunchDeltaRule<16>(grid, threads, smem, stream, qkv, g, beta, hk, hv, dk, dv, states, segments,
                        max_tokens, out_slots, out);
  } else if (rows <= 32) {
    LaunchDeltaRule<32>(grid, threads, smem, stream, qkv, g, beta, hk, hv, dk, dv, states, segments,
                        max_tokens, out_slots, out);
  } else {
    LaunchDeltaRule<64>(grid, threads, smem, stream, qkv, g, beta, hk, hv, dk, dv, states, segments,
                        max_tokens, out_slots, out);
  }
  CheckLaunch("GatedDeltaRule");
}

}  // namespace mobius::kernels::cuda
