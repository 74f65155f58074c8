// Paged causal GQA attention on tensor cores (flash-attention style), for prefill and decode.
//
// A block takes one tile of query rows of one segment and one kv head: the tile's rows are
// (token, query head of the kv head's group) pairs, 64 of them (16 per warp), so a decode token
// of a 16/2-head model fills 8 rows and a prefill tile covers 8 tokens. The block walks its
// split of the positions in tiles of 32, gathered through the block table into shared memory
// with 16-byte cp.async copies (double-buffered, rows XOR-swizzled so that ldmatrix reads are
// conflict-free); S = Q K^T and O += P V run as mma.sync m16n8k16 (bf16 in, fp32 accumulate)
// with the online softmax in registers. Splits (flash-decoding) write (m, l, acc) partials that
// the combine kernel of attention_kernels.cu merges.
//
// The tile a block takes is found on the device from the segments (a walk over them), so the
// grid depends only on the numbers of tokens and segments: a recorded decode step replays with
// new block tables and positions.
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/paged_cache_map.h"
#include "kernels/cuda/tuning_knobs.h"
#include "kernels/cuda/wgmma.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kFlashThreads = 128;  // 4 warps
constexpr int kFlashRows = 64;      // query rows per block, 16 per warp
constexpr int kKvTile = 32;         // positions per shared-memory K/V tile

__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(smem)));
}
__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(smem)));
}

template <int kHd>
__global__ void __launch_bounds__(kFlashThreads)
    FlashPagedAttentionKernel(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                              int num_heads, int num_kv_heads, int block_size, TokenMeta tokens,
                              SegmentMeta segs, float scale, int splits, float* partial,
                              uint16_t* out) {
  constexpr int kChunks = kHd / 8;    // 16-byte chunks per row
  constexpr int kSteps = kHd / 16;    // mma k-steps over the head dim
  constexpr int kDimTiles = kHd / 8;  // output n-tiles
  extern __shared__ uint4 flash_smem[];
  uint16_t* k_tiles = reinterpret_cast<uint16_t*>(flash_smem);  // [2][kKvTile][kHd]
  uint16_t* v_tiles = k_tiles + 2 * kKvTile * kHd;

  const int group = num_heads / num_kv_heads;
  const int tile_tokens = kFlashRows / group;
  const int kvh = blockIdx.y, split = blockIdx.z;

  // This block's tile: the blockIdx.x-th over the segments' ceil(tokens / tile_tokens) tiles.
  int b = blockIdx.x, seg = -1, tok0 = 0, ntok = 0;
  for (int s = 0; s < segs.num_segments; ++s) {
    const int n = segs.num_tokens[s];
    const int tiles = (n + tile_tokens - 1) / tile_tokens;
    if (b < tiles) {
      seg = s;
      tok0 = segs.token_begin[s] + b * tile_tokens;
      ntok = min(tile_tokens, n - b * tile_tokens);
      break;
    }
    b -= tiles;
  }
  if (seg < 0) return;  // surplus block of the worst-case grid

  const int num_pos = tokens.token_position[tok0 + ntok - 1] + 1;
  const int chunk = (num_pos + splits - 1) / splits;
  const int begin = split * chunk, end = min(num_pos, begin + chunk);
  const int32_t* table = segs.block_tables + segs.block_table_begin[seg];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad_row = lane >> 2, quad_col = (lane & 3) * 2;
  const bool warp_active = warp * 16 < ntok * group;

  // The thread's two rows: warp * 16 + quad_row and 8 more.
  int row_pos[2];
  int64_t row_index[2];  // token * num_heads + head
  bool row_valid[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + quad_row + 8 * i;
    row_valid[i] = r < ntok * group;
    const int token = tok0 + (row_valid[i] ? r / group : 0);
    row_index[i] = static_cast<int64_t>(token) * num_heads + kvh * group + r % group;
    row_pos[i] = row_valid[i] ? tokens.token_position[token] : -1;
  }

  // Q as mma A fragments, for every k-step of the head dim.
  uint32_t qf[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint16_t* p = q + row_index[i] * kHd + kk * 16 + quad_col;
      qf[kk][i] = row_valid[i] ? *reinterpret_cast<const uint32_t*>(p) : 0u;
      qf[kk][2 + i] = row_valid[i] ? *reinterpret_cast<const uint32_t*>(p + 8) : 0u;
    }
  }

  float o[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
  }
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  const int num_tiles = begin < end ? (end - begin + kKvTile - 1) / kKvTile : 0;
  auto load_tile = [&](int tile, int buf) {
    const int p0 = begin + tile * kKvTile;
    for (int c = threadIdx.x; c < kKvTile * kChunks; c += kFlashThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const int p = p0 + r;
      const bool valid = p < end;
      int64_t row = 0;
      if (valid) {
        row = (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) *
                  num_kv_heads +
              kvh;
      }
      const int dst = buf * kKvTile * kHd + TileOffset<kHd>(r, ch);
      CopyAsync16(k_tiles + dst, k_cache + row * kHd + ch * 8, valid);
      CopyAsync16(v_tiles + dst, v_cache + row * kHd + ch * 8, valid);
    }
    CopyAsyncCommit();
  };

  if (num_tiles > 0) load_tile(0, 0);
  for (int j = 0; j < num_tiles; ++j) {
    if (j + 1 < num_tiles) {
      load_tile(j + 1, (j + 1) & 1);
      CopyAsyncWait<1>();
    } else {
      CopyAsyncWait<0>();
    }
    __syncthreads();
    const uint16_t* kt = k_tiles + (j & 1) * kKvTile * kHd;
    const uint16_t* vt = v_tiles + (j & 1) * kKvTile * kHd;
    const int p0 = begin + j * kKvTile;
    if (warp_active) {
      // S = Q K^T over this tile: 16 rows x 32 positions (4 n-tiles of 8).
      float s[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          // Matrices: (positions +0..7 | +8..15) x (dims lo | hi) of this k-step.
          const int mi = lane >> 3;
          const int r = np * 16 + (mi >> 1) * 8 + (lane & 7);
          uint32_t bk[4];
          LoadMatrixX4(bk, kt + TileOffset<kHd>(r, kk * 2 + (mi & 1)));
          MmaBf16(s[np * 2], qf[kk], bk[0], bk[1]);
          MmaBf16(s[np * 2 + 1], qf[kk], bk[2], bk[3]);
        }
      }
      // Scale, causal mask, online softmax (rows are shared by the 4 threads of a quad).
      float corr[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int p = p0 + n * 8 + quad_col + e;
            float v = s[n][i * 2 + e] * scale;
            if (p >= end || p > row_pos[i]) v = -INFINITY;
            s[n][i * 2 + e] = v;
            mx = fmaxf(mx, v);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[i], mx);
        corr[i] = m[i] == -INFINITY ? 0.0f : __expf(m[i] - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float v = s[n][i * 2 + e];
            const float p = v == -INFINITY ? 0.0f : __expf(v - m_new);
            s[n][i * 2 + e] = p;
            sum += p;
          }
        }
        l[i] = l[i] * corr[i] + sum;
        m[i] = m_new;
      }
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
      }
      // O += P V: P from the S accumulators as A fragments, 2 k-steps of 16 positions.
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        uint32_t a[4];
        a[0] = PackBf16x2(s[2 * ks][0], s[2 * ks][1]);
        a[1] = PackBf16x2(s[2 * ks][2], s[2 * ks][3]);
        a[2] = PackBf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
        a[3] = PackBf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
        for (int dp = 0; dp < kDimTiles / 2; ++dp) {
          // Matrices: (positions lo | hi) x (dims +0..7 | +8..15), transposed on load.
          const int mi = lane >> 3;
          const int r = ks * 16 + (mi & 1) * 8 + (lane & 7);
          uint32_t bv[4];
          LoadMatrixX4Trans(bv, vt + TileOffset<kHd>(r, dp * 2 + (mi >> 1)));
          MmaBf16(o[dp * 2], a, bv[0], bv[1]);
          MmaBf16(o[dp * 2 + 1], a, bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // the next iteration's copy reuses this buffer
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  if (!warp_active) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!row_valid[i]) continue;
    if (splits == 1) {
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      uint16_t* dst = out + row_index[i] * kHd + quad_col;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        *reinterpret_cast<uint32_t*>(dst + n * 8) =
            PackBf16x2(o[n][i * 2] * inv, o[n][i * 2 + 1] * inv);
      }
    } else {
      float* part = partial + (row_index[i] * splits + split) * (kHd + 2);
      if ((lane & 3) == 0) {
        part[0] = m[i];
        part[1] = l[i];
      }
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        part[2 + n * 8 + quad_col] = o[n][i * 2];
        part[2 + n * 8 + quad_col + 1] = o[n][i * 2 + 1];
      }
    }
  }
}

