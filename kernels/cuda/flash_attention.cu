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
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace mobius::kernels::cuda {
namespace {

constexpr int kFlashThreads = 128;  // 4 warps
constexpr int kFlashRows = 64;      // query rows per block, 16 per warp
constexpr int kKvTile = 32;         // positions per shared-memory K/V tile

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; `valid` false writes zeros (src-size 0 reads nothing).
__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(smem)),
               "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(smem)));
}
__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(smem)));
}

// c += a (16x16, row) * b (16x8, col), bf16 operands, fp32 accumulators.
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Swizzled element offset of (row, 16-byte chunk) in a [rows][kHd] bf16 tile.
template <int kHd>
__device__ __forceinline__ int TileOffset(int row, int chunk) {
  constexpr int kChunks = kHd / 8;
  constexpr int kSwizzle = kChunks < 8 ? kChunks : 8;
  return row * kHd + ((chunk ^ (row & (kSwizzle - 1))) * 8);
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
          Mma16816(s[np * 2], qf[kk], bk[0], bk[1]);
          Mma16816(s[np * 2 + 1], qf[kk], bk[2], bk[3]);
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
          Mma16816(o[dp * 2], a, bv[0], bv[1]);
          Mma16816(o[dp * 2 + 1], a, bv[2], bv[3]);
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

}  // namespace

bool FlashAttentionSupports(int num_heads, int num_kv_heads, int head_dim) {
  // MOBIUS_ATTENTION=simt keeps the CUDA-core kernels (for comparisons).
  static const bool disabled = [] {
    const char* v = std::getenv("MOBIUS_ATTENTION");
    return v != nullptr && std::strcmp(v, "simt") == 0;
  }();
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

}  // namespace mobius::kernels::cuda
