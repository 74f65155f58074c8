// The gated DeltaNet mixer of a decode step or a speculative verify step (1 to
// kMaxDeltaNetStepTokens tokens per segment) in one launch: conv + SiLU, gates, recurrent delta
// rule and gated RMSNorm, which otherwise take three or four kernels (the conv and, past one
// token, its state update; the delta rule with its gates; the norm) between the in- and
// out-projections. The tokens of a segment are walked in order inside the cluster, with two
// cluster barriers per step whatever their number; only the state's products and update are
// serial per token (the conv inputs and gates are read at once, the q/k norms and the gated
// norm's outputs run token-parallel, a warp pair meets at its own barrier). With kLocalQk the
// first cluster barrier is split: its arrival is made at the start and waited for before the
// piece sums (by then every block has arrived).
//
// Why clusters: each of those kernels needs data from outside a block's own slice. A value
// column block of the delta rule needs its key head's whole q and k after the conv; the norm
// needs the sum of squares over a value head's columns, spread over several blocks; and the q/k
// conv state of a key head is read by every block that uses it, so none may overwrite it before
// the others have read it. Earlier fusions solved this with a fence and a counter in global
// memory and lost to the separate kernels (docs/cuda-backend.md, next steps 1). Here the blocks
// that share these values form one thread-block cluster (eight blocks: one key head, its two
// value heads, one segment) and exchange them through distributed shared memory at a cluster
// barrier, which stays on the GPC. Each block owns D/8 of the key head's q and k channels and
// D/4 value columns: it runs the conv for exactly those channels (so it alone reads and writes
// their conv state) and the delta rule for its columns. Where a block has a thread for each of
// the key head's 2D q/k channels (kLocalQk) it runs the conv for all of them instead, reading
// every q/k conv state of the key head and writing its own share after the norm's barrier (which
// every block passes after its conv), and needs no barrier to publish q and k. The norm's piece
// sums are written into every block of the value head (not read from them), so that no block
// reads another's shared memory after that barrier and none has to wait at the end for the
// others.
//
// Roundings follow the separate kernels: the conv output and the delta rule's output are rounded
// to bf16 as their tensors store them, the gates use DeltaGateG/Beta, and the delta rule's
// arithmetic is the warp kernel's (deltanet_recurrence.cuh) in the layout that kernel picks for
// the step's sequence count: 8 or 16 columns per warp, rows split over a warp pair or not.
#include <cooperative_groups.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/deltanet_recurrence.cuh"
#include "kernels/cuda/launch.h"

namespace mobius::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kClusterBlocks = 8;  // blocks per key head and segment
constexpr int kHeadRatio = 2;      // value heads per key head (Hv = 2 Hk)
constexpr int kConvTaps = 4;
// kGroupCols value columns per group of kRowSplit warps (which split the state rows).
template <int kD, int kGroupCols, int kRowSplit>
struct StepShape {
  static constexpr int kColsPerBlock = kHeadRatio * kD / kClusterBlocks;
  static constexpr int kBlocksPerHead = kClusterBlocks / kHeadRatio;
  static constexpr int kQkPerBlock = kD / kClusterBlocks;  // q (and k) channels owned
  static constexpr int kGroups = kColsPerBlock / kGroupCols;
  static constexpr int kWarps = kRowSplit * kGroups;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLpr = kGroupCols / 4;     // lanes per state row (4 columns each)
  static constexpr int kRowsPerPass = 32 / kLpr;  // state rows a warp covers per pass
  static constexpr int kPasses = kD / kRowsPerPass / kRowSplit;  // this warp's share
  static constexpr int kConvChannels = 2 * kQkPerBlock + kColsPerBlock;
  static constexpr int kPerLane = kD / 32;  // q / k elements per lane
  static_assert(kRowSplit == 1 || kRowSplit == 2);
  static_assert(kGroups >= 1 && kPasses >= 1 && kPerLane >= 1 && kConvChannels <= kThreads);
};

// One conv channel of a thread: its taps and window (loaded before PdlWait), where its outputs go.
struct StepConvChannel {
  int64_t c = -1;        // channel in the mixed row; -1: none
  float* dst = nullptr;  // token 0's output; token i's is dst + i * stride
  int stride = 0;
  float* state = nullptr;
  float wk[kConvTaps] = {};
  float hist[kConvTaps - 1] = {};