template <int kHd>
void Launch(dim3 grid, cudaStream_t stream, const uint16_t* q, const uint16_t* k_cache,
            const uint16_t* v_cache, int nh, int nkv, int block_size, const TokenMeta& tokens,
            const SegmentMeta& segs, float scale, int splits, float* partial, uint16_t* out) {
  constexpr size_t kSmem = 2 * 2 * kKvTile * kHd * sizeof(uint16_t);
  static const bool configured = [] {
    return cudaFuncSetAttribute(FlashPagedAttentionKernel<kHd>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kSmem)) == cudaSuccess;
  }();
  if (!configured) CheckLaunch("FlashPagedAttention (shared memory attribute)");
  FlashPagedAttentionKernel<kHd><<<grid, kFlashThreads, kSmem, stream>>>(
      q, k_cache, v_cache, nh, nkv, block_size, tokens, segs, scale, splits, partial, out);
}

// ---- decode: one query token per block row, the whole GQA group at once ----
//
// Block (split, kv head, token) attends the token's query heads of one kv head (up to 8) to its
// share of the positions. The products run transposed, so that the group's 8 heads are the mma's
// n = 8 and no row of the m16n8k16 tile is padding:
//   S^T [16 positions x 8 heads] = K [16 x hd] Q^T,  O^T [hd x 8 heads] += V^T [hd x 16] P^T.
// P^T, the B operand of the second product, is the S^T accumulator rounded to bf16 and
// transposed within each 8x8 quarter by movmatrix. Each warp streams its own 16-position tiles
// (every kDecodeWarps-th tile of the split) through a private kDecodeStages-deep ring, filled by
// the copy engine (one page per tile, small steps) or by cp.async, with no block barrier until
// the warps' softmax states are merged at the end. O is rescaled only when a maximum moved.
constexpr int kDecodeTile = 16;  // positions per warp tile
constexpr int kDecodeMaxGroup = 8;

__device__ __forceinline__ uint32_t TransposeBf16x8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <int kHd, int kDecodeWarps, int kDecodeStages>
constexpr size_t DecodeSmemBytes() {
  // + 1024: the rings start on the 1024-byte swizzle period (after the static shared memory).
  constexpr size_t tiles = 2ull * kDecodeWarps * kDecodeStages * kDecodeTile * kHd * 2 + 1024;
  constexpr size_t merge = sizeof(float) * kDecodeWarps * kDecodeMaxGroup * (kHd + 4);
  return tiles > merge ? tiles : merge;
}

