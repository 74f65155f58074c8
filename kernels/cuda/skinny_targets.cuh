// The weights of a fan-out (projections of one input) laid end to end as one range of rows, for
// the kernels that stream several weights in one launch (skinny_gemm.cu, tc_gemv.cu). Each
// weight starts on a multiple of the kernel's rows per warp, so no warp straddles two weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "kernels/cuda/launch.h"

namespace mobius::kernels::cuda {

struct SkinnyTargetTable {
  int num_targets = 0;
  SkinnyTarget targets[kMaxSkinnyTargets];
  int64_t row_end[kMaxSkinnyTargets] = {};  // cumulative aligned rows over the targets
};

// The table of the first kMaxSkinnyTargets of `targets`, each starting on a multiple of `align`
// rows; *total_rows receives the aligned rows of all of them.
inline SkinnyTargetTable MakeSkinnyTargetTable(const SkinnyTarget* targets, int num_targets,
                                               int64_t align, int64_t* total_rows) {
  SkinnyTargetTable table;
  table.num_targets = std::min(num_targets, kMaxSkinnyTargets);
  int64_t rows = 0;
  for (int i = 0; i < table.num_targets; ++i) {
    table.targets[i] = targets[i];
    rows += (targets[i].n + align - 1) / align * align;
    table.row_end[i] = rows;
  }
  *total_rows = rows;
  return table;
}

// MOBIUS_GEMV_BLOCKS_PER_SM=N caps the grids of the skinny and tensor-core GEMVs at N blocks per
// SM, their blocks then walking the row blocks (0 or unset: one block per row block, the
// default). Not yet timed: the question is whether a successor's first blocks, resident in the
// slots this leaves free, start their weight stream earlier. Returns the grid cap for a kernel of
// which resident_per_sm() blocks fit on an SM (N is clamped to it, so that the whole grid starts
// at once; asked only when the cap is on), or 0 when off.
template <typename ResidentPerSm>
int64_t GemvGridCap(ResidentPerSm&& resident_per_sm) {
  static const int blocks_per_sm = [] {
    const char* v = std::getenv("MOBIUS_GEMV_BLOCKS_PER_SM");
    const int n = v != nullptr ? std::atoi(v) : 0;
    return n > 0 ? n : 0;
  }();
  if (blocks_per_sm == 0) return 0;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return int64_t{std::max(1, std::min(blocks_per_sm, resident_per_sm()))} * std::max(1, sms);
}

#ifdef __CUDACC__
// The body of a GEMV kernel over its row blocks: block(b, first) once for this block's index
// (kLoop false: one block per row block), or for every num_blocks row block b = blockIdx.x,
// blockIdx.x + gridDim.x, ... (kLoop: a capped grid, GemvGridCap). `first` marks the call that
// waits for the predecessor. Between row blocks the block meets at a barrier: the previous one's
// reads of its shared-memory partial sums finish before the next writes them.
template <bool kLoop, typename Block>
__device__ __forceinline__ void ForEachRowBlock(int64_t num_blocks, Block&& block) {
  if constexpr (!kLoop) {
    block(static_cast<int64_t>(blockIdx.x), true);
  } else {
    for (int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
      if (b != blockIdx.x) __syncthreads();
      block(b, b == blockIdx.x);
    }
  }
}

// The target that holds global row `row`, and `row` made relative to it; false past the last.
__device__ __forceinline__ bool LocateTargetRow(const SkinnyTargetTable& table, int64_t& row,
                                                int& target) {
  target = 0;
  while (target < table.num_targets && row >= table.row_end[target]) ++target;
  if (target >= table.num_targets) return false;
  if (target > 0) row -= table.row_end[target - 1];
  return true;
}
#endif

}  // namespace mobius::kernels::cuda
