// Paged causal GQA attention for prefill on Hopper's warpgroup tensor cores (wgmma, sm_90a).
//
// A block of three warpgroups takes 128 query rows of one kv head: (token, query head of the kv
// head's group) pairs, so a 16/2-head model covers 16 tokens per block. A producer warpgroup
// gathers K/V tiles of 80 (or 64) positions through the block table into a double-buffered,
// 128-byte-swizzled staging area (wgmma.cuh), with the copy engine (TMA) where the block size
// allows and cp.async otherwise. Two consumer warpgroups keep their 64 Q rows in shared memory
// and per tile run S = Q K^T as m64nKk16 (both operands from shared memory), the online softmax
// on the accumulators in registers (exp2 domain), then O += P V as m64nHk16 with P taken straight
// from the S accumulators as register A fragments and V read N-major (transposed) from shared
// memory: neither S nor P touches shared memory.
//
// Only whole prefill steps come here (one split: the launcher falls back to the mma.sync kernel
// of flash_attention.cu when positions are split over blocks). Blocks take their tile from a walk
// over the segments, heaviest (latest) tiles first, so that the causal triangle's long rows do
// not trail the grid.
#include <cuda.h>
#include <cuda_bf16.h>

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

constexpr int kPrefillThreads = 384;  // a producer and two consumer warpgroups
constexpr int kPrefillRows = 128;     // query rows per block, 64 per consumer warpgroup
constexpr int kStages = 2;            // K (and V) tiles in flight

// Shared memory: slack to align to the 1024-byte swizzle period, 2 KB of barriers and producer
// row offsets, Q, kStages K tiles, kStages V tiles. kHd 256 with 80-position tiles fills the
// 227 KB a block may have exactly.
template <int kHd, int kKv>
constexpr int PrefillSmemBytes() {
  return 1024 + 2048 + kPrefillRows * kHd * 2 + 2 * kStages * kKv * kHd * 2;
}

// 2^x in one MUFU.EX2 (2^-inf = 0).
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <int kKv>
__device__ __forceinline__ void WgmmaQK(float (&s)[kKv / 2], uint64_t desc_q, uint64_t desc_k,
                                        bool first) {
  if constexpr (kKv == 80) {
    if (first) {
      wgmma::WgmmaSS_m64n80k16_First(s, desc_q, desc_k);
    } else {
      wgmma::WgmmaSS_m64n80k16(s, desc_q, desc_k, 1);
    }
  } else {
    if (first) {
      wgmma::WgmmaSS_m64n64k16_First(s, desc_q, desc_k);
    } else {
      wgmma::WgmmaSS_m64n64k16(s, desc_q, desc_k, 1);
    }
  }
}

template <int kHd>
__device__ __forceinline__ void WgmmaPV(float (&o)[kHd / 2], const uint32_t (&a)[4],
                                        uint64_t desc) {
  if constexpr (kHd == 256) {
    wgmma::WgmmaRS_m64n256k16(o, a, desc, 1);
  } else if constexpr (kHd == 128) {
    wgmma::WgmmaRS_m64n128k16(o, a, desc, 1);
  } else {
    wgmma::WgmmaRS_m64n64k16(o, a, desc, 1);
  }
}

// The b-th query tile, heaviest first (blocks start in index order, and a tile's cost grows with
// its position): walking the segments backwards, the b-th of their ceil(tokens / tile_tokens)
// tiles counted from each segment's last. False for a surplus block of the worst-case grid.
struct QueryTile {
  int seg, tok0, ntok;
};
__device__ __forceinline__ bool FindQueryTile(const SegmentMeta& segs, int tile_tokens, int b,
                                              QueryTile* tile) {
  for (int s = segs.num_segments - 1; s >= 0; --s) {
    const int n = segs.num_tokens[s];
    const int tiles = (n + tile_tokens - 1) / tile_tokens;
    if (b < tiles) {
      const int t = tiles - 1 - b;
      *tile = QueryTile{s, segs.token_begin[s] + t * tile_tokens,
                        min(tile_tokens, n - t * tile_tokens)};
      return true;
    }
    b -= tiles;
  }
  return false;
}