// Element offset of (row, 16-byte chunk) in a ring slot: the copy engine's 128-byte-swizzled
// layout (wgmma.cuh), 64-column blocks of kDecodeTile rows; ldmatrix reads it conflict-free.
__device__ __forceinline__ int SlotOffset(int row, int chunk) {
  return wgmma::SwizzledOffset(kDecodeTile, row, chunk) / 2;
}

// kTma: each warp's lane 0 loads a tile (one page of 16 positions when block_size == 16) as
// copy-engine boxes of 64 head dims into the warp's ring slot, completing on the slot's
// mbarrier; otherwise the lanes cp.async it in 16-byte pieces.
template <int kHd, int kDecodeWarps, int kDecodeStages, bool kTma>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    DecodeAttentionKernel(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                          const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, int cache_rows, int num_heads,
                          int num_kv_heads, int block_size, TokenMeta tokens, SegmentMeta segs,
                          float scale_log2, int splits, float* partial_acc, float2* partial_ml,
                          uint16_t* out, const uint16_t* out_gate) {
  constexpr int kChunks = kHd / 8;  // 16-byte chunks per K/V row
  constexpr int kSteps = kHd / 16;  // k-steps of S^T, m-tiles of O^T
  constexpr int kTileElems = kDecodeTile * kHd;
  constexpr int kHs = kHd + 4;  // padded head stride of the merge buffer (floats)
  extern __shared__ uint4 decode_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, qd = lane & 3;  // fragment row / column pair
  uint8_t* ring_base = reinterpret_cast<uint8_t*>(decode_smem);
  ring_base += (1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(ring_base)) & 1023)) & 1023;
  uint16_t* k_ring = reinterpret_cast<uint16_t*>(ring_base) +
                     static_cast<size_t>(warp) * 2 * kDecodeStages * kTileElems;
  uint16_t* v_ring = k_ring + kDecodeStages * kTileElems;
  __shared__ alignas(8) uint64_t ring_full[kDecodeWarps][kDecodeStages];
  auto slot_bar = [&](int i) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(&ring_full[warp][i % kDecodeStages]));
  };
  if (kTma) {
    if (lane == 0) {
      for (int i = 0; i < kDecodeStages; ++i) BarrierInit(slot_bar(i), 1);
      wgmma::FenceProxyAsync();
    }
    __syncwarp();
  }

  // The step's metadata and block tables are staged by copies, not by kernels, and the cache rows
  // before the segment's first new position were written by earlier steps: all readable before
  // PdlWait. Only q and the rows of this step's tokens come from the predecessor (the KV write).
  const int split = blockIdx.x, kvh = blockIdx.y;
  const int64_t t = blockIdx.z;
  const int group = num_heads / num_kv_heads;
  const int seg = tokens.token_segment[t];
  const int num_pos = tokens.token_position[t] + 1;
  const int first_new = segs.cached_tokens[seg];
  // Splits cover whole 16-position tiles; trailing splits may be empty.
  const int chunk = ((num_pos + splits - 1) / splits + kDecodeTile - 1) / kDecodeTile * kDecodeTile;
  const int begin = min(num_pos, split * chunk), end = min(num_pos, begin + chunk);
  const int32_t* table = segs.block_tables + segs.block_table_begin[seg];
  const int num_tiles = (end - begin + kDecodeTile - 1) / kDecodeTile;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + kDecodeWarps - 1) / kDecodeWarps : 0;

  // Row (in units of kHd elements) of position p0 + (lane & 15) of the warp's i-th tile, -1 past
  // the split: each lane of a half-warp looks one position up, and the copies take the rows by
  // shuffle. The table reads for tile i + kDecodeStages are issued one iteration before its copy.
  // With kTma every lane gets the tile's page (its first position's row in the caches' position
  // dimension) instead.
  auto tile_rows = [&](int i) -> int64_t {
    const int p0 = begin + (warp + kDecodeWarps * i) * kDecodeTile;
    if constexpr (kTma) {
      return i < my_tiles ? static_cast<int64_t>(table[p0 / kDecodeTile]) * kDecodeTile : -1;
    } else {
      const int p = p0 + (lane & (kDecodeTile - 1));
      if (i >= my_tiles || p >= end) return -1;
      return (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) *
                 num_kv_heads +
             kvh;
    }
  };
  auto load_tile = [&](int i, int64_t rows) {  // into ring slot i % kDecodeStages
    uint16_t* kd = k_ring + (i % kDecodeStages) * kTileElems;
    uint16_t* vd = v_ring + (i % kDecodeStages) * kTileElems;
    if constexpr (kTma) {
      if (lane == 0) {
        const uint32_t bar = slot_bar(i);
        const uint32_t k_dst = static_cast<uint32_t>(__cvta_generic_to_shared(kd));
        const uint32_t v_dst = static_cast<uint32_t>(__cvta_generic_to_shared(vd));
        wgmma::FenceProxyAsync();  // the lanes' ldmatrix reads of this slot came first
        BarrierArriveExpect(bar, 2 * kTileElems * 2);
#pragma unroll
        for (int cb = 0; cb < kHd / 64; ++cb) {
          TensorLoad3d(k_dst + cb * kDecodeTile * 128, &k_map, cb * 64, kvh, static_cast<int>(rows),
                       bar);
          TensorLoad3d(v_dst + cb * kDecodeTile * 128, &v_map, cb * 64, kvh, static_cast<int>(rows),
                       bar);
        }
      }
    } else {
#pragma unroll
      for (int c = lane; c < kDecodeTile * kChunks; c += 32) {
        const int r = c / kChunks, ch = c % kChunks;
        const int64_t row = __shfl_sync(0xffffffffu, rows, r);
        const bool valid = row >= 0;
        const int64_t src = (valid ? row : 0) * kHd + ch * 8;
        const int dst = SlotOffset(r, ch);
        CopyAsync16(kd + dst, k_cache + src, valid);
        CopyAsync16(vd + dst, v_cache + src, valid);
      }
    }
  };

  float o[kSteps][4];  // O^T: m-tile mt holds dims 16 mt + g (+8), heads 2 qd (+1)
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[mt][e] = 0.0f;
  }
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // heads 2 qd, 2 qd + 1 (log2 units)

  {
    // The ring's first tiles: those wholly before first_new are requested before PdlWait, so that
    // at one token per sequence the history streams while the QK-norm kernel still runs.
    int64_t rows[kDecodeStages - 1];
#pragma unroll
    for (int i = 0; i < kDecodeStages - 1; ++i) rows[i] = tile_rows(i);
    int early = 0;
#pragma unroll
    for (int i = 0; i < kDecodeStages - 1; ++i) {
      const int tile_end = min(end, begin + (warp + kDecodeWarps * i + 1) * kDecodeTile);
      if (early == i && i < my_tiles && tile_end <= first_new) {
        load_tile(i, rows[i]);
        CopyAsyncCommit();
        ++early;
      }
    }
    // Every block waits before it triggers (and none returns before): DecodeCombineKernel reads
    // the output gate, two launches back, before its own PdlWait on that ordering.
    PdlWait();
    PdlTrigger();
#pragma unroll
    for (int i = 0; i < kDecodeStages - 1; ++i) {
      if (i < early) continue;
      if (i < my_tiles) load_tile(i, rows[i]);
      CopyAsyncCommit();
    }
  }
  // Q^T as B fragments: head g, dims kk * 16 + 2 qd (+1) and + 8 (zero for heads past the group).
  uint32_t qf[kSteps][2];
  {
    const bool valid = g < group;
    const uint16_t* qp = q + (t * num_heads + kvh * group + (valid ? g : 0)) * kHd + 2 * qd;
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      qf[kk][0] = valid ? *reinterpret_cast<const uint32_t*>(qp + kk * 16) : 0u;
      qf[kk][1] = valid ? *reinterpret_cast<const uint32_t*>(qp + kk * 16 + 8) : 0u;
    }
  }
  int64_t rows_next = tile_rows(kDecodeStages - 1);
  for (int i = 0; i < my_tiles; ++i) {
    if (i + kDecodeStages - 1 < my_tiles) load_tile(i + kDecodeStages - 1, rows_next);
    CopyAsyncCommit();
    rows_next = tile_rows(i + kDecodeStages);
    if (kTma) {
      BarrierWait(slot_bar(i), (i / kDecodeStages) & 1);
    } else {
      CopyAsyncWait<kDecodeStages - 1>();
      __syncwarp();
    }
    const uint16_t* kt = k_ring + (i % kDecodeStages) * kTileElems;
    const uint16_t* vt = v_ring + (i % kDecodeStages) * kTileElems;
    const int p0 = begin + (warp + kDecodeWarps * i) * kDecodeTile;
    const int mi = lane >> 3;

    // S^T = K Q^T: c0/c1 position g, heads 2 qd / 2 qd + 1; c2/c3 position g + 8. Two
    // accumulator chains (even and odd k-steps) halve the dependent mma latency.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      uint32_t a[4];
      LoadMatrixX4(a, kt + SlotOffset((mi & 1) * 8 + (lane & 7), kk * 2 + (mi >> 1)));
      MmaBf16(kk % 2 == 0 ? s : s2, a, qf[kk][0], qf[kk][1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] += s2[e];
    const bool lo_ok = p0 + g < end, hi_ok = p0 + g + 8 < end;
    float x[4];
    x[0] = lo_ok ? s[0] * scale_log2 : -INFINITY;
    x[1] = lo_ok ? s[1] * scale_log2 : -INFINITY;
    x[2] = hi_ok ? s[2] * scale_log2 : -INFINITY;
    x[3] = hi_ok ? s[3] * scale_log2 : -INFINITY;
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(x[h], x[h + 2]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m[h], mx);  // finite: the tile has a valid position
      corr[h] = exp2f(m[h] - m_new);        // 0 while m[h] is -inf
      x[h] = exp2f(x[h] - m_new);
      x[h + 2] = exp2f(x[h + 2] - m_new);
      l[h] = l[h] * corr[h] + x[h] + x[h + 2];
      m[h] = m_new;
    }
    // Once the maxima settle most tiles leave them unchanged: skip the multiplies then.
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
      for (int mt = 0; mt < kSteps; ++mt) {
        o[mt][0] *= corr[0];
        o[mt][1] *= corr[1];
        o[mt][2] *= corr[0];
        o[mt][3] *= corr[1];
      }
    }
    // P^T fragments: k = positions 2 qd (+1) and + 8, n = head g.
    const uint32_t b0 = TransposeBf16x8x8(PackBf16x2(x[0], x[1]));
    const uint32_t b1 = TransposeBf16x8x8(PackBf16x2(x[2], x[3]));
