// Tensor maps (the copy engine's descriptors) over the paged KV caches, for kernels that load
// whole pages with cp.async.bulk.tensor.
#ifndef MOBIUS_KERNELS_CUDA_PAGED_CACHE_MAP_H_
#define MOBIUS_KERNELS_CUDA_PAGED_CACHE_MAP_H_

#include <cuda.h>

#include <cstdint>

namespace mobius::kernels::cuda {

// A cache [blocks, block_size, nkv, hd] (bf16) of `rows` = blocks * block_size positions as the
// 3-D tensor (hd, nkv, rows), read in boxes of (64 head dims, 1 kv head, `box_rows` positions),
// 128-byte swizzled; coordinates past `rows` read as zeros. False when the driver has no
// encoder or refuses the shape (the caller then copies another way). The last few encodings are
// remembered, so a decode step that runs op by op does not pay the driver call per layer.
bool EncodePagedCacheMap(const uint16_t* cache, int64_t rows, int nkv, int hd, int box_rows,
                         CUtensorMap* map);

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_PAGED_CACHE_MAP_H_
