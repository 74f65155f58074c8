// Projections of 1-40 rows on tensor cores: y_i[M, N_i] = x[M, K] @ w_i[N_i, K]^T, M <= 40, for
// up to kMaxSkinnyTargets weights that share x, in one launch (the skinny GEMM's interface).
//
// The CUDA-core skinny kernel, given 3-8 rows, made a batch-8 step slower (8.46 -> 10.30 ms;
// 8 rows x 8 fp32 products per 16-byte weight piece; not profiled), and cuBLASLt streams the
// dense projections at ~1.2 TB/s (ncu of a batch-8 step, performance.md tenth version). Here a warp
// owns 16 weight rows and multiplies them with mma.sync m16n8k16: the weights are the A operand
// (16 rows), x^T the B operand (its M <= 8 rows are the n = 8 columns), so one instruction does
// 16 x 8 x 16 products.
//
// The fragments come straight from global memory, with no shared memory: lane (g, q) = (lane /
// 4, lane % 4) loads 16 bytes (8 consecutive k) of weight rows g and g + 8 and of x row g at k
// offset 8q of each 32-wide step. A product sums over k, so any assignment of physical k to the
// fragments' k slots is right as long as A and B use the same one: lane (g, q) holds A's k slots
// {2q, 2q + 1, 2q + 8, 2q + 9} of rows g and g + 8 and B's same slots of column g, so it puts its
// words 0 and 1 in the first product's slots and words 2 and 3 in the second's.
//
// Measured on an H200 (release config, dummy weights, performance.md eleventh version): the
// backend's path for 2-8 rows, where it replaced cuBLASLt (3-8 rows) and the skinny kernel
// (2 rows): a batch-8 decode step 8.41 -> 7.60 ms, batch 2 4.66 -> 4.54 ms; validated by
// CudaKernelsTest.TcGemvMatchesReference and the CUDA-vs-CPU tests.
//
// 9-16 rows (decode batches 9-16, and verify steps of 2-8 sequences with 1-7 drafts) take two
// 8-row tiles of x: each weight fragment feeds two mma, so the weights are still read once.
// cuBLASLt ran these at 72-79% of the step's bytes bound against 85% at 8 rows (a step timeline
// of batch 10: its dense projections 2.9 ms against the GEMV's 1.7 ms at batch 8). Measured on an
// H100 (release config, dummy weights, performance.md "Projections of 9-16 rows"): a decode step
// at batch 10 11.79 -> 11.00 ms, 12 13.14 -> 12.27, 16 16.05 -> 15.20.
//
// 17-32 rows (decode batches 17-32, verify steps of 4-8 sequences with 2-7 drafts) take three or
// four tiles the same way, in rounds of two steps like the two-tile kernel (100 and 114
// registers, two blocks an SM). Five tiles (33-40 rows: batch 8 with 4 drafts) fit too (126
// registers) and beat cuBLASLt (session 49, H100: DeltaNet in-projections at 40 rows 30.2
// against 40.7 us). A row's sums do not depend on the tile count (the K split is
// chosen from the row groups and the residency, both alike), so a verify step's projections give
// the bits a one-token step gives for the same row, as cuBLASLt's did not.

#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/skinny_targets.cuh"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {
namespace {

constexpr int kTcGemvWarps = 8;
constexpr int kTcGemvRows = 16;  // weight rows per warp (the mma M)
constexpr int kTcGemvSteps = 4;  // 32-wide k steps of loads in flight per warp

struct TcGemvArgs {
  const uint16_t* x = nullptr;
  int m = 0;
  int64_t k = 0;
  SkinnyTargetTable table;  // targets start on multiples of 16 rows
};

union Words {
  uint4 v;
  uint32_t w[4];
};

// The kernel is written as a warp part (TcGemvPartOf), a main loop and a finish (TcGemvFinish):
// the same arithmetic as the one-function form session 11 had, but that form measured slower on
// the out-projection at 8 rows (ncu 10.38 against 9.81 us; a batch-8 step 7.594-7.609 against
// 7.564-7.572 ms in one call; performance.md fourteenth version). The difference is in the
// generated code (126 registers either way at the time), so keep this form when editing.
//
// One warp's share of the work: 16 weight rows of one target and a contiguous part of K (steps
// of 32), with the lane's fragment pointers. Block = kTcGemvWarps warps = (kTcGemvWarps /
// k_split) groups of 16 weight rows; the k_split warps of a group take contiguous parts of K and
// add their sums in shared memory (TcGemvFinish).
//
// kTiles: 8-row tiles of x (the mma's n = 8 columns each): ceil(rows / 8), 1-5; from two tiles
// one weight fragment feeds kTiles products (tile t multiplies x rows 8 t + g).
template <int kTiles>
struct TcGemvWarpPart {
  int lane, warp, g, q, part;
  int64_t row0;
  bool valid;
  const SkinnyTarget* tg;
  int64_t s_begin, s_end;  // 32-wide k steps of this warp
  bool lo_ok, hi_ok, x_ok[kTiles];
  const uint4* w_lo;        // weight row g, piece q of step 0 (step s: + 4 s)
  const uint4* w_hi;        // weight row g + 8
  const uint4* xr[kTiles];  // x row 8 t + g
};

template <int kTiles>
__device__ __forceinline__ TcGemvWarpPart<kTiles> TcGemvPartOf(const TcGemvArgs& args,
                                                               int k_split) {
  TcGemvWarpPart<kTiles> w;
  w.lane = threadIdx.x & 31;
  w.warp = threadIdx.x >> 5;
  w.g = w.lane >> 2;
  w.q = w.lane & 3;
  w.part = w.warp % k_split;
  const int64_t group =
      static_cast<int64_t>(blockIdx.x) * (kTcGemvWarps / k_split) + w.warp / k_split;
  w.row0 = group * kTcGemvRows;
  int target = 0;
  w.valid = LocateTargetRow(args.table, w.row0, target);
  w.tg = &args.table.targets[w.valid ? target : 0];
  const int64_t k = args.k, steps = k / 32;
  w.s_begin = steps * w.part / k_split;
  w.s_end = steps * (w.part + 1) / k_split;
  w.lo_ok = w.valid && w.row0 + w.g < w.tg->n;
  w.hi_ok = w.valid && w.row0 + w.g + 8 < w.tg->n;
  w.w_lo = reinterpret_cast<const uint4*>(w.tg->w + (w.lo_ok ? w.row0 + w.g : 0) * k) + w.q;
  w.w_hi = reinterpret_cast<const uint4*>(w.tg->w + (w.hi_ok ? w.row0 + w.g + 8 : 0) * k) + w.q;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const int row = 8 * t + w.g;
    w.x_ok[t] = row < args.m;
    w.xr[t] = reinterpret_cast<const uint4*>(args.x + (w.x_ok[t] ? row : 0) * k) + w.q;
  }
  return w;
}

