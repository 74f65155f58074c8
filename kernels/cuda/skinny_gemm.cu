// GEMMs with one or two rows (batch-1/2 decode): y_i[M, N_i] = x[M, K] @ w_i[N_i, K]^T for up to
// kMaxSkinnyTargets weights that share x, in one launch.
//
// At one or two rows a projection is a pass over its weights, and a layer has several that read
// the same input (a DeltaNet layer four, two of them 32 rows wide), each a launch of its own
// through cuBLASLt. Here each warp owns kRowsPerWarp weight rows, each lane streams 16-byte
// pieces of all of them and reuses the matching piece of x for every row, and the rows of every
// target form one grid.
//
// Measured on the H200 (mobius_kernel_bench, 2026-12-01, 2 rows per warp and 4 pieces in flight
// per row): a DeltaNet layer's four in-projections at batch 1 in 18.2 us (cuBLASLt, one launch
// each: 31.8 us), the shared expert + its gate + the router in 8.8 us (24.3 us). A single large
// projection is not faster than cuBLASLt (1 x 12352 x 2048: 17.2 vs 16.9 us) and at 8 rows an
// earlier version was 3-4x slower, so the backend uses it for fan-outs of at most kMaxSkinnyRows
// rows and for single projections of at most 16M weights (1 x 2048 x 4096: 9.2 vs 10.3 us).
// MOBIUS_SKINNY_SHAPE=RxU picks R rows per warp and U pieces in flight per row (2x4 default, 4x2,
// 1x8), for timing.
#include <cstdlib>
#include <string_view>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/skinny_targets.cuh"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {
namespace {

constexpr int kRowAlign = 4;  // targets start on a multiple of every variant's rows per warp
constexpr int kWarpsPerBlock = 8;

struct SkinnyArgs {
  const uint16_t* x = nullptr;
  int64_t k = 0;
  int64_t x_stride = 0;  // elements between rows of x: k, or 2k for a gate/up input
  SkinnyTargetTable table;
};

// Block = kWarpsPerBlock warps = (kWarpsPerBlock / k_split) row groups of kRowsPerWarp rows;
// the k_split warps of a group take contiguous parts of K and add their sums in shared memory
// (split K keeps enough loads in flight when the projection has few rows, e.g. 2048 rows of
// K = 4096).
// kRowsPerWarp rows per warp, kUnroll 16-byte pieces per row in flight per lane and iteration.
// With kSiluMul, x holds [gate; up] rows of 2k and the kernel multiplies by silu(gate) * up,
// rounded to bf16 as SiluAndMul stores it (so the fused projection equals the two-op one).
template <int kM, int kRowsPerWarp, int kUnroll, bool kSiluMul>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 2)
    SkinnyGemmKernel(SkinnyArgs args, int k_split) {
  // Everything up to PdlWait reads only weights and arguments, which no kernel of the step
  // writes: so while the predecessor still runs, the blocks of the first wave issue their first
  // weight loads, and the weight stream starts before the input exists. (An L2 bulk prefetch of
  // the next waves' rows from the first wave, up to 24 MB, measured slower: the 1 x 12352 x 2048
  // fan-out 18.3 -> 20.8 us, a batch-1 decode step 4.03 -> 4.11 ms.)
  __shared__ float partial[kWarpsPerBlock][kRowsPerWarp * kM];
  const int lane = threadIdx.x & 31, warp_in_block = threadIdx.x >> 5;
  const int group_in_block = warp_in_block / k_split, part = warp_in_block % k_split;
  const int64_t groups_per_block = kWarpsPerBlock / k_split;
  int target = 0;
  int64_t row0 = (blockIdx.x * groups_per_block + group_in_block) * kRowsPerWarp;
  const bool valid = LocateTargetRow(args.table, row0, target);
  const SkinnyTarget& tg = args.table.targets[valid ? target : 0];
  const int64_t k = args.k, pieces = k / 8;
  const int64_t p_begin = pieces * part / k_split, p_end = pieces * (part + 1) / k_split;

  const uint16_t* w_rows[kRowsPerWarp];
  bool row_ok[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row_ok[r] = valid && row0 + r < tg.n;
    w_rows[r] = tg.w + (row_ok[r] ? row0 + r : 0) * k;
  }
  uint4 wv[kUnroll][kRowsPerWarp];
  auto load_pieces = [&](int64_t base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = base + 32 * u;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        wv[u][r] = p < p_end ? __ldg(reinterpret_cast<const uint4*>(w_rows[r]) + p)
                             : make_uint4(0, 0, 0, 0);
      }
    }
  };
  int64_t base = p_begin + lane;
  if (valid && base < p_end) load_pieces(base);
  PdlWait();
  PdlTrigger();
  float acc[kRowsPerWarp][kM] = {};
  while (valid && base < p_end) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = base + 32 * u;
      if (p >= p_end) break;
        // x outer, rows inner: x's piece is unpacked once per row block, and only one row of x
        // is live at a time (holding all kM rows of x cost enough registers at kM = 8 to leave
        // one block per SM, too few loads in flight).
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        float xv[8];
        const uint4* xr = reinterpret_cast<const uint4*>(args.x + m * args.x_stride);
        if constexpr (kSiluMul) {
          SiluMulPiece(__ldg(xr + p), __ldg(xr + pieces + p), xv);
        } else {
          UnpackBf16x8(__ldg(xr + p), xv);
        }
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          float wf[8];
          UnpackBf16x8(wv[u][r], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][m] += wf[i] * xv[i];
        }
      }
    }
    base += 32 * kUnroll;
    if (base < p_end) load_pieces(base);
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int m = 0; m < kM; ++m) acc[r][m] = WarpSum(acc[r][m]);
  }
  if (k_split > 1) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
        for (int m = 0; m < kM; ++m) partial[warp_in_block][r * kM + m] = acc[r][m];
      }
    }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        float sum = 0.0f;
        for (int q = 0; q < k_split; ++q) sum += partial[warp_in_block + q][r * kM + m];
        acc[r][m] = sum;
      }
    }
  }
  // Lane (r * kM + m) stores one result, so the stores of a warp go out together.
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      if (lane == (r * kM + m) % 32 && row_ok[r]) Store(tg.y, m * tg.n + row0 + r, acc[r][m]);
    }
  }
}