  __device__ __forceinline__ void Load(const DeltaNetDecodeStepArgs& p, int slot,
                                       int64_t channels) {
    if (c < 0) return;
    state = slot >= 0 ? p.conv_states + (slot * channels + c) * (kConvTaps - 1) : nullptr;
#pragma unroll
    for (int j = 0; j < kConvTaps; ++j)
      wk[j] = mobius::kernels::cuda::Load(p.conv_w, c * kConvTaps + j);
    if (state != nullptr) {
#pragma unroll
      for (int j = 0; j < kConvTaps - 1; ++j) hist[j] = state[j];
    }
  }
  // The conv kernels' order: oldest input first; the window slides over the segment's tokens and
  // ends as the new state (the last K - 1 inputs). Every token's input is requested before the
  // first output is stored: the compiler cannot tell the shared-memory stores from `mixed`, and
  // would otherwise wait one L2 round trip per token of a verify step.
  template <int kT>
  __device__ __forceinline__ void Run(const uint16_t* mixed, int64_t begin, int len,
                                      int64_t channels) {
    if (c < 0) return;
    float in[kT];
#pragma unroll
    for (int i = 0; i < kT; ++i) {
      if (i < len) in[i] = Bf16ToF32(mixed[(begin + i) * channels + c]);
    }
#pragma unroll
    for (int i = 0; i < kT; ++i) {
      if (i >= len) break;
      const float cur = in[i];
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < kConvTaps - 1; ++j) acc += wk[j] * hist[j];
      dst[i * stride] = Bf16ToF32(F32ToBf16(Silu(acc + wk[kConvTaps - 1] * cur)));
#pragma unroll
      for (int j = 0; j + 1 < kConvTaps - 1; ++j) hist[j] = hist[j + 1];
      hist[kConvTaps - 2] = cur;
    }
  }
  __device__ __forceinline__ void StoreState() const {
    if (c < 0 || state == nullptr) return;
#pragma unroll
    for (int j = 0; j < kConvTaps - 1; ++j) state[j] = hist[j];
  }
  // The window goes to slot `out_slot` instead of the one it came from.
  __device__ __forceinline__ void MoveState(const DeltaNetDecodeStepArgs& p, int slot, int out_slot,
                                            int64_t channels) {
    if (c >= 0 && state != nullptr) state += (out_slot - slot) * channels * (kConvTaps - 1);
  }
};