#pragma unroll
    for (int mt = 0; mt < kSteps; ++mt) {
      uint32_t a[4];  // V^T: dims 16 mt (+8) x positions (+8), transposed on load
      LoadMatrixX4Trans(a, vt + SlotOffset((mi >> 1) * 8 + (lane & 7), mt * 2 + (mi & 1)));
      MmaBf16(o[mt], a, b0, b1);
    }
    __syncwarp();  // the ring slot is refilled by a later iteration's copy
  }
  CopyAsyncWait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
  }
  // Merge the warps: softmax states through shared memory, then each warp's O^T scaled to the
  // common max into its own [head][dim] buffer, summed by the whole block.
  __shared__ float m_s[kDecodeWarps][kDecodeMaxGroup], l_s[kDecodeWarps][kDecodeMaxGroup];
  __shared__ float m_all_s[kDecodeMaxGroup], l_all_s[kDecodeMaxGroup];
  __syncthreads();  // every warp is done with its ring (the merge buffer overlaps it)
  if (g == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_s[warp][2 * qd + h] = m[h];
      l_s[warp][2 * qd + h] = l[h];
    }
  }
  __syncthreads();
  float* merge =
      reinterpret_cast<float*>(decode_smem) + static_cast<size_t>(warp) * kDecodeMaxGroup * kHs;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * qd + h;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m_all = fmaxf(m_all, m_s[w][head]);
    const float f = m[h] == -INFINITY ? 0.0f : exp2f(m[h] - m_all);
    if (warp == 0 && g == 0) {
      float l_all = 0.0f;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        l_all += m_s[w][head] == -INFINITY ? 0.0f : l_s[w][head] * exp2f(m_s[w][head] - m_all);
      }
      m_all_s[head] = m_all;
      l_all_s[head] = l_all;
    }