// c += the products of one 32-wide step: weight rows g, g + 8 (lo, hi) and x (b), as laid out
// by the file comment.
__device__ __forceinline__ void TcGemvStep(float (&c)[4], const Words& lo, const Words& hi,
                                           const Words& b) {
  const uint32_t a0[4] = {lo.w[0], hi.w[0], lo.w[1], hi.w[1]};
  const uint32_t a1[4] = {lo.w[2], hi.w[2], lo.w[3], hi.w[3]};
  MmaBf16(c, a0, b.w[0], b.w[1]);
  MmaBf16(c, a1, b.w[2], b.w[3]);
}

// The k_split warps of a group add their sums (every warp of the block must call it) and the
// first stores the group's rows. Tile t's c[t][0], c[t][1]: row g, columns (x rows) 8 t + 2q,
// 8 t + 2q + 1; c[t][2], c[t][3]: row g + 8, the same columns.
template <int kTiles>
__device__ __forceinline__ void TcGemvFinish(
    const TcGemvArgs& args, const TcGemvWarpPart<kTiles>& w, int k_split, float (&c)[kTiles][4],
    float (&partial)[kTcGemvWarps][kTcGemvRows * 8 * kTiles]) {
  if (k_split > 1) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[w.warp][(t * 32 + w.lane) * 4 + i] = c[t][i];
    }
    __syncthreads();
    if (w.part != 0) return;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = 0.f;
        for (int p = 0; p < k_split; ++p) sum += partial[w.warp + p][(t * 32 + w.lane) * 4 + i];
        c[t][i] = sum;
      }
    }
  }
  if (!w.valid) return;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = w.row0 + w.g + (i >= 2 ? 8 : 0);
      const int col = 8 * t + 2 * w.q + (i & 1);
      if (row < w.tg->n && col < args.m) Store(w.tg->y, col * w.tg->n + row, c[t][i]);
    }
  }
}

// Weight loads in registers: two rounds of kSteps steps alternate between buffers A and B, so
// the next round's loads are in flight while the current round multiplies (the loop is unrolled
// by two rounds to keep both buffers in registers). Two tiles hold twice the x fragments, so they
// take rounds of half the steps: 88 registers and two blocks an SM, where four steps needed 157
// registers (one block an SM) or spilled under this bound; the engine timed both forms alike
// (batch 10-16 within 0.08 ms), the kernel bench had the in-projection fan-outs 0.9 us faster
// with two steps. One tile: 128 registers under the bound (the templated form takes 132 without
// it, which leaves one block an SM; the untemplated one took 126); batch 8 unchanged (8.37 /
// 8.35 ms, fan-outs at 8 rows within 0.4 us).
template <int kTiles, int kSteps>
__global__ void __launch_bounds__(kTcGemvWarps * 32, 2)
    TcGemvKernel(const TcGemvArgs args, int k_split) {
  __shared__ float partial[kTcGemvWarps][kTcGemvRows * 8 * kTiles];
  const TcGemvWarpPart<kTiles> w = TcGemvPartOf<kTiles>(args, k_split);
  const int64_t s_end = w.s_end;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  struct Round {
    Words lo[kSteps], hi[kSteps];
  };
  auto load_weights = [&](Round& r, int64_t s0) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int64_t s = s0 + i;
      r.lo[i].v = w.lo_ok && s < s_end ? __ldg(w.w_lo + 4 * s) : zero;
      r.hi[i].v = w.hi_ok && s < s_end ? __ldg(w.w_hi + 4 * s) : zero;
    }
  };
  float c[kTiles][4] = {};
  auto multiply = [&](const Round& r, int64_t s0) {
    Words b[kTiles][kSteps];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        b[t][i].v = w.x_ok[t] && s0 + i < s_end ? __ldg(w.xr[t] + 4 * (s0 + i)) : zero;
      }
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
#pragma unroll
      for (int t = 0; t < kTiles; ++t) TcGemvStep(c[t], r.lo[i], r.hi[i], b[t][i]);
    }
  };
  Round a, b;
  // The weights are no kernel's output: the first loads go out before the PDL wait.
  if (w.s_begin < s_end) load_weights(a, w.s_begin);
  PdlWait();
  PdlTrigger();
  constexpr int kRound = kSteps;
  for (int64_t s0 = w.s_begin; s0 < s_end; s0 += 2 * kRound) {
    if (s0 + kRound < s_end) load_weights(b, s0 + kRound);
    multiply(a, s0);
    if (s0 + kRound >= s_end) break;
    if (s0 + 2 * kRound < s_end) load_weights(a, s0 + 2 * kRound);
    multiply(b, s0 + kRound);
  }
  TcGemvFinish(args, w, k_split, c, partial);
}