// The body of the step and replay kernels. kT: the most tokens of a segment (1 for decode
// steps, whose loops then unroll away). kReplay (Backend::ReplayDeltaRuleStates): the conv and
// delta rule only, over kept rows, with the gates the step kept (p.g, p.beta read, not written)
// and no norm or output; every load follows PdlWait (the states may have been written by the
// launch before: the verify step, or a snapshot copy).
template <int kD, int kGroupCols, int kRowSplit, int kT, bool kReplay>
__device__ __forceinline__ void DeltaNetStepBody(const DeltaNetDecodeStepArgs& p,
                                                 const SegmentMeta& segs) {
  using Shape = StepShape<kD, kGroupCols, kRowSplit>;
  constexpr int kQk = Shape::kQkPerBlock, kCols = Shape::kColsPerBlock;
  constexpr int kPasses = Shape::kPasses, kLpr = Shape::kLpr, kRowsPerPass = Shape::kRowsPerPass;
  constexpr int kPiecesPerBlock = kCols / 8;
  // With a thread for each of the key head's q and k channels, every block runs the conv for all
  // of them (eight times the conv's few loads, all from L2) instead of its D/8 share: q and k are
  // then in its own shared memory, and the cluster barrier that published them, with the wait
  // for the cluster's slowest block, is gone. kLocalQk: the layout of 8 columns a warp group and
  // rows split over warp pairs (batches 1-3 by default; 256 threads at D = 128, 128 at 64, 64 at
  // 32). With the piece sums below: batch 1 2.41 -> 2.39 ms a step (performance.md, 28th version).
  constexpr bool kLocalQk = Shape::kThreads >= 2 * kD;
  // Past one token warp pairs meet at named barriers 1 .. kWarps / 2 (DeltaRuleAddPartner); the
  // kernel uses no other named barrier (0 is __syncthreads; the cluster's are separate).
  static_assert(kRowSplit == 1 || (Shape::kWarps % 2 == 0 && Shape::kWarps <= 30));
  // Per token: q channels, then k channels (the key head's, or this block's share).
  __shared__ float conv_s[kT][kLocalQk ? 2 * kD : 2 * kQk];
  __shared__ float v_s[kT][kCols];  // per token: the conv output of this block's columns
  // One token (kT = 1): each warp's scratch for the normalised q and k. Several: every token's,
  // normalised by the warps in parallel before the walk, so that the walk's serial chain holds
  // only the state's products and update (and kq_s, each token's k . q).
  __shared__ float qk_s[kT == 1 ? Shape::kWarps : kT][2][kD];
  __shared__ float kq_s[kT];
  __shared__ float4 part_s[2][Shape::kWarps][kLpr][2];  // [token parity][warp][lane] (u, sq)
  // The delta rule's output (bf16-rounded) of this block's columns, per token.
  __shared__ float o_s[kT][kCols];
  // Per token, the sums of squares of the value head's pieces of 8 columns: every block of the
  // head writes its own pieces into the copies of all of them.
  __shared__ float piece_s[kT][kD / 8];
  __shared__ float gate_s[kT][2];

  cg::cluster_group cluster = cg::this_cluster();
  // Without the q/k barrier, this arrival (waited for before the first access to another block's
  // shared memory) is what guarantees every block of the cluster has started.
  [[maybe_unused]] auto started =
      kLocalQk && !kReplay ? cluster.barrier_arrive() : decltype(cluster.barrier_arrive()){};
  const int rank = static_cast<int>(cluster.block_rank());
  const int kh = static_cast<int>(blockIdx.x) / kClusterBlocks, seg = blockIdx.y;
  const int hk = p.num_k_heads, hv = p.num_v_heads;
  const int h = kh * kHeadRatio + rank / Shape::kBlocksPerHead;
  const int block_col0 = (rank % Shape::kBlocksPerHead) * kCols;
  const int64_t channels = 2LL * hk * kD + static_cast<int64_t>(hv) * kD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = warp / kRowSplit;
  // The segment metadata is staged by a copy, not by a kernel: readable before PdlWait. The host
  // guarantees 1 <= len <= kT (clamped all the same: the shared arrays are indexed by token);
  // every thread of the cluster walks the same tokens.
  const int64_t begin = segs.token_begin[seg];
  const int len = kT == 1 ? 1 : min(segs.num_tokens[seg], kT);
  const int slot = segs.state_slot[seg];
  // Verify steps (kT > 1) store the states to each segment's out slot (a speculating sequence's
  // spare slot). Decode steps update them in place and do not read it (the host runs a one-token
  // step with out slots in the kT > 1 kernel): session 46's first form read it in the one-token
  // kernel too, whose float4 state stores then compiled to scalar ones (see the stores below),
  // and batch-1 decode was 8% slower on an H100.
  constexpr bool kOutSlots = kT > 1 && !kReplay;
  const int out_slot = kOutSlots ? StateOutSlot(segs, seg) : slot;

  // This thread's conv channels: ch, a q/k channel (or, outside kLocalQk, a value column: one
  // channel a thread there), and with kLocalQk v_ch, one of the block's value columns. A block
  // writes the conv state of its own q/k share (D/8 channels) and value columns only.
  StepConvChannel ch, v_ch;
  bool qk_state_owner = true;
  if constexpr (kLocalQk) {
    const int t = threadIdx.x;
    if (t < 2 * kD) {
      const int is_k = t / kD, d = t % kD;
      ch.c = int64_t{is_k} * hk * kD + int64_t{kh} * kD + d;
      ch.dst = &conv_s[0][t];
      ch.stride = 2 * kD;
      qk_state_owner = d / kQk == rank;
    }
    if (t < kCols) {
      v_ch.c = 2LL * hk * kD + int64_t{h} * kD + block_col0 + t;
      v_ch.dst = &v_s[0][t];
      v_ch.stride = kCols;
    }
  } else if (threadIdx.x < 2 * kQk) {
    const int i = threadIdx.x % kQk, is_k = threadIdx.x / kQk;
    ch.c = int64_t{is_k} * hk * kD + int64_t{kh} * kD + rank * kQk + i;
    ch.dst = &conv_s[0][threadIdx.x];
    ch.stride = 2 * kQk;
  } else if (threadIdx.x < Shape::kConvChannels) {
    const int i = threadIdx.x - 2 * kQk;
    ch.c = 2LL * hk * kD + int64_t{h} * kD + block_col0 + i;
    ch.dst = &v_s[0][i];
    ch.stride = kCols;
  }
  // Everything that no kernel of this step writes is loaded before PdlWait: the conv weights and
  // the states (written only by this layer's mixer, a step ago), the gate and norm parameters.
  ch.Load(p, slot, channels);
  if constexpr (kLocalQk) v_ch.Load(p, slot, channels);
  if constexpr (kOutSlots) {
    ch.MoveState(p, slot, out_slot, channels);
    if constexpr (kLocalQk) v_ch.MoveState(p, slot, out_slot, channels);
  }
  // The gates of token i are thread kThreads - 1 - i's (one thread a token: a verify step's
  // tokens do not wait for each other's exps and loads).
  const int gate_token = Shape::kThreads - 1 - static_cast<int>(threadIdx.x);
  const bool gate_thread = gate_token < kT;
  static_assert(Shape::kThreads >= kT);
  float a_log = 0.f, dt_bias = 0.f;
  if (gate_thread && !kReplay) {
    a_log = Load(p.a_log, h);
    dt_bias = Load(p.dt_bias, h);
  }
  const int col = block_col0 + group * kGroupCols + 4 * (lane % kLpr);  // in head h
  const int local_col = group * kGroupCols + 4 * (lane % kLpr);
  const int r0 = lane / kLpr + kRowsPerPass * ((warp % kRowSplit) * kPasses);
  float* state = slot < 0 ? nullptr : p.states + (static_cast<int64_t>(slot) * hv + h) * kD * kD;
  float4 S[kPasses];
#pragma unroll
  for (int pp = 0; pp < kPasses; ++pp) {
    const int r = r0 + kRowsPerPass * pp;
    S[pp] = state != nullptr ? *reinterpret_cast<const float4*>(state + r * kD + col)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // The lanes that hold the delta rule's output columns (the group's first warp, one lane per 4
  // columns).
  const bool owner = warp % kRowSplit == 0 && lane < kLpr;
  // The gated norm's outputs. Past one token, thread n takes token n / kQuads, the block's
  // columns 4 (n % kQuads) to 4 (n % kQuads) + 3, so that a verify step's tokens are normalised
  // side by side; a decode step's single token stays with the owners, so that the one-token
  // kernel is the one measured before the verify form (performance.md, session 34).
  constexpr int kQuads = kCols / 4;
  static_assert(kT * kQuads <= Shape::kThreads);
  const int out_token = kT == 1 ? 0 : static_cast<int>(threadIdx.x) / kQuads;
  // In the block's columns.
  const int out_col = kT == 1 ? local_col : 4 * (static_cast<int>(threadIdx.x) % kQuads);
  const bool out_thread = !kReplay && (kT == 1 ? owner : out_token < kT);
  float nw[4] = {};
  if (out_thread) {
#pragma unroll
    for (int i = 0; i < 4; ++i) nw[i] = Load(p.norm_w, block_col0 + out_col + i);
  }

  PdlWait();  // mixed, z, a and b come from the in-projection
  PdlTrigger();
  // The gate z of the thread's output, read now so that the load overlaps the conv and the delta
  // rule instead of following the norm's cluster barrier.
  // (The row offset is formed again at the store: kept live, it cost the one-token kernel a spill.)
  auto out_row = [&] {
    return (begin + out_token) * hv * kD + static_cast<int64_t>(h) * kD + block_col0 + out_col;
  };
  uint2 zr = {};
  if (out_thread && out_token < len) zr = *reinterpret_cast<const uint2*>(p.z + out_row());

  ch.Run<kT>(p.mixed, begin, len, channels);
  if constexpr (kLocalQk) {
    v_ch.Run<kT>(p.mixed, begin, len, channels);
    v_ch.StoreState();
    // The other blocks of the cluster read this block's q/k conv state too: it is written after
    // the piece-sum barrier, which each of them passes after its conv.
  } else {
    ch.StoreState();
  }
  if (gate_thread && gate_token < len) {
    const int i = gate_token;
    const int64_t gi = (begin + i) * hv + h;
    if constexpr (kReplay) {
      gate_s[i][0] = p.g[gi];
      gate_s[i][1] = p.beta[gi];
    } else {
      const float gn = DeltaGateG(Bf16ToF32(p.a[gi]), a_log, dt_bias);
      const float bn = DeltaGateBeta(Bf16ToF32(p.b[gi]));
      gate_s[i][0] = gn;
      gate_s[i][1] = bn;
      if (rank % Shape::kBlocksPerHead == 0) {  // one block per value head keeps them
        p.g[gi] = gn;
        p.beta[gi] = bn;
      }
    }
  }
  if constexpr (kLocalQk) {
    __syncthreads();  // the block's q, k and v conv outputs of every token are in conv_s / v_s
  } else {
    cluster.sync();  // every block's q, k and v conv outputs of every token are published
  }

  // Dk^-0.5 from the runtime head size, as the delta rule kernel forms it: a constant-folded
  // rsqrtf(kD) is the correctly rounded value, which the hardware's rsqrt need not return.
  const float q_scale = rsqrtf(static_cast<float>(p.head_dim));
  // Token i's q and k, normalised into qk_s[row], kq = k . q after both scalings: lane l takes
  // elements l, l + 32, ... of the key head, from its own block's conv_s (kLocalQk) or from the
  // blocks that own them.
  auto normalise_qk = [&](int i, int row) {
    float qn[Shape::kPerLane], kn[Shape::kPerLane];
#pragma unroll
    for (int e = 0; e < Shape::kPerLane; ++e) {
      const int d = lane + 32 * e;
      if constexpr (kLocalQk) {
        qn[e] = conv_s[i][d];
        kn[e] = conv_s[i][kD + d];
      } else {
        const float* owner_s = cluster.map_shared_rank(&conv_s[i][0], d / kQk);
        qn[e] = owner_s[d % kQk];
        kn[e] = owner_s[kQk + d % kQk];
      }
    }
    float qinv, kinv, kq;
    DeltaRuleQkNorms<Shape::kPerLane>(qn, kn, q_scale, qinv, kinv, kq);
#pragma unroll
    for (int e = 0; e < Shape::kPerLane; ++e) {
      qk_s[row][0][lane + 32 * e] = qn[e] * qinv;
      qk_s[row][1][lane + 32 * e] = kn[e] * kinv;
    }
    return kq;
  };
  if constexpr (kT > 1) {
    // The tokens' norms do not depend on the state: the warps take them in parallel (the same
    // arithmetic as the one-token path, so the same bits).
    for (int i = warp; i < len; i += Shape::kWarps) {
      const float kq = normalise_qk(i, i);
      if (lane == 0) kq_s[i] = kq;
    }
    __syncthreads();
  }
  for (int i = 0; i < len; ++i) {
    const float4 v = make_float4(v_s[i][local_col], v_s[i][local_col + 1], v_s[i][local_col + 2],
                                 v_s[i][local_col + 3]);
    const float decay = __expf(gate_s[i][0]), b = gate_s[i][1];
    const float* q_s = qk_s[kT == 1 ? warp : i][0];
    const float* k_s = qk_s[kT == 1 ? warp : i][1];
    float kq;
    if constexpr (kT == 1) {
      kq = normalise_qk(0, warp);
      __syncwarp();  // the warp's q_s / k_s are written
    } else {
      kq = kq_s[i];
    }

    float4 u, sq;
    DeltaRuleProducts<kPasses, kLpr>(S, k_s, q_s, r0, u, sq);
    // The two warps of a pair hold the partial products of half the rows each. Past one token
    // they meet at the pair's own barrier: nothing else of the block changes inside the walk.
    if constexpr (kRowSplit == 2) {
      DeltaRuleAddPartner<kLpr, (kT > 1)>(part_s[i & 1], warp, lane, u, sq);
    }
    const float4 delta = DeltaRuleDelta(v, u, decay, b);
    if (owner && !kReplay) {
      // The delta rule's output, rounded as its bf16 tensor would hold it.
      const float4 o = DeltaRuleOutput(sq, delta, decay, kq);
      o_s[i][local_col] = Bf16ToF32(F32ToBf16(o.x));
      o_s[i][local_col + 1] = Bf16ToF32(F32ToBf16(o.y));
      o_s[i][local_col + 2] = Bf16ToF32(F32ToBf16(o.z));
      o_s[i][local_col + 3] = Bf16ToF32(F32ToBf16(o.w));
    }
    DeltaRuleUpdate<kPasses, kLpr>(S, k_s, r0, decay, delta);
  }
  if (state != nullptr) {
    if constexpr (kOutSlots) {
      // To the out slot, through __stwb: plain float4 stores through the offset pointer compiled
      // to four scalar stores each (the PTX of session 46's verify kernel), and that form was
      // 0.17-0.22 ms a batch-1 or batch-8 verify step slower than in place.
      state += static_cast<int64_t>(out_slot - slot) * hv * kD * kD;
#pragma unroll
      for (int pp = 0; pp < kPasses; ++pp) {
        __stwb(reinterpret_cast<float4*>(state + (r0 + kRowsPerPass * pp) * kD + col), S[pp]);
      }
    } else {
#pragma unroll
      for (int pp = 0; pp < kPasses; ++pp) {
        *reinterpret_cast<float4*>(state + (r0 + kRowsPerPass * pp) * kD + col) = S[pp];
      }
    }
  }
  // The norm's sum of squares in GatedRmsNormSubWarpKernel's order, so that a step gives the bits
  // of the separate kernels: each piece of 8 columns summed in order, then the pieces combined as
  // its xor-shuffle tree combines lanes.
  // Each sum goes to every block of the value head (shared-memory stores across the cluster),
  // so that after the barrier below every block reads only its own shared memory and may leave
  // at once: no third cluster barrier holding the step's end (batch 8 6.42 -> 6.38 ms a step,
  // performance.md twenty-eighth version).
  if constexpr (kReplay) {
    // No norm: one barrier, so that no block overwrites a q/k conv state (kLocalQk) or leaves
    // while another block may still read its shared memory (the q/k of the others).
    cluster.sync();
    if (kLocalQk && qk_state_owner) ch.StoreState();
    return;
  }
  __syncthreads();
  if constexpr (kLocalQk) cluster.barrier_wait(std::move(started));
  const int first = (rank / Shape::kBlocksPerHead) * Shape::kBlocksPerHead;
  const int piece0 = (rank % Shape::kBlocksPerHead) * kPiecesPerBlock;
  for (int n = threadIdx.x; n < len * kPiecesPerBlock * Shape::kBlocksPerHead;
       n += Shape::kThreads) {
    const int dst = n % Shape::kBlocksPerHead,
              piece = (n / Shape::kBlocksPerHead) % kPiecesPerBlock;
    const int i = n / (Shape::kBlocksPerHead * kPiecesPerBlock);
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) ss += o_s[i][8 * piece + c] * o_s[i][8 * piece + c];
    *cluster.map_shared_rank(&piece_s[i][piece0 + piece], first + dst) = ss;
  }
  cluster.sync();  // every block's piece sums of its value head are published
  if (kLocalQk && qk_state_owner) ch.StoreState();

  if (out_thread && out_token < len) {
    constexpr int kPieces = kD / 8;
    const int i = out_token;
    float tree[kPieces];
#pragma unroll
    for (int piece = 0; piece < kPieces; ++piece) tree[piece] = piece_s[i][piece];
#pragma unroll
    for (int step = kPieces / 2; step > 0; step >>= 1) {
      float next[kPieces];
#pragma unroll
      for (int piece = 0; piece < kPieces; ++piece) next[piece] = tree[piece] + tree[piece ^ step];
#pragma unroll
      for (int piece = 0; piece < kPieces; ++piece) tree[piece] = next[piece];
    }
    const float inv = rsqrtf(tree[0] / static_cast<float>(kD) + p.eps);
    const float zv[4] = {__uint_as_float(zr.x << 16), __uint_as_float(zr.x & 0xffff0000u),
                         __uint_as_float(zr.y << 16), __uint_as_float(zr.y & 0xffff0000u)};
    float y[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) y[c] = o_s[i][out_col + c] * inv * nw[c] * Silu(zv[c]);
    uint2 packed;
    packed.x = PackBf16x2(y[0], y[1]);
    packed.y = PackBf16x2(y[2], y[3]);
    *reinterpret_cast<uint2*>(p.out + out_row()) = packed;
  }
}