#pragma unroll
    for (int mt = 0; mt < kSteps; ++mt) {
      merge[head * kHs + mt * 16 + g] = o[mt][h] * f;
      merge[head * kHs + mt * 16 + g + 8] = o[mt][h + 2] * f;
    }
  }
  __syncthreads();
  const float* merged = reinterpret_cast<const float*>(decode_smem);
  constexpr int kWarpStride = kDecodeMaxGroup * kHs;
  for (int e = threadIdx.x; e < group * kChunks; e += kDecodeWarps * 32) {
    const int head = e / kChunks, d0 = (e % kChunks) * 8;
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; j += 4) {
      float4 a = *reinterpret_cast<const float4*>(merged + head * kHs + d0 + j);
#pragma unroll
      for (int w = 1; w < kDecodeWarps; ++w) {
        const float4 b =
            *reinterpret_cast<const float4*>(merged + w * kWarpStride + head * kHs + d0 + j);
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
      }
      acc[j] = a.x;
      acc[j + 1] = a.y;
      acc[j + 2] = a.z;
      acc[j + 3] = a.w;
    }
    const int64_t row = t * num_heads + kvh * group + head;
    if (splits == 1) {
      const float inv = l_all_s[head] > 0.0f ? 1.0f / l_all_s[head] : 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] *= inv;
      if (out_gate != nullptr) {
        float gv[8];
        UnpackBf16x8(*reinterpret_cast<const uint4*>(out_gate + row * kHd + d0), gv);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = GatedOutput(acc[j], gv[j]);
      }
      *reinterpret_cast<uint4*>(out + row * kHd + d0) = PackBf16x8(acc);
    } else {
      float* dst = partial_acc + (row * splits + split) * kHd + d0;
      *reinterpret_cast<float4*>(dst) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
      if (d0 == 0) partial_ml[row * splits + split] = make_float2(m_all_s[head], l_all_s[head]);
    }
  }
}

// Merges the decode splits of one (token, head) row: block (row, 64-dim slice); thread
// (split group, 4 dims) sums its splits' partials, scaled to the common max, in float4s.
constexpr int kCombineThreads = 256;
constexpr int kCombineDims = 64;
constexpr int kCombineMaxSplits = 256;
// Up to this many splits (two per lane) every warp forms the common max and the softmax sum
// itself with shuffles, and each thread's partials are requested right after PdlWait together
// with the (m, l) pairs: one round trip to L2 and one block barrier after the wait instead of
// three round trips (pairs, then partials, then the gate) and five barriers. The split
// heuristic stays at or below kCombineMaxSplits / 4 = 64; more (MOBIUS_DECODE_SPLITS) take the
// block-wide path.
constexpr int kCombineWarpSplits = 64;
constexpr int kCombineGroups = kCombineThreads / (kCombineDims / 4);  // split groups
static_assert(kCombineWarpSplits == 64 && kCombineWarpSplits % kCombineGroups == 0);