// Warps per row group: enough that each lane streams at least kUnroll 16-byte pieces per row.
int KSplit(int64_t k, int unroll) {
  const int64_t pieces = k / 8;
  int split = 1;
  while (split < kWarpsPerBlock && split * 2 * 32 * unroll <= pieces) split *= 2;
  return split;
}

template <int kM, int kRowsPerWarp, int kUnroll>
void Launch(const SkinnyArgs& args, int64_t total_rows, bool silu_mul, cudaStream_t stream) {
  const int k_split = KSplit(args.k, kUnroll);
  const int64_t groups = total_rows / kRowsPerWarp;
  const int64_t groups_per_block = kWarpsPerBlock / k_split;
  const auto blocks = static_cast<unsigned>((groups + groups_per_block - 1) / groups_per_block);
  auto* kernel = silu_mul ? SkinnyGemmKernel<kM, kRowsPerWarp, kUnroll, true>
                          : SkinnyGemmKernel<kM, kRowsPerWarp, kUnroll, false>;
  LaunchPdl(silu_mul ? "SkinnyGemmKernel (silu-mul)" : "SkinnyGemmKernel", kernel, blocks,
            kWarpsPerBlock * 32, 0, stream, args, k_split);
}

template <int kM>
void LaunchShape(const SkinnyArgs& args, int64_t total_rows, bool silu_mul, cudaStream_t stream) {
  static const int shape = KnobChoice("MOBIUS_SKINNY_SHAPE", {"2x4", "4x2", "1x8"});
  if (shape == 2) {
    Launch<kM, 4, 2>(args, total_rows, silu_mul, stream);
  } else if (shape == 3) {
    Launch<kM, 1, 8>(args, total_rows, silu_mul, stream);
  } else {
    Launch<kM, 2, 4>(args, total_rows, silu_mul, stream);
  }
}

}  // namespace

bool SkinnyGemmSupports(int64_t m, int64_t k, const void* x, const void* w) {
  return m >= 1 && m <= kMaxSkinnyRows && k % 8 == 0 && k > 0 && IsAligned16(x) && IsAligned16(w);
}

void LaunchSkinnyGemm(const uint16_t* x, int64_t m, int64_t k, const SkinnyTarget* targets,
                      int num_targets, cudaStream_t stream, bool silu_mul) {
  SkinnyArgs args;
  args.x = x;
  args.k = k;
  args.x_stride = silu_mul ? 2 * k : k;
  int64_t rows = 0;
  args.table = MakeSkinnyTargetTable(targets, num_targets, kRowAlign, &rows);
  if (rows == 0) return;
  if (m == 1) {
    LaunchShape<1>(args, rows, silu_mul, stream);
  } else {
    LaunchShape<2>(args, rows, silu_mul, stream);
  }
  CheckLaunch("SkinnyGemm");
}

}  // namespace mobius::kernels::cuda