template <int kD, int kGroupCols, int kRowSplit, int kT>
__global__ void __launch_bounds__(StepShape<kD, kGroupCols, kRowSplit>::kThreads)
    DeltaNetDecodeStepKernel(DeltaNetDecodeStepArgs p, SegmentMeta segs) {
  DeltaNetStepBody<kD, kGroupCols, kRowSplit, kT, false>(p, segs);
}

// Layer blockIdx.z of `layers`; the rest of p (head counts and size) is every layer's.
template <int kD, int kGroupCols, int kRowSplit>
__global__ void __launch_bounds__(StepShape<kD, kGroupCols, kRowSplit>::kThreads)
    DeltaNetReplayKernel(DeltaNetDecodeStepArgs p, SegmentMeta segs, DeltaNetReplayLayers layers) {
  PdlWait();  // the launch before may have written the states
  const DeltaNetReplayLayer& layer = layers.layer[blockIdx.z];
  p.mixed = layer.mixed;
  p.g = const_cast<float*>(layer.g);
  p.beta = const_cast<float*>(layer.beta);
  p.conv_w = layer.conv_w;
  p.conv_states = layer.conv_states;
  p.states = layer.states;
  DeltaNetStepBody<kD, kGroupCols, kRowSplit, kMaxDeltaNetStepTokens, true>(p, segs);
}

