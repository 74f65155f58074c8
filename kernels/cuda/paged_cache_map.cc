#include "kernels/cuda/paged_cache_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <array>
#include <mutex>

namespace mobius::kernels::cuda {
namespace {

// The driver's encoder, through the runtime (no link against libcuda); null when it has none.
PFN_cuTensorMapEncodeTiled_v12000 Encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

struct Entry {
  const uint16_t* cache = nullptr;
  int64_t rows = 0;
  int nkv = 0, hd = 0, box_rows = 0;
  CUtensorMap map{};
};

}  // namespace

bool EncodePagedCacheMap(const uint16_t* cache, int64_t rows, int nkv, int hd, int box_rows,
                         CUtensorMap* map) {
  // Two caches (K and V) per attention layer of each device: a few entries cover a model.
  static std::mutex mu;
  static std::array<Entry, 128> recent;
  static size_t next = 0;
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : recent) {
    if (e.cache == cache && e.rows == rows && e.nkv == nkv && e.hd == hd &&
        e.box_rows == box_rows) {
      *map = e.map;
      return true;
    }
  }
  if (Encoder() == nullptr || rows <= 0 || rows >= (int64_t{1} << 31) || box_rows > 256) {
    return false;
  }
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(hd), static_cast<cuuint64_t>(nkv),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(hd) * 2,
                                 static_cast<cuuint64_t>(hd) * nkv * 2};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  Entry e{cache, rows, nkv, hd, box_rows, {}};
  if (Encoder()(&e.map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<uint16_t*>(cache), dims,
                strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    return false;
  }
  recent[next] = e;
  next = (next + 1) % recent.size();
  *map = e.map;
  return true;
}

}  // namespace mobius::kernels::cuda
