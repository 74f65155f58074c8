// The weights of a fan-out (projections of one input) laid end to end as one range of rows, for
// the kernels that stream several weights in one launch (skinny_gemm.cu, tc_gemv.cu). Each
// weight starts on a multiple of the kernel's rows per warp, so no warp straddles two weights.
#pragma once

#include <algorithm>
#include <cstdint>

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

#ifdef __CUDACC__
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