template <int kHd>
__global__ void __launch_bounds__(kCombineThreads)
    DecodeCombineKernel(const float* partial_acc, const float2* partial_ml, int splits,
                        uint16_t* out, const uint16_t* out_gate) {
  constexpr int kCols = kCombineDims / 4;  // float4 columns of the slice
  constexpr int kGroups = kCombineGroups;
  __shared__ float f_s[kCombineMaxSplits];
  __shared__ float red[32];
  __shared__ float4 sum_s[kGroups][kCols];
  const int64_t row = blockIdx.x;
  const int d0 = blockIdx.y * kCombineDims;
  const int lane = threadIdx.x & 31;
  const int col = threadIdx.x % kCols, grp = threadIdx.x / kCols;
  const int64_t at = row * kHd + d0 + 4 * threadIdx.x;  // (threads < kCols only)
  // The gate comes from the QK-norm kernel, two launches back: readable before PdlWait.
  uint2 g = make_uint2(0, 0);
  if (out_gate != nullptr && threadIdx.x < kCols)
    g = *reinterpret_cast<const uint2*>(out_gate + at);
  PdlWait();
  PdlTrigger();
  const float2* ml = partial_ml + row * splits;
  const float* base = partial_acc + row * splits * kHd + d0 + 4 * col;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float l_all;
  if (splits <= kCombineWarpSplits) {
    constexpr int kMine = kCombineWarpSplits / kGroups;  // partials per thread at most
    float4 v[kMine];
#pragma unroll
    for (int j = 0; j < kMine; ++j) {
      const int s = grp + j * kGroups;
      v[j] = s < splits ? *reinterpret_cast<const float4*>(base + static_cast<int64_t>(s) * kHd)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const float2 lo = lane < splits ? ml[lane] : make_float2(-INFINITY, 0.0f);
    const float2 hi = lane + 32 < splits ? ml[lane + 32] : make_float2(-INFINITY, 0.0f);
    // The block-wide path's values exactly: a max is exact in any order, and its sum adds the
    // sums of warps 0 and 1 (splits 0-31 and 32-63 there) and zeros.
    const float m_all = WarpMax(fmaxf(lo.x, hi.x));
    const float f_lo = lo.x == -INFINITY ? 0.0f : exp2f(lo.x - m_all);
    const float f_hi = hi.x == -INFINITY ? 0.0f : exp2f(hi.x - m_all);
    // Rounded products, as the block-wide path's sum receives them (no multiply-add fused into
    // the shuffle tree's first step).
    l_all = WarpSum(__fmul_rn(lo.y, f_lo)) + WarpSum(__fmul_rn(hi.y, f_hi));
#pragma unroll
    for (int j = 0; j < kMine; ++j) {
      const int s = grp + j * kGroups;  // < 32 exactly for j < 32 / kGroups (grp < kGroups)
      const float f = __shfl_sync(0xffffffffu, j * kGroups < 32 ? f_lo : f_hi, s & 31);
      if (s < splits) {
        acc.x += v[j].x * f;
        acc.y += v[j].y * f;
        acc.z += v[j].z * f;
        acc.w += v[j].w * f;
      }
    }
  } else {
    float mloc = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += kCombineThreads) mloc = fmaxf(mloc, ml[s].x);
    const float m_all = BlockMax(mloc, red);
    float lloc = 0.0f;
    for (int s = threadIdx.x; s < splits; s += kCombineThreads) {
      const float2 p = ml[s];
      const float f = p.x == -INFINITY ? 0.0f : exp2f(p.x - m_all);
      f_s[s] = f;
      lloc += p.y * f;
    }
    l_all = BlockSum(lloc, red);  // its barriers also publish f_s
#pragma unroll 4
    for (int s = grp; s < splits; s += kGroups) {
      const float4 p = *reinterpret_cast<const float4*>(base + static_cast<int64_t>(s) * kHd);
      const float f = f_s[s];
      acc.x += p.x * f;
      acc.y += p.y * f;
      acc.z += p.z * f;
      acc.w += p.w * f;
    }
  }
  sum_s[grp][col] = acc;
  __syncthreads();
  if (threadIdx.x < kCols) {
    float4 a = sum_s[0][threadIdx.x];
    for (int j = 1; j < kGroups; ++j) {
      const float4 b = sum_s[j][threadIdx.x];
      a.x += b.x;
      a.y += b.y;
      a.z += b.z;
      a.w += b.w;
    }
    const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;
    float y[4] = {a.x * inv, a.y * inv, a.z * inv, a.w * inv};
    if (out_gate != nullptr) {
      const float gv[4] = {__uint_as_float(g.x << 16), __uint_as_float(g.x & 0xffff0000u),
                           __uint_as_float(g.y << 16), __uint_as_float(g.y & 0xffff0000u)};
#pragma unroll
      for (int j = 0; j < 4; ++j) y[j] = GatedOutput(y[j], gv[j]);
    }
    uint2 packed;
    packed.x = PackBf16x2(y[0], y[1]);
    packed.y = PackBf16x2(y[2], y[3]);
    *reinterpret_cast<uint2*>(out + at) = packed;
  }
}

// Warps per block x ring stages of the decode kernel. At head dim 256, 4 x 3 (192 KB of rings)
// leaves one block per SM and 3 x 2 (96 KB) two. Measured on the H200 (graph-replayed us, two
// alternations in one call, session 30; performance.md, thirtieth version): 4 x 3 is faster while
// the grid fits one wave (B1 ctx1K 5.9 against 6.4, B64 ctx1K 33.8 against 36.3: more warps per
// SM), 3 x 2 once it spans several (B256 ctx1K 132.1 -> 127.5): a block's
// start (table lookups, first copies) and end (the warps' merge) then overlap the other resident
// block's stream instead of leaving the SM's loads idle. MOBIUS_DECODE_CFG=4x3, 4x2, 6x2 or 3x2
// forces one (timing).
struct DecodeConfig {
  int warps, stages;
};
constexpr DecodeConfig kDecodeOneWave{4, 3};
constexpr DecodeConfig kDecodeManyWaves{3, 2};
// Grids of at least this many blocks per SM take kDecodeManyWaves.
constexpr int kDecodeManyWavesBlocksPerSm = 3;

// The configuration MOBIUS_DECODE_CFG forces; warps == 0 when it is left to the grid size.
DecodeConfig ForcedDecodeConfig() {
  static const DecodeConfig config = [] {
    switch (KnobChoice("MOBIUS_DECODE_CFG", {"4x3", "4x2", "6x2", "3x2"})) {
      case 1:
        return kDecodeOneWave;
      case 2:
        return DecodeConfig{4, 2};
      case 3:
        return DecodeConfig{6, 2};
      case 4:
        return kDecodeManyWaves;
      default:
        return DecodeConfig{0, 0};
    }
  }();
  return config;
}