template <int kD, int kGroupCols, int kRowSplit>
void LaunchStep(const DeltaNetDecodeStepArgs& args, const SegmentMeta& segs, int max_tokens,
                const DeltaNetReplayLayers* replay, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.num_k_heads * kClusterBlocks),
                  static_cast<unsigned>(segs.num_segments),
                  replay != nullptr ? static_cast<unsigned>(replay->count) : 1u);
  const unsigned threads = StepShape<kD, kGroupCols, kRowSplit>::kThreads;
  if (replay != nullptr) {
    LaunchPdlInClusters("DeltaNetReplayKernel", kClusterBlocks,
                        DeltaNetReplayKernel<kD, kGroupCols, kRowSplit>, grid, threads, 0, stream,
                        args, segs, *replay);
  } else if (max_tokens == 1) {
    LaunchPdlInClusters("DeltaNetDecodeStepKernel", kClusterBlocks,
                        DeltaNetDecodeStepKernel<kD, kGroupCols, kRowSplit, 1>, grid, threads, 0,
                        stream, args, segs);
  } else {
    LaunchPdlInClusters("DeltaNetDecodeStepKernel (verify)", kClusterBlocks,
                        DeltaNetDecodeStepKernel<kD, kGroupCols, kRowSplit, kMaxDeltaNetStepTokens>,
                        grid, threads, 0, stream, args, segs);
  }
}