// Row (token * num_heads + head) of query row r of a tile: r / group tokens in, head r % group of
// kv head `kvh`.
__device__ __forceinline__ int64_t QueryRow(int tok0, int r, int group, int num_heads, int kvh) {
  return static_cast<int64_t>(tok0 + r / group) * num_heads + kvh * group + r % group;
}

// Element offset in the caches of position p's row of kv head `kvh` (through the block table), -1
// past num_pos.
__device__ __forceinline__ int64_t KvRowOffset(const int32_t* table, int block_size,
                                               int num_kv_heads, int kvh, int head_dim, int p,
                                               int num_pos) {
  if (p >= num_pos) return -1;
  return ((static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) *
              num_kv_heads +
          kvh) *
         head_dim;
}

// cp.async copies of one K/V tile (kKv positions of each) into one swizzled stage by the
// producer's 128 threads (this is `t`); rows[r] is position r's element offset in the caches, -1
// for a position past the end (zeros).
template <int kHd, int kKv>
__device__ __forceinline__ void CopyKvTile(const uint16_t* k_cache, const uint16_t* v_cache,
                                           const int64_t* rows, uint32_t k_dst, uint32_t v_dst,
                                           int t) {
  constexpr int kChunks = kHd / 8;
  for (int c = t; c < kKv * kChunks; c += 128) {
    const int r = c / kChunks, ch = c % kChunks;
    const int64_t row = rows[r];
    const bool valid = row >= 0;
    const int64_t src = (valid ? row : 0) + ch * 8;
    const uint32_t off = wgmma::SwizzledOffset(kKv, r, ch);
    CopyAsync16(k_dst + off, k_cache + src, valid);
    CopyAsync16(v_dst + off, v_cache + src, valid);
  }
}

// The online-softmax step of one warpgroup over one tile's scores s (raw Q K^T): masks positions
// past each row's own (only where the tile reaches past the block's first query position), folds
// the tile into the row maxima m and sums l (log2 units), overwrites s with P = 2^(s c - m) and
// returns in corr the factor the rows' O must be scaled by (false: all 1). Element
// n * 4 + i * 2 + e of s is row lane / 4 + 8 i of the warp's 16, position n * 8 + 2 (lane % 4) + e.
// A row with nothing unmasked yet keeps m = -inf and uses 0 in the exponent, so its P are 0.
template <int kKv>
__device__ __forceinline__ bool SoftmaxStep(float (&s)[kKv / 2], int p0, int first_pos,
                                            const int (&row_pos)[2], int lane, float scale_log2,
                                            float (&m)[2], float (&l)[2], float (&corr)[2]) {
  if (p0 + kKv - 1 > first_pos) {
#pragma unroll
    for (int n = 0; n < kKv / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (p0 + n * 8 + 2 * (lane & 3) + e > row_pos[i]) s[n * 4 + i * 2 + e] = -INFINITY;
        }
      }
    }
  }
  bool rescale = false;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < kKv / 8; ++n) mx = fmaxf(mx, fmaxf(s[n * 4 + i * 2], s[n * 4 + i * 2 + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[i], mx * scale_log2);  // scale_log2 > 0 commutes with max
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    corr[i] = FastExp2(m[i] - m_use);
    rescale |= m_new != m[i];
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < kKv / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int idx = n * 4 + i * 2 + e;
        s[idx] = FastExp2(fmaf(s[idx], scale_log2, -m_use));
        sum += s[idx];
      }
    }
    l[i] = l[i] * corr[i] + sum;
    m[i] = m_new;
  }
  // Once the row maxima settle most tiles leave them unchanged; the caller skips the rescale.
  return __any_sync(0xffffffffu, rescale);
}