// Warps per 16-row group: the largest split (K parts of at least 8 steps) whose warps all fit in
// one wave of resident blocks. Measured with mobius_kernel_bench at 4-8 rows, forcing each split
// (MOBIUS_TC_GEMV_SPLIT): the in-projection fan-out (772 groups, K 2048) 19.2 us at split 2
// (1544 warps) against 22.4 at 4 (3088 warps, 1.5 waves) and 22.6 at 8; the out-projection
// (128 groups, K 4096) 12.1 us at 8 against 14.2 at 4 and 20.9 at 2; the shared expert + router
// fan-out (225 groups) 10.6 us at 8 against 11.2 at 4 (performance.md, eleventh version).
template <auto kKernel>
int TcGemvSplit(int64_t groups, int64_t steps) {
  static const int64_t resident_warps = [] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kTcGemvWarps * 32, 0);
    return static_cast<int64_t>(std::max(1, sms)) * std::max(1, per_sm) * kTcGemvWarps;
  }();
  int split = 1;
  while (split < kTcGemvWarps && groups * split * 2 <= resident_warps && steps / (split * 2) >= 8) {
    split *= 2;
  }
  return split;
}

}  // namespace

bool TcGemvSupports(int64_t m, int64_t k, const void* x, const void* w) {
  return m >= 1 && m <= kMaxTcGemvRows && k > 0 && k % 32 == 0 && IsAligned16(x) && IsAligned16(w);
}

void LaunchTcGemv(const uint16_t* x, int64_t m, int64_t k, const SkinnyTarget* targets,
                  int num_targets, cudaStream_t stream) {
  TcGemvArgs args;
  args.x = x;
  args.m = static_cast<int>(m);
  args.k = k;
  int64_t rows = 0;
  args.table = MakeSkinnyTargetTable(targets, num_targets, kTcGemvRows, &rows);
  if (rows == 0 || m == 0) return;
  const int64_t groups = rows / kTcGemvRows;
  // MOBIUS_TC_GEMV_SPLIT=1|2|4|8 forces the K split (A/B runs).
  static const int forced_split = [] {
    const int choice = KnobChoice("MOBIUS_TC_GEMV_SPLIT", {"1", "2", "4", "8"});
    return choice == 0 ? 0 : 1 << (choice - 1);
  }();
  const int64_t steps = k / 32;
  auto launch = [&]<auto kKernel>() {
    const int split = forced_split > 0 && steps >= forced_split
                          ? forced_split
                          : TcGemvSplit<kKernel>(groups, steps);
    const int64_t groups_per_block = kTcGemvWarps / split;
    const auto blocks = static_cast<unsigned>((groups + groups_per_block - 1) / groups_per_block);
    LaunchPdl("TcGemvKernel", kKernel, blocks, kTcGemvWarps * 32, 0, stream, args, split);
  };
  // Tiles of x and steps a round (registers with the two-block bound, no spills): 1 x 4 (128),
  // 2 x 2 (88), 3 x 2 (100), 4 x 2 (114), 5 x 2 (126; six tiles spilled under the bound).
  if (m <= 8) {
    launch.template operator()<TcGemvKernel<1, kTcGemvSteps>>();
  } else if (m <= 16) {
    launch.template operator()<TcGemvKernel<2, kTcGemvSteps / 2>>();
  } else if (m <= 24) {
    launch.template operator()<TcGemvKernel<3, kTcGemvSteps / 2>>();
  } else if (m <= 32) {
    launch.template operator()<TcGemvKernel<4, kTcGemvSteps / 2>>();
  } else {
    launch.template operator()<TcGemvKernel<5, kTcGemvSteps / 2>>();
  }
  CheckLaunch("TcGemv");
}

}  // namespace mobius::kernels::cuda