// The delta rule warp kernel's layout for this many sequences (SelectDeltaRuleLayout), so that
// a step and the separate kernels give the same bits.
template <int kD>
void LaunchForDim(const DeltaNetDecodeStepArgs& args, const SegmentMeta& segs, int max_tokens,
                  const DeltaNetReplayLayers* replay, cudaStream_t stream) {
  const DeltaRuleLayout layout = SelectDeltaRuleLayout(segs.num_segments);
  if (layout.cols == 8 && layout.row_split == 2) {
    return LaunchStep<kD, 8, 2>(args, segs, max_tokens, replay, stream);
  }
  if constexpr (kD >= 64) {
    if (layout.cols == 16 && layout.row_split == 2) {
      return LaunchStep<kD, 16, 2>(args, segs, max_tokens, replay, stream);
    }
    if (layout.cols == 16 && layout.row_split == 1) {
      return LaunchStep<kD, 16, 1>(args, segs, max_tokens, replay, stream);
    }
  }
  if (layout.cols == 8 && layout.row_split == 1) {
    return LaunchStep<kD, 8, 1>(args, segs, max_tokens, replay, stream);
  }
  std::fprintf(stderr, "mobius cuda: DeltaNet decode step without the layout %d x %d at D = %d\n",
               layout.cols, layout.row_split, kD);
  std::abort();
}

}  // namespace