// P (fp32, the S layout) as bf16 A fragments: k-step ks of P V covers positions 16 ks .. 16 ks +
// 15 (n-tiles 2 ks, 2 ks + 1), which is s[8 ks .. 8 ks + 7] in the m16n8k16 A order.
template <int kKv>
__device__ __forceinline__ void PackP(const float (&s)[kKv / 2], uint32_t (&pa)[kKv / 16][4]) {
#pragma unroll
  for (int ks = 0; ks < kKv / 16; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[ks][r] = PackBf16x2(s[8 * ks + 2 * r], s[8 * ks + 2 * r + 1]);
    wgmma::FenceRegisters(pa[ks]);
  }
}

template <int kHd>
__device__ __forceinline__ void ScaleRows(float (&o)[kHd / 2], const float (&corr)[2]) {
#pragma unroll
  for (int n = 0; n < kHd / 8; ++n) {
    o[n * 4 + 0] *= corr[0];
    o[n * 4 + 1] *= corr[0];
    o[n * 4 + 2] *= corr[1];
    o[n * 4 + 3] *= corr[1];
  }
}

// Issues S = Q K^T for one warpgroup (kHd / 16 wgmma k-steps, committed as one group). `q_wg`:
// the warpgroup's 64 rows of the swizzled Q tile (kPrefillRows rows per column block).
template <int kHd, int kKv>
__device__ __forceinline__ void IssueQK(uint32_t q_wg, uint32_t k_tile, float (&s)[kKv / 2]) {
  wgmma::Fence();
#pragma unroll
  for (int kk = 0; kk < kHd / 16; ++kk) {
    const uint32_t q_desc = q_wg + (kk / 4) * kPrefillRows * 128 + (kk % 4) * 32;
    const uint32_t k_desc = k_tile + (kk / 4) * kKv * 128 + (kk % 4) * 32;
    WgmmaQK<kKv>(s, wgmma::KMajorDescriptor(q_desc), wgmma::KMajorDescriptor(k_desc), kk == 0);
  }
  wgmma::Commit();
}

// Issues O += P V for one warpgroup (kKv / 16 k-steps, one group).
template <int kHd, int kKv>
__device__ __forceinline__ void IssuePV(uint32_t v_tile, const uint32_t (&pa)[kKv / 16][4],
                                        float (&o)[kHd / 2]) {
  wgmma::Fence();
#pragma unroll
  for (int ks = 0; ks < kKv / 16; ++ks) {
    WgmmaPV<kHd>(o, pa[ks], wgmma::NMajorDescriptor(v_tile + ks * 16 * 128, kKv));
  }
  wgmma::Commit();
}

// Normalises a warpgroup's O rows by their softmax sums and writes them (bf16).
template <int kHd>
__device__ __forceinline__ void StoreRows(const float (&o)[kHd / 2], float (&l)[2], int row0,
                                          int valid_rows, int tok0, int group, int num_heads,
                                          int kvh, int lane, uint16_t* out) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row0 + (lane >> 2) + 8 * i;
    if (r >= valid_rows) continue;
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    uint16_t* dst = out + QueryRow(tok0, r, group, num_heads, kvh) * kHd + 2 * (lane & 3);
#pragma unroll
    for (int n = 0; n < kHd / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + n * 8) =
          PackBf16x2(o[n * 4 + i * 2] * inv, o[n * 4 + i * 2 + 1] * inv);
    }
  }
}