// Only head dim 256 was measured; at smaller ones 4 x 3 already leaves several blocks per SM.
DecodeConfig DecodeConfigFor(int head_dim, int64_t num_tokens, int num_kv_heads, int splits,
                             int num_sms) {
  const DecodeConfig forced = ForcedDecodeConfig();
  if (forced.warps > 0) return forced;
  const int64_t blocks = num_tokens * num_kv_heads * splits;
  return head_dim == 256 && blocks >= int64_t{kDecodeManyWavesBlocksPerSm} * num_sms
             ? kDecodeManyWaves
             : kDecodeOneWave;
}

template <int kHd, int kWarps, int kStages>
void LaunchDecode(int64_t num_tokens, cudaStream_t stream, const uint16_t* q,
                  const uint16_t* k_cache, const uint16_t* v_cache, int64_t cache_blocks, int nh,
                  int nkv, int block_size, const TokenMeta& tokens, const SegmentMeta& segs,
                  float scale, int splits, void* scratch, uint16_t* out, const uint16_t* out_gate) {
  constexpr size_t kSmem = DecodeSmemBytes<kHd, kWarps, kStages>();
  static const bool configured = [] {
    return cudaFuncSetAttribute(DecodeAttentionKernel<kHd, kWarps, kStages, true>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kSmem)) == cudaSuccess &&
           cudaFuncSetAttribute(DecodeAttentionKernel<kHd, kWarps, kStages, false>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kSmem)) == cudaSuccess;
  }();
  if (!configured) CheckLaunch("DecodeAttention (shared memory attribute)");
  float* acc = static_cast<float*>(scratch);
  float2* ml = reinterpret_cast<float2*>(acc + num_tokens * nh * splits * kHd);
  const float scale_log2 = scale * 1.4426950408889634f;
  // The copy engine takes a tile as one page (block size 16). Measured on the H200 at the release
  // shapes (graph-replayed, us, copy engine / cp.async): B1 6.9 / 7.9 (ctx 1K), 10.8 / 13.0 (8K);
  // B8 10.3 / 11.0, 40.1 / 39.7; B64 37.6 / 36.9, 268.8 / 247.8; B256 133.4 / 132.5,
  // 1045.6 / 955.3: one lane's boxes win while a step is latency-bound, 16-byte copies from every
  // lane once it streams. MOBIUS_DECODE_TMA=0 / 1 forces one (comparisons).
  static const int tma_forced = KnobChoice("MOBIUS_DECODE_TMA", {"0", "1"}) - 1;
  const bool tma_wanted = tma_forced >= 0 ? tma_forced == 1 : num_tokens <= 16;
  const int64_t rows = cache_blocks * block_size;
  CUtensorMap k_map{}, v_map{};
  const bool tma = tma_wanted && block_size == kDecodeTile &&
                   EncodePagedCacheMap(k_cache, rows, nkv, kHd, kDecodeTile, &k_map) &&
                   EncodePagedCacheMap(v_cache, rows, nkv, kHd, kDecodeTile, &v_map);
  LaunchPdl("DecodeAttentionKernel",
            tma ? DecodeAttentionKernel<kHd, kWarps, kStages, true>
                : DecodeAttentionKernel<kHd, kWarps, kStages, false>,
            dim3(splits, nkv, static_cast<unsigned>(num_tokens)), kWarps * 32, kSmem, stream, q,
            k_cache, v_cache, k_map, v_map, static_cast<int>(rows), nh, nkv, block_size, tokens,
            segs, scale_log2, splits, acc, ml, out, out_gate);
  CheckLaunch("DecodeAttention");
  if (splits > 1) {
    LaunchPdl("DecodeCombineKernel", DecodeCombineKernel<kHd>,
              dim3(static_cast<unsigned>(num_tokens * nh), kHd / kCombineDims), kCombineThreads, 0,
              stream, acc, ml, splits, out, out_gate);
    CheckLaunch("DecodeAttentionCombine");
  }
}

template <int kHd>
void LaunchDecodeFor(int64_t num_tokens, cudaStream_t stream, const uint16_t* q,
                     const uint16_t* k_cache, const uint16_t* v_cache, int64_t cache_blocks, int nh,
                     int nkv, int block_size, const TokenMeta& tokens, const SegmentMeta& segs,
                     float scale, int splits, void* scratch, uint16_t* out,
                     const uint16_t* out_gate, DecodeConfig c) {
  if (c.warps == 3) {
    LaunchDecode<kHd, 3, 2>(num_tokens, stream, q, k_cache, v_cache, cache_blocks, nh, nkv,
                            block_size, tokens, segs, scale, splits, scratch, out, out_gate);
  } else if (c.warps == 4 && c.stages == 2) {
    LaunchDecode<kHd, 4, 2>(num_tokens, stream, q, k_cache, v_cache, cache_blocks, nh, nkv,
                            block_size, tokens, segs, scale, splits, scratch, out, out_gate);
  } else if (c.warps == 6) {
    LaunchDecode<kHd, 6, 2>(num_tokens, stream, q, k_cache, v_cache, cache_blocks, nh, nkv,
                            block_size, tokens, segs, scale, splits, scratch, out, out_gate);
  } else {
    LaunchDecode<kHd, 4, 3>(num_tokens, stream, q, k_cache, v_cache, cache_blocks, nh, nkv,
                            block_size, tokens, segs, scale, splits, scratch, out, out_gate);
  }
}

}  // namespace