// The shapes and layouts the step body takes (both kernels).
static bool StepBodySupports(int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                             int conv_kernel, int num_segments) {
  const bool dims =
      k_head_dim == v_head_dim && (k_head_dim == 32 || k_head_dim == 64 || k_head_dim == 128) &&
      num_k_heads > 0 && num_v_heads == kHeadRatio * num_k_heads && conv_kernel == kConvTaps;
  // A block holds D / 4 value columns: the layouts of wider column groups need D >= 64.
  const DeltaRuleLayout layout = SelectDeltaRuleLayout(num_segments);
  const bool layout_ok = layout.cols == 8 || (layout.cols == 16 && k_head_dim >= 64);
  // Segments run on the grid's y dimension.
  const bool grid_ok = num_segments >= 1 && num_segments <= 65535;
  return dims && layout_ok && grid_ok;
}

bool DeltaNetDecodeStepSupports(int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                                int conv_kernel, int num_segments, const void* z, const void* out,
                                const void* conv_w, const void* norm_w, const void* conv_states,
                                const void* states) {
  return StepBodySupports(num_k_heads, num_v_heads, k_head_dim, v_head_dim, conv_kernel,
                          num_segments) &&
         IsAligned16(z) && IsAligned16(out) && IsAligned16(conv_w) && IsAligned16(norm_w) &&
         IsAligned16(conv_states) && IsAligned16(states);
}