// Warpgroup 0 produces (its registers lowered by setmaxnreg) into a kStages-deep ring; each stage
// has a "full" mbarrier and an "empty" one (the 256 consumer threads arrive once their products
// no longer read it). Two producers:
//  - kTma: one thread issues each tile as copy-engine boxes (cp.async.bulk.tensor) of one page
//    of one kv head and 64 head dims, from 3-D tensor maps over the caches; the boxes complete
//    as transaction bytes on "full" (armed by arrive.expect_tx). Needs block sizes that are a
//    multiple of 8 and divide the tile (TmaTakes).
//  - otherwise cp.async: threads below kKv look the tile's positions up through the block table
//    a tile ahead and publish the rows in shared memory; all 128 copy 16-byte pieces, and
//    cp.async.mbarrier.arrive makes the copies themselves arrive on "full".
// The copy engine took the 1 x 4K case from 309 to 265 us: the cp.async producer's ~40 copies
// and their address arithmetic per thread and tile competed with the consumers for issue slots.
//
// Warpgroups 1 and 2 consume, 64 query rows each, tile by tile: S = Q K^T, softmax, rescale,
// O += P V. They share no block barrier, so one's softmax runs under the other's products.
// Measured and dropped (1 x 4K, release shapes): issuing O += P(j-1) V(j-1) together with S(j)
// so that the softmax runs under a product, within a warpgroup (FA3's intra-warpgroup overlap,
// K and V of a stage released separately: 445 us) or as turns alternating between the two
// warpgroups on named barriers (ping-pong: 370 us), against 310 us for this plain order.
template <int kHd, int kKv, bool kTma>
__global__ void __launch_bounds__(kPrefillThreads, 1)
    PrefillAttentionKernel(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                           const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map, int cache_rows, int num_heads,
                           int num_kv_heads, int block_size, TokenMeta tokens, SegmentMeta segs,
                           float scale_log2, uint16_t* out) {
  constexpr int kChunks = kHd / 8;
  constexpr int kTileBytes = kKv * kHd * 2;
  extern __shared__ uint8_t prefill_smem[];
  const uint32_t raw = SharedAddress(prefill_smem);
  const uint32_t bars = (raw + 1023u) & ~1023u;  // full[kStages], empty[kStages]
  int64_t* rows_s = reinterpret_cast<int64_t*>(prefill_smem + (bars - raw) + 64);  // [2][kKv]
  const uint32_t q_s = bars + 2048;
  const uint32_t k_s = q_s + kPrefillRows * kHd * 2;  // [kStages][tile]
  const uint32_t v_s = k_s + kStages * kTileBytes;    // [kStages][tile]
  auto full = [&](int st) { return bars + 8 * st; };
  auto empty = [&](int st) { return bars + 8 * (kStages + st); };

  const int group = num_heads / num_kv_heads;
  const int kvh = blockIdx.x % num_kv_heads;
  QueryTile tile;
  if (!FindQueryTile(segs, kPrefillRows / group, blockIdx.x / num_kv_heads, &tile)) return;
  const int tok0 = tile.tok0;
  const int num_pos = tokens.token_position[tok0 + tile.ntok - 1] + 1;
  const int first_pos = tokens.token_position[tok0];
  const int32_t* table = segs.block_tables + segs.block_table_begin[tile.seg];
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wwarp = (tid >> 5) & 3;
  const int valid_rows = tile.ntok * group;
  const int num_tiles = (num_pos + kKv - 1) / kKv;

  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      BarrierInit(full(st), kTma ? 1 : 128);
      BarrierInit(empty(st), 256);
    }
  }
  __syncthreads();

  if (wg == 0 && kTma) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    // One thread issues the tile as boxes of (64 head dims, one kv head, one page of block_size
    // positions) per page and column block; a page past the segment's table is read from beyond
    // the tensor's last row, which the copy engine fills with zeros.
    if (tid != 0) return;
    const int pages = kKv / block_size, table_pages = (num_pos + block_size - 1) / block_size;
    constexpr uint32_t kTileTx = 2 * kTileBytes;
    for (int j = 0; j < num_tiles; ++j) {
      const int st = j % kStages;
      if (j >= kStages) BarrierWait(empty(st), (j / kStages - 1) & 1);
      BarrierArriveExpect(full(st), kTileTx);
      for (int i = 0; i < pages; ++i) {
        const int page = j * pages + i;
        const int row = page < table_pages ? table[page] * block_size : cache_rows;
        const uint32_t dst = st * kTileBytes + i * block_size * 128;
#pragma unroll
        for (int cb = 0; cb < kHd / 64; ++cb) {
          TensorLoad3d(k_s + dst + cb * kKv * 128, &k_map, cb * 64, kvh, row, full(st));
          TensorLoad3d(v_s + dst + cb * kKv * 128, &v_map, cb * 64, kvh, row, full(st));
        }
      }
    }
    return;
  }
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    // Threads below kKv each look up one position's row, a tile ahead (the load is in flight
    // while this tile's copies are issued), and publish it in rows_s[j % 2] for the copy loops;
    // alternating buffers need one producer barrier per tile.
    auto lookup = [&](int j) {
      return KvRowOffset(table, block_size, num_kv_heads, kvh, kHd, j * kKv + tid, num_pos);
    };
    int64_t next_row = tid < kKv ? lookup(0) : -1;
    for (int j = 0; j < num_tiles; ++j) {
      const int st = j % kStages;
      const uint32_t parity = (j / kStages - 1) & 1;
      int64_t* rows = rows_s + (j & 1) * kKv;
      if (tid < kKv) rows[tid] = next_row;
      asm volatile("bar.sync 3, 128;\n" ::: "memory");
      if (tid < kKv && j + 1 < num_tiles) next_row = lookup(j + 1);
      if (j >= kStages) BarrierWait(empty(st), parity);
      CopyKvTile<kHd, kKv>(k_cache, v_cache, rows, k_s + st * kTileBytes, v_s + st * kTileBytes,
                           tid);
      CopyAsyncArrive(full(st));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cwg = wg - 1, ct = tid - 128 * wg;  // consumer warpgroup, thread within it
  for (int c = ct; c < 64 * kChunks; c += 128) {
    const int r = cwg * 64 + c / kChunks, ch = c % kChunks;
    const bool valid = r < valid_rows;
    const int64_t row = valid ? QueryRow(tok0, r, group, num_heads, kvh) : 0;
    CopyAsync16(q_s + wgmma::SwizzledOffset(kPrefillRows, r, ch), q + row * kHd + ch * 8, valid);
  }
  CopyAsyncCommit();
  const int row0 = cwg * 64 + wwarp * 16;
  int row_pos[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row0 + (lane >> 2) + 8 * i;
    row_pos[i] = r < valid_rows ? tokens.token_position[tok0 + r / group] : -1;
  }
  float o[kHd / 2];
#pragma unroll
  for (int i = 0; i < kHd / 2; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, corr[2];
  float s[kKv / 2];
  uint32_t pa[kKv / 16][4];
  CopyAsyncWait<0>();
  wgmma::FenceProxyAsync();
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cwg) : "memory");  // the warpgroup's Q rows
  const uint32_t q_wg = q_s + cwg * 64 * 128;

  for (int j = 0; j < num_tiles; ++j) {
    const int st = j % kStages;
    BarrierWait(full(st), (j / kStages) & 1);
    wgmma::FenceProxyAsync();  // the copies were generic-proxy writes; wgmma reads async-proxy
    IssueQK<kHd, kKv>(q_wg, k_s + st * kTileBytes, s);
    wgmma::Wait<0>();
    wgmma::FenceRegisters(s);
    if (SoftmaxStep<kKv>(s, j * kKv, first_pos, row_pos, lane, scale_log2, m, l, corr)) {
      ScaleRows<kHd>(o, corr);
    }
    wgmma::FenceRegisters(o);
    PackP<kKv>(s, pa);
    IssuePV<kHd, kKv>(v_s + st * kTileBytes, pa, o);
    wgmma::Wait<0>();
    wgmma::FenceRegisters(o);
    BarrierArrive(empty(st));
  }
  StoreRows<kHd>(o, l, row0, valid_rows, tok0, group, num_heads, kvh, lane, out);
}