bool FlashAttentionSupports(int num_heads, int num_kv_heads, int head_dim) {
  // MOBIUS_ATTENTION=simt keeps the CUDA-core kernels (for comparisons).
  static const bool disabled = KnobChoice("MOBIUS_ATTENTION", {"simt"}) == 1;
  if (disabled || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return false;
  const int group = num_heads / num_kv_heads;
  return kFlashRows % group == 0 &&
         (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256);
}

int FlashAttentionTileTokens(int num_heads, int num_kv_heads) {
  return kFlashRows / (num_heads / num_kv_heads);
}

void LaunchFlashPagedAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                               int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                               int block_size, const TokenMeta& tokens, const SegmentMeta& segs,
                               float scale, int splits, float* partial, uint16_t* out,
                               cudaStream_t stream) {
  const int64_t tile_tokens = FlashAttentionTileTokens(num_heads, num_kv_heads);
  // Worst case over how the tokens split into segments: every segment adds one partial tile.
  const int64_t tiles = (num_tokens + tile_tokens - 1) / tile_tokens + segs.num_segments;
  const dim3 grid(static_cast<unsigned>(tiles), num_kv_heads, splits);
  switch (head_dim) {
    case 32:
      Launch<32>(grid, stream, q, k_cache, v_cache, num_heads, num_kv_heads, block_size, tokens,
                 segs, scale, splits, partial, out);
      break;
    case 64:
      Launch<64>(grid, stream, q, k_cache, v_cache, num_heads, num_kv_heads, block_size, tokens,
                 segs, scale, splits, partial, out);
      break;
    case 128:
      Launch<128>(grid, stream, q, k_cache, v_cache, num_heads, num_kv_heads, block_size, tokens,
                  segs, scale, splits, partial, out);
      break;
    default:
      Launch<256>(grid, stream, q, k_cache, v_cache, num_heads, num_kv_heads, block_size, tokens,
                  segs, scale, splits, partial, out);
      break;
  }
  CheckLaunch("FlashPagedAttention");
}

bool DecodeAttentionSupports(int64_t num_tokens, int num_segments, int num_heads, int num_kv_heads,
                             int head_dim) {
  // MOBIUS_ATTENTION_DECODE=0 keeps the tile kernel for decode steps too (comparisons).
  static const bool disabled = KnobChoice("MOBIUS_ATTENTION_DECODE", {"0", "1"}) == 1;
  if (disabled || !FlashAttentionSupports(num_heads, num_kv_heads, head_dim)) return false;
  return num_tokens <= num_segments && num_tokens <= 65535 &&
         num_heads / num_kv_heads <= kDecodeMaxGroup &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

int DecodeAttentionSplits(int64_t num_tokens, int num_kv_heads, int max_positions, int num_sms) {
  // Modelled for one block per SM (kDecodeOneWave, unless a configuration is forced; a grid of
  // several waves then runs two blocks per SM, which hides the fixed cost the model charges).
  // Cost in units of one round (every warp one 16-position tile): waves x (rounds + fixed cost of
  // a block) plus one round for the combine kernel; fewest splits on ties.
  // MOBIUS_DECODE_SPLITS=N forces N (timing).
  static const int forced = KnobInt("MOBIUS_DECODE_SPLITS", 0, 1, kCombineMaxSplits);
  if (forced > 0) return std::min(forced, kCombineMaxSplits);
  const DecodeConfig forced_config = ForcedDecodeConfig();
  const int warps = forced_config.warps > 0 ? forced_config.warps : kDecodeOneWave.warps;
  const int64_t pairs = num_tokens * num_kv_heads;
  const int positions = std::max(max_positions, 1);
  int best = 1;
  double best_cost = 0;
  for (int s = 1; s <= kCombineMaxSplits / 4; ++s) {
    const int chunk = ((positions + s - 1) / s + kDecodeTile - 1) / kDecodeTile * kDecodeTile;
    if (s > 1 && static_cast<int64_t>(s - 1) * chunk >= positions) break;  // an empty split
    const int64_t waves = (pairs * s + num_sms - 1) / num_sms;
    const int rounds = (chunk + kDecodeTile * warps - 1) / (kDecodeTile * warps);
    const double cost = static_cast<double>(waves) * (rounds + 1.5) + (s > 1 ? 1.0 : 0.0);
    if (s == 1 || cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

void LaunchDecodeAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                           int64_t cache_blocks, int64_t num_tokens, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, const TokenMeta& tokens,
                           const SegmentMeta& segs, float scale, int splits, int num_sms,
                           void* scratch, uint16_t* out, cudaStream_t stream,
                           const uint16_t* out_gate) {
  const DecodeConfig c = DecodeConfigFor(head_dim, num_tokens, num_kv_heads, splits, num_sms);
  switch (head_dim) {
    case 64:
      LaunchDecodeFor<64>(num_tokens, stream, q, k_cache, v_cache, cache_blocks, num_heads,
                          num_kv_heads, block_size, tokens, segs, scale, splits, scratch, out,
                          out_gate, c);
      break;
    case 128:
      LaunchDecodeFor<128>(num_tokens, stream, q, k_cache, v_cache, cache_blocks, num_heads,
                           num_kv_heads, block_size, tokens, segs, scale, splits, scratch, out,
                           out_gate, c);
      break;
    default:
      LaunchDecodeFor<256>(num_tokens, stream, q, k_cache, v_cache, cache_blocks, num_heads,
                           num_kv_heads, block_size, tokens, segs, scale, splits, scratch, out,
                           out_gate, c);
      break;
  }
}

}  // namespace mobius::kernels::cuda