bool DeltaNetReplaySupports(int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                            int conv_kernel, int num_segments) {
  return StepBodySupports(num_k_heads, num_v_heads, k_head_dim, v_head_dim, conv_kernel,
                          num_segments);
}

namespace {
void LaunchStepOrReplay(const DeltaNetDecodeStepArgs& args, const SegmentMeta& segments,
                        int max_tokens, const DeltaNetReplayLayers* replay, cudaStream_t stream) {
  switch (args.head_dim) {
    case 32:
      LaunchForDim<32>(args, segments, max_tokens, replay, stream);
      break;
    case 64:
      LaunchForDim<64>(args, segments, max_tokens, replay, stream);
      break;
    case 128:
      LaunchForDim<128>(args, segments, max_tokens, replay, stream);
      break;
    default:
      std::fprintf(stderr, "mobius cuda: DeltaNet decode step for head dim %d\n", args.head_dim);
      std::abort();
  }
}
}  // namespace

void LaunchDeltaNetDecodeStep(const DeltaNetDecodeStepArgs& args, const SegmentMeta& segments,
                              int max_tokens, cudaStream_t stream) {
  if (segments.num_segments == 0) return;
  LaunchStepOrReplay(args, segments, max_tokens, nullptr, stream);
  CheckLaunch("DeltaNetDecodeStep");
}

void LaunchDeltaNetReplay(const DeltaNetReplayLayers& layers, int num_k_heads, int num_v_heads,
                          int head_dim, const SegmentMeta& segments, cudaStream_t stream) {
  if (segments.num_segments == 0 || layers.count == 0) return;
  DeltaNetDecodeStepArgs args;  // the per-layer pointers come from `layers`
  args.num_k_heads = num_k_heads;
  args.num_v_heads = num_v_heads;
  args.head_dim = head_dim;
  LaunchStepOrReplay(args, segments, kMaxDeltaNetStepTokens, &layers, stream);
  CheckLaunch("DeltaNetReplay");
}

}  // namespace mobius::kernels::cuda