// Whether the copy engine can take a block size: whole pages per K/V tile, and each page's box
// starting on the 1024-byte swizzle period.
bool TmaTakes(int kv_tile, int block_size) {
  return block_size % 8 == 0 && block_size <= 256 && kv_tile % block_size == 0;
}

// K/V tile positions: 80 at head dim 256 (what fits twice beside Q in 227 KB) unless only 64
// suits the copy engine's pages, 64 below head dim 256.
int KvTile(int head_dim, int block_size) {
  if (head_dim != 256) return 64;
  return !TmaTakes(80, block_size) && TmaTakes(64, block_size) ? 64 : 80;
}

template <int kHd, int kKv>
void Launch(dim3 grid, cudaStream_t stream, const uint16_t* q, const uint16_t* k_cache,
            const uint16_t* v_cache, int64_t cache_blocks, int nh, int nkv, int block_size,
            const TokenMeta& tokens, const SegmentMeta& segs, float scale_log2, uint16_t* out) {
  constexpr int kSmem = PrefillSmemBytes<kHd, kKv>();
  static_assert(kSmem <= 232448, "more shared memory than a block may have");
  static const bool configured = [] {
    return cudaFuncSetAttribute(PrefillAttentionKernel<kHd, kKv, true>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kSmem) == cudaSuccess &&
           cudaFuncSetAttribute(PrefillAttentionKernel<kHd, kKv, false>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) == cudaSuccess;
  }();
  if (!configured) CheckLaunch("PrefillAttention (shared memory attribute)");
  // MOBIUS_PREFILL_TMA=0 keeps the cp.async producer (comparisons).
  static const bool tma_wanted = KnobChoice("MOBIUS_PREFILL_TMA", {"0", "1"}) != 1;
  const int64_t rows = cache_blocks * block_size;
  CUtensorMap k_map{}, v_map{};
  const bool tma = tma_wanted && TmaTakes(kKv, block_size) &&
                   EncodePagedCacheMap(k_cache, rows, nkv, kHd, block_size, &k_map) &&
                   EncodePagedCacheMap(v_cache, rows, nkv, kHd, block_size, &v_map);
  auto kernel =
      tma ? PrefillAttentionKernel<kHd, kKv, true> : PrefillAttentionKernel<kHd, kKv, false>;
  kernel<<<grid, kPrefillThreads, kSmem, stream>>>(q, k_cache, v_cache, k_map, v_map,
                                                   static_cast<int>(rows), nh, nkv, block_size,
                                                   tokens, segs, scale_log2, out);
}

}  // namespace

bool PrefillAttentionSupports(int num_heads, int num_kv_heads, int head_dim) {
  // MOBIUS_ATTENTION_PREFILL=mma keeps the mma.sync tile kernel for prefill (comparisons).
  static const bool disabled = KnobChoice("MOBIUS_ATTENTION_PREFILL", {"mma"}) == 1;
  if (disabled || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return false;
  static const int cc_major = [] {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      return 0;
    }
    return major;
  }();
  const int group = num_heads / num_kv_heads;
  return cc_major == 9 && kPrefillRows % group == 0 &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

void LaunchPrefillAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                            int64_t cache_blocks, int64_t num_tokens, int num_heads,
                            int num_kv_heads, int head_dim, int block_size, const TokenMeta& tokens,
                            const SegmentMeta& segs, float scale, uint16_t* out,
                            cudaStream_t stream) {
  const int64_t tile_tokens = kPrefillRows / (num_heads / num_kv_heads);
  // Worst case over how the tokens split into segments: every segment adds one partial tile.
  const int64_t tiles = (num_tokens + tile_tokens - 1) / tile_tokens + segs.num_segments;
  const dim3 grid(static_cast<unsigned>(tiles * num_kv_heads));  // kv head fastest
  const float scale_log2 = scale * 1.4426950408889634f;
  switch (head_dim) {
    case 64:
      Launch<64, 64>(grid, stream, q, k_cache, v_cache, cache_blocks, num_heads, num_kv_heads,
                     block_size, tokens, segs, scale_log2, out);
      break;
    case 128:
      Launch<128, 64>(grid, stream, q, k_cache, v_cache, cache_blocks, num_heads, num_kv_heads,
                      block_size, tokens, segs, scale_log2, out);
      break;
    default:
      if (KvTile(head_dim, block_size) == 64) {
        Launch<256, 64>(grid, stream, q, k_cache, v_cache, cache_blocks, num_heads, num_kv_heads,
                        block_size, tokens, segs, scale_log2, out);
      } else {
        Launch<256, 80>(grid, stream, q, k_cache, v_cache, cache_blocks, num_heads, num_kv_heads,
                        block_size, tokens, segs, scale_log2, out);
      }
      break;
  }
  CheckLaunch("PrefillAttention");
}

}  // namespace mobius::kernels::cuda
