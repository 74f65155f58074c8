// Mixture-of-experts kernels: the device-side grouping of (token, expert) pairs by expert
// (counting sort), a grouped GEMM over the groups, the weighted combine, and the few-token
// kernels of decode steps (with the shared expert's rows, also beside the top-k). The router's
// top-k itself is in topk_softmax.cu. The grouped GEMM also serves as Linear's fallback when
// cuBLASLt offers no algorithm.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ranked_lists.cuh"
#include "kernels/cuda/topk_filter.cuh"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {
namespace {

constexpr int kScanThreads = 1024;

// ---------------------------------------------------------------------------------------------
// Grouped GEMM: C[row, n] = A[a_row(row), :] @ W_g[n, :]^T for the rows of each group g, with
// groups described by a tile table (tile -> group, first row; group -> end row). With kGateUp,
// W_g holds 2N rows [gate; up] and C = silu(A W_gate^T) * (A W_up^T).
// CUDA-core FMA tiles: the fallback for what the tensor-core kernel below does not take (H or I
// not a multiple of 8, operands not 16-byte aligned) and for Linear without a cuBLASLt algorithm.

constexpr int kBN = 64, kBK = 32, kGemmThreads = 256;

// Rows per tile: 8 when experts see few rows each (decode), 32 otherwise.
int TileRows(int64_t pairs, int64_t num_local) { return pairs >= 16 * num_local ? 32 : 8; }

struct GemmArgs {
  const uint16_t* a = nullptr;
  int64_t lda = 0;
  const int32_t* a_rows = nullptr;  // null: identity
  const uint16_t* w = nullptr;
  int64_t w_group_stride = 0;  // elements
  int64_t n = 0, k = 0;
  // Tile table; when tile_group is null there is one group of `m` rows.
  const int32_t* tile_group = nullptr;
  const int32_t* tile_row0 = nullptr;
  const int32_t* group_end = nullptr;  // [groups], exclusive end row of each group
  const int32_t* num_tiles = nullptr;
  int64_t m = 0;
  AnyMutPtr c;
  int64_t ldc = 0;
  bool vec =
      false;  // 16-byte loads: k, lda and the group stride are multiples of 8, a and w aligned
};

__device__ __forceinline__ void Unpack8(uint4 v, float* out) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// Thread (tx, ty) computes rows ty + kTY * ri and columns tx + kTX * ci of the tile.
template <bool kGateUp, int kBM>
__global__ void __launch_bounds__(kGemmThreads) GroupedGemmKernel(GemmArgs args) {
  constexpr int kTY = kBM < 16 ? kBM : 16, kTX = kGemmThreads / kTY;
  constexpr int kRM = kBM / kTY, kCN = kBN / kTX, kParts = kGateUp ? 2 : 1;
  __shared__ float a_s[kBK][kBM + 1];
  __shared__ float w_s[kParts][kBK][kBN + 1];
  const int64_t tile = blockIdx.x;
  int64_t group = 0, row0, row_end;
  if (args.tile_group != nullptr) {
    if (tile >= *args.num_tiles) return;
    group = args.tile_group[tile];
    row0 = args.tile_row0[tile];
    row_end = args.group_end[group];
  } else {
    row0 = tile * kBM;
    row_end = args.m;
  }
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const uint16_t* w = args.w + group * args.w_group_stride;
  const int tid = threadIdx.x, tx = tid % kTX, ty = tid / kTX;

  float acc[kParts][kRM][kCN] = {};
  for (int64_t k0 = 0; k0 < args.k; k0 += kBK) {
    if (args.vec) {
      for (int e = tid; e < kBM * (kBK / 8); e += kGemmThreads) {
        const int r = e / (kBK / 8), kk = (e % (kBK / 8)) * 8;
        const int64_t row = row0 + r, col = k0 + kk;
        float v[8] = {};
        if (row < row_end && col < args.k) {
          const int64_t src_row = args.a_rows != nullptr ? args.a_rows[row] : row;
          Unpack8(*reinterpret_cast<const uint4*>(args.a + src_row * args.lda + col), v);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) a_s[kk + i][r] = v[i];
      }
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        for (int e = tid; e < kBN * (kBK / 8); e += kGemmThreads) {
          const int c = e / (kBK / 8), kk = (e % (kBK / 8)) * 8;
          const int64_t n = n0 + c, col = k0 + kk;
          float v[8] = {};
          if (n < args.n && col < args.k) {
            Unpack8(*reinterpret_cast<const uint4*>(w + (part * args.n + n) * args.k + col), v);
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) w_s[part][kk + i][c] = v[i];
        }
      }
    } else {
      for (int e = tid; e < kBM * kBK; e += kGemmThreads) {
        const int r = e / kBK, kk = e % kBK;
        const int64_t row = row0 + r, col = k0 + kk;
        float v = 0.0f;
        if (row < row_end && col < args.k) {
          const int64_t src_row = args.a_rows != nullptr ? args.a_rows[row] : row;
          v = Bf16ToF32(args.a[src_row * args.lda + col]);
        }
        a_s[kk][r] = v;
      }
      for (int part = 0; part < kParts; ++part) {
        for (int e = tid; e < kBN * kBK; e += kGemmThreads) {
          const int c = e / kBK, kk = e % kBK;
          const int64_t n = n0 + c, col = k0 + kk;
          float v = 0.0f;
          if (n < args.n && col < args.k) v = Bf16ToF32(w[(part * args.n + n) * args.k + col]);
          w_s[part][kk][c] = v;
        }
      }
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kBK; ++kk) {
      float av[kRM];
#pragma unroll
      for (int ri = 0; ri < kRM; ++ri) av[ri] = a_s[kk][ty + kTY * ri];
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
#pragma unroll
        for (int ci = 0; ci < kCN; ++ci) {
          const float wv = w_s[part][kk][tx + kTX * ci];
#pragma unroll
          for (int ri = 0; ri < kRM; ++ri) acc[part][ri][ci] += av[ri] * wv;
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int ri = 0; ri < kRM; ++ri) {
    const int64_t row = row0 + ty + kTY * ri;
    if (row >= row_end) continue;
#pragma unroll
    for (int ci = 0; ci < kCN; ++ci) {
      const int64_t n = n0 + tx + kTX * ci;
      if (n >= args.n) continue;
      float v = acc[0][ri][ci];
      if constexpr (kGateUp) v = Silu(v) * acc[kParts - 1][ri][ci];
      Store(args.c, row * args.ldc + n, v);
    }
  }
}

bool Aligned16(const void* p) { return IsAligned16(p); }

template <bool kGateUp>
void LaunchGroupedGemm(GemmArgs args, int bm, int64_t tiles, cudaStream_t stream) {
  args.vec = args.k % 8 == 0 && args.lda % 8 == 0 && args.w_group_stride % 8 == 0 &&
             Aligned16(args.a) && Aligned16(args.w);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>((args.n + kBN - 1) / kBN));
  if (bm == 8) {
    GroupedGemmKernel<kGateUp, 8><<<grid, kGemmThreads, 0, stream>>>(args);
  } else {
    GroupedGemmKernel<kGateUp, 32><<<grid, kGemmThreads, 0, stream>>>(args);
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core grouped GEMM for the experts (bf16 mma.sync m16n8k16, fp32 accumulate).
//
// The weights are the big operand and go on the mma M dimension (16 weight rows per fragment);
// the tile's tokens go on N (8 per fragment), so a tile of one token wastes columns of cheap
// arithmetic, not rows of expensive weight traffic. A block owns one (expert, token tile) from
// the tile table and one slice of weight rows (consecutive blocks: the slices of one tile, see
// TcArgs::consecutive_slices), streams its weight rows
// over the whole K through a kStages-deep cp.async pipeline of 64-wide K slices (16-byte copies,
// 128-byte shared rows with an XOR swizzle so ldmatrix is conflict-free), and holds the
// accumulators in registers. Each warp owns 32 weight rows (two m16 fragments: for gate_up the
// 16 gate rows and the matching 16 up rows, so SiLU(gate) * up fuses into the epilogue) and all
// kBN tokens; kWarpsK warps split each K slice and are summed through shared memory at the end.
// Blocks beyond the routing's tile count exit at once: the grid depends on the shapes only.

constexpr int kTcBK = 64;  // K per pipeline stage (128-byte shared rows)
constexpr int kTcRowBytes = kTcBK * 2;

struct TcArgs {
  const uint16_t* a = nullptr;  // activations: x (gathered through a_rows) or act
  int64_t lda = 0;
  const int32_t* a_rows = nullptr;  // sorted position -> row of a; null: identity
  const uint16_t* w = nullptr;
  int64_t w_group_stride = 0;  // elements
  int64_t n_out = 0;           // output features: I (gate_up) or H (down)
  int64_t k = 0;               // multiple of 8
  const int32_t* tile_group = nullptr;
  const int32_t* tile_row0 = nullptr;
  const int32_t* group_end = nullptr;
  const int32_t* num_tiles = nullptr;
  // bf16 act [pairs, I] (gate_up), or pair_out [pairs, H] (down): f32, bf16 with c_bf16.
  void* c = nullptr;
  int64_t ldc = 0;
  // Grid order (set by LaunchTc): with consecutive_slices > 0, a one-dimensional grid whose
  // consecutive blocks are the consecutive_slices weight-row slices of one tile; with 0, tiles
  // on x and slices on y (MOBIUS_MOE_SLICE_ORDER=0). Blocks start in index order, so with slices
  // consecutive the tile's activation rows, read by every slice, are still in L2 when the next
  // slice reads them; with tiles on x each slice passes over all the activations (67 MB for the
  // down projection at 8192 tokens, more than L2) before the next slice starts, and ncu counted
  // them read from DRAM again by every slice.
  int consecutive_slices = 0;
  // down only: c holds bf16 pair rows instead of fp32 (MOBIUS_MOE_PAIR_BF16=1, see PairRowsBf16).
  bool c_bf16 = false;
};

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr));
}
// Byte offset of 16-byte chunk `chunk` (0..7) of shared row `row` (XOR swizzle).
__device__ __forceinline__ uint32_t Swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * kTcRowBytes + ((chunk ^ (row & 7)) << 4));
}

template <int kBN, int kWarpsM, int kWarpsK, int kStages>
struct TcConfig {
  static constexpr int kThreads = 32 * kWarpsM * kWarpsK;
  static constexpr int kRowsA = 32 * kWarpsM;  // weight rows of one block
  static constexpr int kStageA = kRowsA * kTcRowBytes;
  static constexpr int kStageBytes = kStageA + kBN * kTcRowBytes;
  static constexpr int kReduceBytes = (kWarpsK - 1) * kWarpsM * 32 * 2 * kBN / 8 * 4 * 4;
  static constexpr int kSmem =
      kStages * kStageBytes > kReduceBytes ? kStages* kStageBytes : kReduceBytes;
  static constexpr int kChunksA = kRowsA * 8 / kThreads;  // 16-byte copies per thread per stage
  static constexpr int kChunksB = (kBN * 8 + kThreads - 1) / kThreads;
  static_assert(kRowsA * 8 % kThreads == 0 && 4 % kWarpsK == 0);
};

template <bool kGateUp, int kBN, int kWarpsM, int kWarpsK, int kStages>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsK) TcGroupedGemmKernel(const TcArgs args) {
  using Cfg = TcConfig<kBN, kWarpsM, kWarpsK, kStages>;
  constexpr int kNT = kBN / 8;          // n8 fragments
  constexpr int kKSteps = 4 / kWarpsK;  // k16 steps per warp per stage
  extern __shared__ __align__(128) char smem[];
  __shared__ int32_t src_row[kBN];  // row of `a` for each token of the tile, -1: past the group

  // gate_up follows the grouping kernel, whose outputs it needs at once. down follows gate_up:
  // the tile table is older (gate_up only starts its dependents after its own wait), so down
  // streams its first weight stages before waiting for gate_up's activations.
  if constexpr (kGateUp) {
    PdlWait();
    PdlTrigger();
  }
  int tile = blockIdx.x, slice = blockIdx.y;
  if (args.consecutive_slices > 0) {
    tile = blockIdx.x / args.consecutive_slices;
    slice = blockIdx.x % args.consecutive_slices;
  }
  if (tile >= *args.num_tiles) return;
  const int64_t group = args.tile_group[tile];
  const int64_t row0 = args.tile_row0[tile];
  const int64_t row_end = args.group_end[group];
  // n8 fragments that hold tokens of this tile (the expert's last tile is usually partial):
  // the others are neither multiplied nor read from shared memory.
  const int live_nt = static_cast<int>((min(static_cast<int64_t>(kBN), row_end - row0) + 7) / 8);
  const int64_t m0 = static_cast<int64_t>(slice) * (kGateUp ? 16 : 32) * kWarpsM;
  const uint16_t* w = args.w + group * args.w_group_stride;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % kWarpsM, wk = warp / kWarpsM;

  if (tid < kBN) {
    const int64_t r = row0 + tid;
    src_row[tid] =
        r < row_end ? (args.a_rows != nullptr ? args.a_rows[r] : static_cast<int>(r)) : -1;
  }
  __syncthreads();

  // Each thread copies the same 16-byte column `chunk` of kChunksA weight rows per stage.
  const int chunk = tid & 7;
  const uint16_t* a_src[Cfg::kChunksA];
  uint32_t a_dst[Cfg::kChunksA];
#pragma unroll
  for (int i = 0; i < Cfg::kChunksA; ++i) {
    const int r = (tid >> 3) + i * (Cfg::kThreads / 8);
    int64_t grow;
    bool valid;
    if constexpr (kGateUp) {
      const int wr = r >> 5, part = (r >> 4) & 1;
      const int64_t feature = m0 + wr * 16 + (r & 15);
      valid = feature < args.n_out;
      grow = part * args.n_out + feature;
    } else {
      grow = m0 + r;
      valid = grow < args.n_out;
    }
    a_src[i] = valid ? w + grow * args.k + chunk * 8 : nullptr;
    a_dst[i] = Swizzle(r, chunk);
  }
  const uint16_t* b_src[Cfg::kChunksB];
  uint32_t b_dst[Cfg::kChunksB];
#pragma unroll
  for (int i = 0; i < Cfg::kChunksB; ++i) {
    const int r = (tid >> 3) + i * (Cfg::kThreads / 8);
    const int sr = r < kBN ? src_row[r] : -1;
    b_src[i] = sr >= 0 ? args.a + sr * args.lda + chunk * 8 : nullptr;
    b_dst[i] = r < kBN ? Cfg::kStageA + Swizzle(r, chunk) : 0xffffffffu;
  }

  const uint32_t smem_base = SharedAddress(smem);
  const int num_k = static_cast<int>((args.k + kTcBK - 1) / kTcBK);
  auto load_weights = [&](int kt) {
    const uint32_t base = smem_base + (kt % kStages) * Cfg::kStageBytes;
    const int64_t k0 = static_cast<int64_t>(kt) * kTcBK;
    const bool k_ok = k0 + chunk * 8 < args.k;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksA; ++i) {
      const bool ok = k_ok && a_src[i] != nullptr;
      CopyAsync16(base + a_dst[i], ok ? a_src[i] + k0 : w, ok);
    }
  };
  auto load_tokens = [&](int kt) {
    const uint32_t base = smem_base + (kt % kStages) * Cfg::kStageBytes;
    const int64_t k0 = static_cast<int64_t>(kt) * kTcBK;
    const bool k_ok = k0 + chunk * 8 < args.k;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksB; ++i) {
      if (b_dst[i] == 0xffffffffu) continue;
      const bool ok = k_ok && b_src[i] != nullptr;
      CopyAsync16(base + b_dst[i], ok ? b_src[i] + k0 : args.a, ok);
    }
  };

  float acc[2][kNT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.0f;

  // Prologue: kStages - 1 stages, one cp.async group each. down issues the weights of all of
  // them before waiting for gate_up (uncommitted, they join the first group), then the tokens.
  if constexpr (kGateUp) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_k) {
        load_weights(s);
        load_tokens(s);
      }
      CopyAsyncCommit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_k) load_weights(s);
    }
    PdlWait();
    PdlTrigger();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_k) load_tokens(s);
      CopyAsyncCommit();
    }
  }
  for (int kt = 0; kt < num_k; ++kt) {
    CopyAsyncWait<kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 is free for reuse
    if (kt + kStages - 1 < num_k) {
      load_weights(kt + kStages - 1);
      load_tokens(kt + kStages - 1);
    }
    CopyAsyncCommit();
    const uint32_t base = smem_base + (kt % kStages) * Cfg::kStageBytes;
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      const int kc = (wk * kKSteps + s) * 2;  // first 16-byte chunk of this k16 step
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int r = wm * 32 + mt * 16 + (lane & 15);
        LdMatrixX4(base + Swizzle(r, kc + (lane >> 4)), a[mt]);
      }
      uint32_t b[kNT][2];
      if constexpr (kNT == 1) {
        const int r = lane & 7;
        LdMatrixX2(base + Cfg::kStageA + Swizzle(r, kc + ((lane >> 3) & 1)), b[0][0], b[0][1]);
      } else {
#pragma unroll
        for (int j = 0; j < kNT; j += 2) {
          if (j >= live_nt) break;
          const int r = j * 8 + (lane & 7) + ((lane >> 4) << 3);
          uint32_t t[4];
          LdMatrixX4(base + Cfg::kStageA + Swizzle(r, kc + ((lane >> 3) & 1)), t);
          b[j][0] = t[0];
          b[j][1] = t[1];
          b[j + 1][0] = t[2];
          b[j + 1][1] = t[3];
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          if (j < live_nt) MmaBf16(acc[mt][j], a[mt], b[j][0], b[j][1]);
        }
    }
  }
  CopyAsyncWait<0>();

  if constexpr (kWarpsK > 1) {
    __syncthreads();  // every warp is done with the pipeline buffers
    float* red = reinterpret_cast<float*>(smem);
    constexpr int kPer = 2 * kNT * 4;
    if (wk > 0) {
      float* dst = red + ((wk - 1) * kWarpsM + wm) * kPer * 32;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) dst[((mt * kNT + j) * 4 + e) * 32 + lane] = acc[mt][j][e];
    }
    __syncthreads();
    if (wk > 0) return;
#pragma unroll
    for (int o = 1; o < kWarpsK; ++o) {
      const float* src = red + ((o - 1) * kWarpsM + wm) * kPer * 32;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][j][e] += src[((mt * kNT + j) * 4 + e) * 32 + lane];
    }
  }

  // Fragment element e of n8 tile j: weight row (lane / 4) + 8 * (e / 2), token 8j + 2(lane % 4)
  // + e % 2.
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = j * 8 + tq * 2 + (e & 1);
      if (row0 + n >= row_end) continue;
      const int64_t pos = row0 + n;
      if constexpr (kGateUp) {
        const int64_t feature = m0 + wm * 16 + g + 8 * (e >> 1);
        if (feature < args.n_out) {
          static_cast<uint16_t*>(args.c)[pos * args.ldc + feature] =
              F32ToBf16(Silu(acc[0][j][e]) * acc[1][j][e]);
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int64_t feature = m0 + wm * 32 + mt * 16 + g + 8 * (e >> 1);
          if (feature < args.n_out) {
            if (args.c_bf16) {
              static_cast<uint16_t*>(args.c)[pos * args.ldc + feature] = F32ToBf16(acc[mt][j][e]);
            } else {
              static_cast<float*>(args.c)[pos * args.ldc + feature] = acc[mt][j][e];
            }
          }
        }
      }
    }
  }
}

// Benchmark knob (read once): MOBIUS_PDL=0 (or the older MOBIUS_MOE_PDL=0) launches the GEMMs
// and the combine without programmatic dependent launch.
template <bool kGateUp, int kBN, int kWarpsM, int kWarpsK, int kStages>
void LaunchTc(const TcArgs& args, int64_t max_tiles, cudaStream_t stream) {
  using Cfg = TcConfig<kBN, kWarpsM, kWarpsK, kStages>;
  auto* kernel = TcGroupedGemmKernel<kGateUp, kBN, kWarpsM, kWarpsK, kStages>;
  // The dynamic shared-memory limit is raised once per device (a per-device attribute).
  static std::atomic<uint64_t> raised{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((raised.load(std::memory_order_relaxed) & bit) == 0) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
    if (err != cudaSuccess) {
      std::fprintf(stderr, "mobius cuda: MoE GEMM shared memory (%d bytes): %s\n", Cfg::kSmem,
                   cudaGetErrorString(err));
      std::abort();
    }
    raised.fetch_or(bit, std::memory_order_relaxed);
  }
  const int64_t rows = kGateUp ? 16 * kWarpsM : 32 * kWarpsM;
  const int64_t slices = (args.n_out + rows - 1) / rows;
  static const bool consecutive = KnobChoice("MOBIUS_MOE_SLICE_ORDER", {"0", "1"}) != 1;
  TcArgs a = args;
  a.consecutive_slices =
      consecutive && max_tiles * slices <= int64_t{0x7fffffff} ? static_cast<int>(slices) : 0;
  const dim3 grid = a.consecutive_slices > 0
                        ? dim3(static_cast<unsigned>(max_tiles * slices))
                        : dim3(static_cast<unsigned>(max_tiles), static_cast<unsigned>(slices));
  LaunchPdl(kGateUp ? "MoeGateUp" : "MoeDown", kernel, grid, Cfg::kThreads, Cfg::kSmem, stream, a);
}

// Token-tile widths of the tensor-core path, chosen from the mean number of pairs per local
// expert (shapes only, so the launch does not depend on the routing).
// Benchmark knobs (read once): MOBIUS_MOE_TILE_N=8|16|32|64 forces the token-tile width;
// MOBIUS_MOE_GEMM=fma forces the CUDA-core path with the multi-launch grouping (the old kernel).
// MOBIUS_MOE_GEMM: 1 for "fma", 2 for "grouped" (read once; see ForcedFma and
// LaunchMoeExpertsFewTokens).
int MoeGemmKnob() {
  static const int choice = KnobChoice("MOBIUS_MOE_GEMM", {"fma", "grouped"});
  return choice;
}
int ForcedTileTokens() {
  static const int forced = [] {
    const int choice = KnobChoice("MOBIUS_MOE_TILE_N", {"8", "16", "32", "64"});
    return choice == 0 ? 0 : 4 << choice;
  }();
  return forced;
}
bool ForcedFma() {
  static const bool forced = MoeGemmKnob() == 1;
  return forced;
}

// MOBIUS_MOE_PAIR_BF16=1 (read once): the tensor-core down GEMM writes its per-pair rows in bf16
// and the combine reads them so, halving the rows' traffic (at 8192 tokens 0.54 GB written and
// read back per layer in fp32). Each row is rounded once more before the weighted sum (fp32
// accumulation in the combine). Measured on the H200 (session 14, fp32 / bf16 rows): moe.T8192
// 4259 / 4213 us, T4096 3952 / 3916; engine 8K prefill 274.0 / 270.9 ms, batch-256 decode 100.39
// / 100.13 ms. Off by default: the extra rounding separates the tensor-core path (verify steps of
// k + 1 tokens) from the few-token kernels (plain one-token steps) enough that on the tiny
// fixtures the MTP verify accepted 11% of the target's own greedy drafts instead of over 90%
// (CudaSpeculativeTest), so greedy outputs with MTP would no longer match those without.
bool PairRowsBf16() {
  static const bool on = KnobChoice("MOBIUS_MOE_PAIR_BF16", {"0", "1"}) == 2;
  return on;
}

int TcTileTokens(int64_t pairs, int64_t num_local) {
  const int forced = ForcedTileTokens();
  if (forced == 8 || forced == 16 || forced == 32 || forced == 64) return forced;
  // Below 40 pairs per expert, 32-token tiles: a tile's n8 fragments past its last token are
  // skipped, so a tile of 1-8 tokens costs what an 8-token tile did, while an expert of up to 32
  // tokens is one tile (its weights read once). Measured against the former 8/16-token choice at
  // low means (H200, release dims): T = 256 2153 -> 2072 us, a 1K-token prefill 171.0 ->
  // 155.1 ms, batch-256 decode 104.2 -> 100.9 ms; T = 64 unchanged.
  if (pairs < 40 * num_local) return 32;
  return 64;
}

template <bool kGateUp>
void LaunchTcGroupedGemm(const TcArgs& args, int bn, int64_t max_tiles, cudaStream_t stream) {
  switch (bn) {
    case 8:
      LaunchTc<kGateUp, 8, 2, 2, 10>(args, max_tiles, stream);
      break;
    case 16:
      LaunchTc<kGateUp, 16, 2, 2, 10>(args, max_tiles, stream);
      break;
    case 32:
      LaunchTc<kGateUp, 32, 4, 1, 4>(args, max_tiles, stream);
      break;
    default:
      LaunchTc<kGateUp, 64, 4, 2, 4>(args, max_tiles, stream);
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Grouping (token, expert) pairs by local expert: count, scan, scatter.

__global__ void CountPairsKernel(const int32_t* ids, int64_t num_pairs, int first_expert,
                                 int num_local, int32_t* counts) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < num_pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = ids[p] - first_expert;
    if (e >= 0 && e < num_local) atomicAdd(&counts[e], 1);
  }
}

// Inclusive scan of `v` over the block (kScanThreads threads); returns the block total in *total.
__device__ int BlockInclusiveScan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int s = warp_sums[lane];
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += n;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  if (warp > 0) v += warp_sums[warp - 1];
  *total = warp_sums[31];
  __syncthreads();
  return v;
}

// One block loops over the experts in chunks of kScanThreads (any E): offsets[e] = first row of
// expert e in the sorted order (offsets[E] = pairs routed locally), and the GEMM tile table.
__device__ void ScanExperts(const int32_t* counts, int num_local, int bm, int32_t* offsets,
                            int32_t* tile_group, int32_t* tile_row0, int32_t* num_tiles) {
  __shared__ int warp_sums[32];
  int row_carry = 0, tile_carry = 0;
  for (int base = 0; base < num_local; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int count = e < num_local ? counts[e] : 0;
    const int tiles = (count + bm - 1) / bm;
    int row_total, tile_total;
    const int row_incl = BlockInclusiveScan(count, warp_sums, &row_total);
    const int tile_incl = BlockInclusiveScan(tiles, warp_sums, &tile_total);
    if (e < num_local) {
      const int row_start = row_carry + row_incl - count;
      const int tile_start = tile_carry + tile_incl - tiles;
      offsets[e] = row_start;
      for (int i = 0; i < tiles; ++i) {
        tile_group[tile_start + i] = e;
        tile_row0[tile_start + i] = row_start + i * bm;
      }
    }
    row_carry += row_total;
    tile_carry += tile_total;
  }
  if (threadIdx.x == 0) {
    offsets[num_local] = row_carry;
    *num_tiles = tile_carry;
  }
}

__global__ void __launch_bounds__(kScanThreads)
    ScanExpertsKernel(const int32_t* counts, int num_local, int bm, int32_t* offsets,
                      int32_t* tile_group, int32_t* tile_row0, int32_t* num_tiles) {
  ScanExperts(counts, num_local, bm, offsets, tile_group, tile_row0, num_tiles);
}

// Decode-sized routings (few pairs, at most kRouteSharedExperts local experts) in one launch
// instead of memset + count + scan + scatter: one block counts in shared memory, then each
// thread takes a run of consecutive experts and one block scan of (rows << 16 | tiles) (both
// at most kFusedRoutePairs < 2^16) gives every expert's first row and first tile; the scatter
// uses shared-memory cursors. Global memory written by the block is visible to the whole block
// after __syncthreads.
constexpr int64_t kFusedRoutePairs = 4096;
constexpr int kRouteSharedExperts = 8192;

__global__ void __launch_bounds__(kScanThreads)
    RouteSmallKernel(const int32_t* ids, int num_pairs, int k, int first_expert, int num_local,
                     int bm, int32_t* counts, int32_t* offsets, int32_t* tile_group,
                     int32_t* tile_row0, int32_t* num_tiles, int32_t* sorted_token,
                     int32_t* pair_pos) {
  __shared__ int32_t slot[kRouteSharedExperts];  // count, then the next free row of each expert
  __shared__ int warp_sums[32];
  PdlTrigger();  // gate_up's blocks may start; they wait for this grid to finish
  for (int e = threadIdx.x; e < num_local; e += kScanThreads) slot[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < num_pairs; p += kScanThreads) {
    const int e = ids[p] - first_expert;
    if (e >= 0 && e < num_local) atomicAdd(&slot[e], 1);
  }
  __syncthreads();
  const int per = (num_local + kScanThreads - 1) / kScanThreads;
  const int e0 = threadIdx.x * per, e1 = min(e0 + per, num_local);
  int packed = 0;
  for (int e = e0; e < e1; ++e) packed += (slot[e] << 16) + (slot[e] + bm - 1) / bm;
  int total;
  const int incl = BlockInclusiveScan(packed, warp_sums, &total);
  int row = (incl - packed) >> 16, tile = (incl - packed) & 0xffff;
  for (int e = e0; e < e1; ++e) {
    const int count = slot[e], tiles = (count + bm - 1) / bm;
    counts[e] = count;
    offsets[e] = row;
    for (int i = 0; i < tiles; ++i) {
      tile_group[tile + i] = e;
      tile_row0[tile + i] = row + i * bm;
    }
    slot[e] = row;
    row += count;
    tile += tiles;
  }
  if (threadIdx.x == 0) {
    offsets[num_local] = total >> 16;
    *num_tiles = total & 0xffff;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < num_pairs; p += kScanThreads) {
    const int e = ids[p] - first_expert;
    if (e >= 0 && e < num_local) {
      const int pos = atomicAdd(&slot[e], 1);
      sorted_token[pos] = p / k;
      pair_pos[p] = pos;
    } else {
      pair_pos[p] = -1;
    }
  }
}

// sorted_token[pos] = token of the pair placed at pos; pair_pos[p] = pos (-1: not local).
// Within one expert the order depends on atomics, but every row is computed independently, so
// the results do not.
__global__ void ScatterPairsKernel(const int32_t* ids, int64_t num_pairs, int k, int first_expert,
                                   int num_local, const int32_t* offsets, int32_t* cursor,
                                   int32_t* sorted_token, int32_t* pair_pos) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < num_pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = ids[p] - first_expert;
    if (e >= 0 && e < num_local) {
      const int pos = offsets[e] + atomicAdd(&cursor[e], 1);
      sorted_token[pos] = static_cast<int32_t>(p / k);
      pair_pos[p] = pos;
    } else {
      pair_pos[p] = -1;
    }
  }
}

// routed sum + sigmoid(shared_gate[t]) * shared[i], rounded as the separate ops round (the sum
// stored to a zeroed out, then AddSigmoidScaled), so both give the same bits and a batch that
// takes this path and one that does not round alike. `shared_value` holds a bf16 value.
__device__ __forceinline__ uint16_t RoutedPlusShared(float sum, float shared_value,
                                                     float gate_logit) {
  const float routed = Bf16ToF32(F32ToBf16(sum));
  return F32ToBf16(routed + Sigmoid(gate_logit) * shared_value);
}

// out[t, :] += sum_j weights[t, j] * pair_out[pair_pos[t, j], :], adding j in order (so the
// result does not depend on the grouping); with a shared term (shared_value not null) out[t, :] =
// RoutedPlusShared of that sum instead, written without being read, so that the layer needs no
// zero fill of out and no separate AddSigmoidScaled. Grid (hidden chunks, tokens): with kVec
// each thread owns 4 adjacent features (16-byte loads of fp32 pair rows or 8-byte loads of bf16
// ones, an 8-byte bf16 read-modify-write or write of out).
constexpr int kCombineThreads = 128;

// Four pair-row values from fp32 or bf16 rows (PairRowsBf16).
__device__ __forceinline__ float4 LoadPairRow4(const float* rows, int64_t i) {
  return *reinterpret_cast<const float4*>(rows + i);
}
__device__ __forceinline__ float4 LoadPairRow4(const uint16_t* rows, int64_t i) {
  const uint2 v = *reinterpret_cast<const uint2*>(rows + i);
  return make_float4(Bf16ToF32(v.x & 0xffffu), Bf16ToF32(v.x >> 16), Bf16ToF32(v.y & 0xffffu),
                     Bf16ToF32(v.y >> 16));
}
__device__ __forceinline__ float LoadPairRow(const float* rows, int64_t i) { return rows[i]; }
__device__ __forceinline__ float LoadPairRow(const uint16_t* rows, int64_t i) {
  return Bf16ToF32(rows[i]);
}

template <bool kVec, typename PairRow>
__global__ void __launch_bounds__(kCombineThreads)
    CombineKernel(const PairRow* pair_out, const int32_t* pair_pos, const float* weights, int k,
                  int64_t hidden, const uint16_t* shared_value, AnyPtr shared_gate, uint16_t* out) {
  PdlWait();  // pair_out comes from the down GEMM
  const int64_t t = blockIdx.y;
  constexpr int kPer = kVec ? 4 : 1;
  const int64_t h = (static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x) * kPer;
  if (h >= hidden) return;
  float acc[kPer] = {};
  for (int j = 0; j < k; ++j) {
    const int pos = pair_pos[t * k + j];
    if (pos < 0) continue;
    const float wj = weights[t * k + j];
    if constexpr (kVec) {
      const float4 v = LoadPairRow4(pair_out, pos * hidden + h);
      acc[0] += wj * v.x;
      acc[1] += wj * v.y;
      acc[2] += wj * v.z;
      acc[3] += wj * v.w;
    } else {
      acc[0] += wj * LoadPairRow(pair_out, pos * hidden + h);
    }
  }
  const int64_t i = t * hidden + h;
  if (shared_value != nullptr) {
    const float gate_logit = Load(shared_gate, t);
    if constexpr (kVec) {
      const uint2 sv = *reinterpret_cast<const uint2*>(shared_value + i);
      uint2 o;
      o.x = RoutedPlusShared(acc[0], Bf16ToF32(sv.x & 0xffffu), gate_logit) |
            (static_cast<uint32_t>(RoutedPlusShared(acc[1], Bf16ToF32(sv.x >> 16), gate_logit))
             << 16);
      o.y = RoutedPlusShared(acc[2], Bf16ToF32(sv.y & 0xffffu), gate_logit) |
            (static_cast<uint32_t>(RoutedPlusShared(acc[3], Bf16ToF32(sv.y >> 16), gate_logit))
             << 16);
      *reinterpret_cast<uint2*>(out + i) = o;
    } else {
      out[i] = RoutedPlusShared(acc[0], Bf16ToF32(shared_value[i]), gate_logit);
    }
    return;
  }
  if constexpr (kVec) {
    uint2 o = *reinterpret_cast<const uint2*>(out + i);
    const float r0 = Bf16ToF32(o.x & 0xffffu) + acc[0], r1 = Bf16ToF32(o.x >> 16) + acc[1];
    const float r2 = Bf16ToF32(o.y & 0xffffu) + acc[2], r3 = Bf16ToF32(o.y >> 16) + acc[3];
    o.x = F32ToBf16(r0) | (static_cast<uint32_t>(F32ToBf16(r1)) << 16);
    o.y = F32ToBf16(r2) | (static_cast<uint32_t>(F32ToBf16(r3)) << 16);
    *reinterpret_cast<uint2*>(out + i) = o;
  } else {
    out[i] = F32ToBf16(Bf16ToF32(out[i]) + acc[0]);
  }
}

struct MoeScratch {
  int32_t* counts;
  int32_t* offsets;
  int32_t* cursor;
  int32_t* tile_group;
  int32_t* tile_row0;
  int32_t* num_tiles;
  int32_t* sorted_token;
  int32_t* pair_pos;
  uint16_t* act;
  float* pair_out;  // sized for fp32 rows; holds bf16 ones with PairRowsBf16 (tensor-core path)
  int64_t max_tiles;
  int bm;
  size_t bytes;
};

// Tiles of `bm` rows any routing of `pairs` pairs over `num_local` experts can need.
int64_t MaxTiles(int64_t pairs, int64_t num_local, int bm) {
  return (pairs + bm - 1) / bm + (num_local < pairs ? num_local : pairs);
}

// The tile table is sized for the narrowest tile (8 rows); the launch picks the width.
MoeScratch CarveMoeScratch(char* base, int64_t num_tokens, int k, int num_local, int64_t hidden,
                           int64_t inter) {
  const int64_t pairs = num_tokens * k;
  MoeScratch s;
  s.bm = 8;
  s.max_tiles = MaxTiles(pairs, num_local, 8);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* p = base == nullptr ? nullptr : base + off;
    off += (bytes + 255) / 256 * 256;
    return p;
  };
  s.counts = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * num_local));
  s.cursor = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * num_local));
  s.offsets = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * (num_local + 1)));
  s.tile_group = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * (s.max_tiles + 1)));
  s.tile_row0 = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * (s.max_tiles + 1)));
  s.num_tiles = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
  s.sorted_token = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * pairs));
  s.pair_pos = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * pairs));
  s.act = reinterpret_cast<uint16_t*>(take(sizeof(uint16_t) * pairs * inter));
  s.pair_out = reinterpret_cast<float*>(take(sizeof(float) * pairs * hidden));
  s.bytes = off;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Few tokens (decode): every (token, expert) pair streams its expert's rows directly, like the
// skinny GEMM, with no routing pass, no tiles and no combine pass. At one token the grouped path
// spent 4.8 us routing, 14 + 9 us in GEMMs with 144-288 blocks of 128-row tiles (2.4 and
// 1.9 TB/s) and 6 us combining; here a layer is two launches over ~2000 warps each.

constexpr int kFewWarps = 8;

// The shared expert's down projection inside the few-token kernels, for kRows rows h0.. of token
// t: a block's threads take its (row, 16-byte piece) pairs pr = row * pieces + piece, thread i
// the pairs i, i + blockDim.x, ..., each adding w[h0 + row, piece] . silu(gate) * up (the act
// piece formed from the fan-out's gate/up row, as SiluAndMul rounds it) into sp[row]; the
// per-warp sums then meet in shared memory in warp order (SharedRowsSum). The down kernel (at
// most kMoeSharedExpertFusedMaxTokens tokens) and the gate-up kernel both compute it this way,
// so either gives the same bits.
// One (row, piece) product: w . a over the piece's eight elements, a = silu(g) * u.
__device__ __forceinline__ float SharedPieceDot(uint4 w, const float (&a)[8]) {
  float wf[8];
  UnpackBf16x8(w, wf);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += wf[i] * a[i];
  return sum;
}

__device__ __forceinline__ float SharedPairDot(uint4 w, uint4 g, uint4 u) {
  float a[8];
  SiluMulPiece(g, u, a);
  return SharedPieceDot(w, a);
}

template <int kRows>
__device__ __forceinline__ void AddSharedPair(int row, uint4 w, uint4 g, uint4 u,
                                              float (&sp)[kRows]) {
  const float sum = SharedPairDot(w, g, u);
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) sp[rr] += rr == row ? sum : 0.f;
}

// Pairs first, first + blockDim.x, ... below `pairs` of rows h0.. of token t.
template <int kRows>
__device__ __forceinline__ void AddSharedPairs(const MoeSharedTerm& shared, int64_t t, int64_t h0,
                                               int64_t first, int64_t pairs, float (&sp)[kRows]) {
  const int64_t pieces = shared.inter / 8;
  const uint4* gu = reinterpret_cast<const uint4*>(shared.gate_up + t * 2 * shared.inter);
  for (int64_t pr = first; pr < pairs; pr += blockDim.x) {
    const int row = static_cast<int>(pr / pieces);
    const int64_t q = pr % pieces;
    AddSharedPair<kRows>(
        row, __ldg(reinterpret_cast<const uint4*>(shared.down + (h0 + row) * shared.inter) + q),
        __ldcg(gu + q), __ldcg(gu + pieces + q), sp);
  }
}

// Each warp's sp into partial[warp]; after the barrier row r's sum (thread r < rows) is
// sum_w partial[w][r].
template <int kRows>
__device__ __forceinline__ float SharedRowsSum(float (&sp)[kRows], float (*partial)[kRows],
                                               int rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) sp[rr] = WarpSum(sp[rr]);
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) partial[warp][rr] = sp[rr];
  }
  __syncthreads();
  float value = 0.f;
  if (threadIdx.x < rows) {
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) value += partial[w][threadIdx.x];
  }
  return value;
}

// Rows of the shared expert's down projection a gate-up kernel computes before its PdlWait (the
// gate/up rows come from the fan-out, two launches back, the weights are constants): at one
// token the top-k kernel between them runs on one SM, so this 2 MB read overlaps it instead of
// lengthening the down kernel. The same four-row pieces as the default down kernel.
constexpr int kSharedRowsInGateUp = 4;
// Up to this many tokens every gate-up block takes shared-row units (SharedExpertInGateUp).
constexpr int kSharedRowsSpreadMaxTokens = 2;

// One unit: rows h0.. (up to four) of token t into shared_out, then a barrier, as partial is
// reused by the block's next unit.
__device__ __forceinline__ void SharedRowsUnit(const MoeSharedTerm& shared, int64_t t, int64_t h0,
                                               int64_t hidden,
                                               float (*partial)[kSharedRowsInGateUp],
                                               uint16_t* shared_out) {
  const int rows =
      static_cast<int>(hidden - h0 < kSharedRowsInGateUp ? hidden - h0 : kSharedRowsInGateUp);
  float sp[kSharedRowsInGateUp] = {};
  AddSharedPairs(shared, t, h0, threadIdx.x, rows * (shared.inter / 8), sp);
  const float value = SharedRowsSum(sp, partial, rows);
  if (threadIdx.x < rows) shared_out[t * hidden + h0 + threadIdx.x] = F32ToBf16(value);
  __syncthreads();
}

// Up to kSharedRowsSpreadMaxTokens tokens a unit is (token, four rows) and every block of the grid
// takes units (at one token the 512 units are one wave's worth). With more tokens
// (shared.unit_blocks > 0) a unit is four rows of every token, one token after another, and only
// the first unit_blocks blocks take units: the blocks resident in the first wave, whose work here
// overlaps the top-k, where units spread over the whole grid would put the rest in front of the
// later waves' weight streams. The per-token arithmetic is the same either way (and the same as the
// down kernel's).
__device__ __forceinline__ void SharedExpertInGateUp(const MoeSharedTerm& shared,
                                                     int64_t num_tokens, int64_t hidden,
                                                     uint16_t* shared_out) {
  __shared__ float partial[kFewWarps][kSharedRowsInGateUp];
  const int64_t row_blocks = (hidden + kSharedRowsInGateUp - 1) / kSharedRowsInGateUp;
  const int64_t block = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  if (shared.unit_blocks > 0) {
    if (block >= shared.unit_blocks) return;
    for (int64_t u = block; u < row_blocks; u += shared.unit_blocks) {
      for (int64_t t = 0; t < num_tokens; ++t) {
        SharedRowsUnit(shared, t, u * kSharedRowsInGateUp, hidden, partial, shared_out);
      }
    }
    return;
  }
  const int64_t blocks = static_cast<int64_t>(gridDim.x) * gridDim.y;
  for (int64_t u = block; u < num_tokens * row_blocks; u += blocks) {
    SharedRowsUnit(shared, u / row_blocks, (u % row_blocks) * kSharedRowsInGateUp, hidden, partial,
                   shared_out);
  }
}

// The shared expert's rows computed beside the top-k (TopKSoftmaxFilterSharedRowsKernel), for
// 4-8 tokens, where the gate-up kernel's first wave hides them less well or not at all
// (performance.md, twenty-sixth version). The top-k grid gets extra blocks; each holds
// kSharedRowGroups groups of kFewWarps warps, and a group takes kSharedUnitsPerGroup four-row
// units for every token (one unit: 256 blocks at hidden 2048, two per SM; four units, 64
// blocks, measured slower than the separate projection: the blocks finished well after the
// top-k, performance.md twenty-sixth version). A
// block loads its weight pieces before the PDL wait (constants), then forms every token's
// silu(gate) * up once into shared memory (SiluMulPiece, as the gate-up kernel rounds it) and
// takes the (row, piece) products from there. A group computes each (token, row) as a gate-up
// block's SharedRowsUnit does (thread tid's pair tid, the per-warp sums in warp order), so the
// rows have the same bits as the gate-up and down kernels' placements. The launcher requires one
// pair per thread: 4 rows x inter / 8 pieces <= kFewWarps * 32 (inter <= 512).
constexpr int kSharedRowGroups = 2;  // of kFewWarps * 32 threads, in a top-k block's 512
constexpr int kSharedUnitsPerGroup = 1;
constexpr int kSharedBesideTopKMaxTokens = 8;
constexpr int kSharedBesideTopKMaxInter = kFewWarps * 32 / kSharedRowsInGateUp * 8;  // 512
static_assert(kSharedRowGroups * kFewWarps * 32 == kRegTopKThreads);

__device__ __forceinline__ void SharedRowsBesideTopK(const MoeSharedTerm& shared,
                                                     int64_t num_tokens, int64_t hidden,
                                                     int64_t block, uint16_t* shared_out) {
  constexpr int kUnits = kSharedUnitsPerGroup, kMaxT = kSharedBesideTopKMaxTokens;
  constexpr int kGroupThreads = kFewWarps * 32;
  __shared__ float partial[kSharedRowGroups][kUnits][kMaxT][kFewWarps][kSharedRowsInGateUp];
  __shared__ __align__(16) float act[kMaxT * kSharedBesideTopKMaxInter];
  const int group = static_cast<int>(threadIdx.x) / kGroupThreads;
  const int tid = static_cast<int>(threadIdx.x) % kGroupThreads;
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t inter = shared.inter, pieces = inter / 8;
  const int64_t pairs = kSharedRowsInGateUp * pieces;  // <= kGroupThreads (launcher)
  const int row = static_cast<int>(tid / pieces);
  const int64_t q = tid % pieces;
  const int64_t unit0 = (block * kSharedRowGroups + group) * kUnits;
  uint4 w[kUnits];
  bool has[kUnits];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int64_t h = (unit0 + u) * kSharedRowsInGateUp + row;
    has[u] = tid < pairs && h < hidden;
    w[u] = has[u] ? __ldg(reinterpret_cast<const uint4*>(shared.down + h * inter) + q)
                  : make_uint4(0, 0, 0, 0);
  }
  PdlWait();
  PdlTrigger();
  for (int64_t i = threadIdx.x; i < num_tokens * pieces; i += blockDim.x) {
    const int64_t t = i / pieces, p = i % pieces;
    const uint4* gu = reinterpret_cast<const uint4*>(shared.gate_up + t * 2 * inter);
    float a[8];
    SiluMulPiece(__ldcg(gu + p), __ldcg(gu + pieces + p), a);
    float4* dst = reinterpret_cast<float4*>(act + t * inter + p * 8);
    dst[0] = make_float4(a[0], a[1], a[2], a[3]);
    dst[1] = make_float4(a[4], a[5], a[6], a[7]);
  }
  __syncthreads();
  // A warp's pairs lie in one row when a row's pieces are a multiple of 32: one sum per
  // (token, unit), the warp's other rows +0 as in SharedRowsSum.
  const bool row_per_warp = pieces % 32 == 0;
  const int warp_row = static_cast<int>((static_cast<int64_t>(warp) * 32) / pieces);
  for (int t = 0; t < num_tokens; ++t) {
    float a[8];
    if (tid < pairs) {
      const float4* src = reinterpret_cast<const float4*>(act + t * inter + q * 8);
      const float4 lo = src[0], hi = src[1];
      a[0] = lo.x, a[1] = lo.y, a[2] = lo.z, a[3] = lo.w;
      a[4] = hi.x, a[5] = hi.y, a[6] = hi.z, a[7] = hi.w;
    }
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      const float s = has[u] ? 0.f + SharedPieceDot(w[u], a) : 0.f;
      if (row_per_warp) {
        const float sum = WarpSum(s);
        if (lane < kSharedRowsInGateUp) {
          partial[group][u][t][warp][lane] = lane == warp_row ? sum : 0.f;
        }
      } else {
#pragma unroll
        for (int rr = 0; rr < kSharedRowsInGateUp; ++rr) {
          const float sum = WarpSum(rr == row ? s : 0.f);
          if (lane == 0) partial[group][u][t][warp][rr] = sum;
        }
      }
    }
  }
  __syncthreads();
  const int64_t outputs = static_cast<int64_t>(kUnits) * num_tokens * kSharedRowsInGateUp;
  for (int64_t i = tid; i < outputs; i += kGroupThreads) {
    const int r = static_cast<int>(i % kSharedRowsInGateUp);
    const int64_t t = (i / kSharedRowsInGateUp) % num_tokens;
    const int u = static_cast<int>(i / (kSharedRowsInGateUp * num_tokens));
    const int64_t h = (unit0 + u) * kSharedRowsInGateUp + r;
    if (h >= hidden) continue;
    float value = 0.f;
    for (int wi = 0; wi < kFewWarps; ++wi) value += partial[group][u][t][wi][r];
    shared_out[t * hidden + h] = F32ToBf16(value);
  }
}

// Blocks 0 .. num_tokens - 1: TopKSoftmaxFilterKernel's; the rest: SharedRowsBesideTopK.
// Two blocks per SM (64 registers), so that blocks can become resident beside the
// fan-out's and the gate-up kernel's.
__global__ void __launch_bounds__(kRegTopKThreads, 2)
    TopKSoftmaxFilterSharedRowsKernel(AnyPtr logits, int num_experts, int k, bool renormalize,
                                      int32_t* ids, float* weights, const MoeSharedTerm shared,
                                      int64_t num_tokens, int64_t hidden, uint16_t* shared_out) {
  if (blockIdx.x < num_tokens) {
    PdlWait();
    PdlTrigger();
    TopKFilterToken(logits, num_experts, k, renormalize, ids, weights, blockIdx.x);
    return;
  }
  SharedRowsBesideTopK(shared, num_tokens, hidden, blockIdx.x - num_tokens, shared_out);
}

// act[p, i] = silu(x[t] . gate[e, i]) * (x[t] . up[e, i]) for pair p = (t, j), e = ids[p]: kSplit
// warps compute kCols columns i (2 kCols weight rows) together, each taking every kSplit-th
// 32-piece stretch of the hidden dimension, each lane keeping kUnroll 16-byte pieces of each row in
// flight; with kSplit > 1 the warps' sums meet in shared memory. Grid (ceil(I / (8 kCols /
// kSplit)), pairs).
template <int kCols, int kUnroll, int kSplit, bool kSharedRows = false>
__global__ void __launch_bounds__(kFewWarps * 32)
    MoeFewGateUpKernel(const uint16_t* x, const int32_t* ids, const uint16_t* gate_up,
                       int64_t hidden, int64_t inter, int k, int first_expert, int num_local,
                       uint16_t* act, const MoeSharedTerm shared, int64_t num_tokens,
                       uint16_t* shared_out) {
  static_assert(kFewWarps % kSplit == 0);
  constexpr int kRows = 2 * kCols;
  // (A template flag, so the other variants keep their 40 registers: 6 blocks per SM.)
  if constexpr (kSharedRows) SharedExpertInGateUp(shared, num_tokens, hidden, shared_out);
  PdlWait();
  PdlTrigger();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int slice = warp % kSplit;
  const int64_t p = blockIdx.y;
  const int e = ids[p] - first_expert;
  if (e < 0 || e >= num_local) return;  // another rank's expert: the down kernel skips it too
  const int64_t i0 =
      (static_cast<int64_t>(blockIdx.x) * (kFewWarps / kSplit) + warp / kSplit) * kCols;
  if (kSplit == 1 && i0 >= inter) return;  // (with kSplit > 1 every warp reaches the barrier)
  const uint16_t* w = gate_up + static_cast<int64_t>(e) * 2 * inter * hidden;
  const uint4* rows[kRows];  // gate rows of the columns, then their up rows
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t i = i0 + c < inter ? i0 + c : 0;
    rows[c] = reinterpret_cast<const uint4*>(w + i * hidden);
    rows[kCols + c] = reinterpret_cast<const uint4*>(w + (inter + i) * hidden);
  }
  const uint4* xr = reinterpret_cast<const uint4*>(x + (p / k) * hidden);
  const int64_t pieces = hidden / 8;
  constexpr int kStride = 32 * kSplit;
  float acc[kRows] = {};
  for (int64_t base = slice * 32 + lane; base < pieces; base += kStride * kUnroll) {
    uint4 wv[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t q = base + kStride * u;
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        wv[u][r] = q < pieces ? __ldg(rows[r] + q) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t q = base + kStride * u;
      if (q >= pieces) break;
      float xv[8];
      UnpackBf16x8(__ldg(xr + q), xv);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float wf[8];
        UnpackBf16x8(wv[u][r], wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r] += wf[i] * xv[i];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = WarpSum(acc[r]);
  if constexpr (kSplit > 1) {
    __shared__ float partial[kFewWarps][kRows];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) partial[warp][r] = acc[r];
    }
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float sum = partial[warp][r];
#pragma unroll
      for (int j = 1; j < kSplit; ++j) sum += partial[warp + j][r];
      acc[r] = sum;
    }
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    if (lane == c && i0 + c < inter) {
      act[p * inter + i0 + c] = F32ToBf16(Silu(acc[c]) * acc[kCols + c]);
    }
  }
}

// The few-token down kernels' result for out[i] (row t) from its routed sum: out + sum, or, when
// the shared expert's finished term is fused in, RoutedPlusShared (out is then written without
// being read, so it needs no zero fill).
__device__ __forceinline__ uint16_t FewDownResult(const uint16_t* out, const MoeSharedTerm& shared,
                                                  int64_t t, int64_t i, float sum) {
  if (shared.value == nullptr) return F32ToBf16(Bf16ToF32(out[i]) + sum);
  return RoutedPlusShared(sum, Bf16ToF32(shared.value[i]), Load(shared.gate_logits, t));
}

// out[t, h] += sum_j weights[t, j] * (act[(t, j)] . down[e_j, h]): a warp computes two rows h of
// one token over all its k experts, one expert after another. Grid (ceil(H / 16), tokens). The
// first few-token down kernel, kept for A/B runs (MOBIUS_MOE_FEW=v1); it takes a finished shared
// term only.
__global__ void __launch_bounds__(kFewWarps * 32)
    MoeFewDownKernel(const uint16_t* act, const int32_t* ids, const float* weights,
                     const uint16_t* down, int64_t hidden, int64_t inter, int k, int first_expert,
                     int num_local, uint16_t* out, const MoeSharedTerm shared) {
  PdlWait();
  PdlTrigger();
  const int lane = threadIdx.x & 31;
  const int64_t t = blockIdx.y;
  const int64_t h0 = (static_cast<int64_t>(blockIdx.x) * kFewWarps + (threadIdx.x >> 5)) * 2;
  if (h0 >= hidden) return;
  const bool second = h0 + 1 < hidden;
  const int64_t pieces = inter / 8;
  float acc[2] = {};
#pragma unroll 4
  for (int j = 0; j < k; ++j) {
    const int64_t p = t * k + j;
    const int e = ids[p] - first_expert;
    if (e < 0 || e >= num_local) continue;
    const float wj = weights[p];
    const uint16_t* w = down + static_cast<int64_t>(e) * hidden * inter;
    const uint4* r0 = reinterpret_cast<const uint4*>(w + h0 * inter);
    const uint4* r1 = reinterpret_cast<const uint4*>(w + (second ? h0 + 1 : h0) * inter);
    const uint4* ar = reinterpret_cast<const uint4*>(act + p * inter);
    float part[2] = {};
    for (int64_t q = lane; q < pieces; q += 32) {
      float av[8], w0[8], w1[8];
      UnpackBf16x8(__ldg(r0 + q), w0);
      UnpackBf16x8(__ldg(r1 + q), w1);
      UnpackBf16x8(ar[q], av);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        part[0] += w0[i] * av[i];
        part[1] += w1[i] * av[i];
      }
    }
    acc[0] += wj * part[0];
    acc[1] += wj * part[1];
  }
  acc[0] = WarpSum(acc[0]);
  acc[1] = WarpSum(acc[1]);
  if (lane < 2 && (lane == 0 || second)) {
    const int64_t i = t * hidden + h0 + lane;
    out[i] = FewDownResult(out, shared, t, i, acc[lane]);
  }
}

// The few-token down kernel's work for one expert slot of one token, rows h0.. of which `rows`
// are valid (the others repeat row h0 and are not stored), in three helpers.
//
// Row h0 of expert e's (local index) down weights, or null when e is another rank's; row h0 + rr
// follows at rr * pieces 16-byte pieces.
__device__ __forceinline__ const uint4* DownExpertRows(int e, int num_local, const uint16_t* down,
                                                       int64_t hidden, int64_t inter, int64_t h0) {
  if (e < 0 || e >= num_local) return nullptr;
  return reinterpret_cast<const uint4*>(down + (static_cast<int64_t>(e) * hidden + h0) * inter);
}

// Pieces base and base + 32 of rows 0..kRows-1 from r (rows past `rows` repeat row 0; zero past
// a row's end).
template <int kRows>
__device__ __forceinline__ void LoadDownPieces(const uint4* r, int rows, int64_t base,
                                               int64_t pieces, uint4 (&wv)[2][kRows]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int64_t q = base + 32 * u;
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      wv[u][rr] =
          q < pieces ? __ldg(r + (rr < rows ? rr : 0) * pieces + q) : make_uint4(0, 0, 0, 0);
    }
  }
}

// part[rr] = this lane's share of row rr . act (ar): pieces lane, lane + 32, lane + 64, ...,
// two per step. wv holds the first step's weight pieces on entry.
template <int kRows>
__device__ __forceinline__ void DownSlotPartial(const uint4* r, int rows, const uint4* ar,
                                                int64_t pieces, int lane, uint4 (&wv)[2][kRows],
                                                float (&part)[kRows]) {
  for (int64_t base = lane; base < pieces; base += 64) {
    if (base != lane) LoadDownPieces(r, rows, base, pieces, wv);
    uint4 av[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t q = base + 32 * u;
      av[u] = q < pieces ? ar[q] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      float a[8];
      UnpackBf16x8(av[u], a);
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        float wf[8];
        UnpackBf16x8(wv[u][rr], wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) part[rr] += wf[i] * a[i];
      }
    }
  }
}

// The same sum with the experts spread over the warps: a block computes kRows rows h of one
// token, warp w the expert slots j = w, w + 8, ... At one token the kernel above ran H / 16 = 128
// blocks, one per SM, each warp walking its k experts with two short loads per lane in flight;
// here H / 4 = 512 blocks, and each warp issues its rows of one expert and the act row at once.
// The warps' weighted partials meet in shared memory; out is read and written once per row.
//
// With kSharedExpert the block also computes its rows of the shared expert's down projection
// from the shared expert's gate/up row (MoeSharedTerm): its (row, 16-byte piece) products are
// spread over all threads (at kRows = 4 and I = 512, one piece per thread), the weight piece
// loaded before PdlWait (weights are no kernel's output) and the gate/up pieces right after it,
// ahead of the routed loads. At batch 1 that projection as its own launch took 5.1 us for a
// ~0.5 us weight read. (A ninth warp per block for it instead measured 7.8 -> 10.6 us for this
// kernel: 92 registers x 288 threads leave two blocks per SM, two waves of the 512 blocks.)
// At 4 rows the registers are held to 3 blocks per SM (80); 4 per SM (64 registers, one wave
// of 512 blocks) spills here and measured slower: batch 1 3.72 vs 3.62 ms, batch 8 9.36 vs
// 8.59 ms. The shared expert's part costs each block a little latency, which batch 8 (4096
// blocks, ~10 waves) pays ~10 times: there the fused form measured 8.59 ms against 8.39 ms
// with the separate projection, at batch 1 3.62 against 3.70 ms (LaunchMoeExpertsFewTokens
// takes it up to kMoeSharedExpertFusedMaxTokens). By default those rows now come from the
// gate-up kernel (SharedExpertInGateUp) and this kernel adds them as a finished term; this form
// stays for MOBIUS_MOE_SHARED_IN_GATEUP=0 and the non-default gate-up shapes.
template <int kFewDownRows, bool kSharedExpert>
__global__ void __launch_bounds__(kFewWarps * 32, kFewDownRows <= 4 ? 3 : 1)
    MoeFewDownRowsKernel(const uint16_t* act, const int32_t* ids, const float* weights,
                         const uint16_t* down, int64_t hidden, int64_t inter, int k,
                         int first_expert, int num_local, uint16_t* out,
                         const MoeSharedTerm shared) {
  __shared__ float partial[kFewWarps][kFewDownRows];
  __shared__ float shared_partial[kSharedExpert ? kFewWarps : 1][kFewDownRows];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t t = blockIdx.y;
  const int64_t h0 = static_cast<int64_t>(blockIdx.x) * kFewDownRows;
  const int rows = hidden - h0 < kFewDownRows ? static_cast<int>(hidden - h0) : kFewDownRows;

  // The shared expert's first (row, piece) pair of this thread.
  const int64_t s_pieces = kSharedExpert ? shared.inter / 8 : 0;
  const int64_t s_pairs = rows * s_pieces;
  const bool s_first = kSharedExpert && threadIdx.x < s_pairs;
  int s_row = 0;
  int64_t s_piece = 0;
  uint4 s_w = make_uint4(0, 0, 0, 0), s_g = s_w, s_u = s_w;
  const uint4* s_gu = nullptr;
  if constexpr (kSharedExpert) {
    s_gu = reinterpret_cast<const uint4*>(shared.gate_up + t * 2 * shared.inter);
    if (s_first) {
      s_row = static_cast<int>(threadIdx.x / s_pieces);
      s_piece = threadIdx.x % s_pieces;
      s_w = __ldg(reinterpret_cast<const uint4*>(shared.down + (h0 + s_row) * shared.inter) +
                  s_piece);
    }
  }
  // This warp's first expert slot (j = warp) and its first 64 pieces of weight rows are loaded
  // before PdlWait: the ids and routing weights come from the top-k two launches back (the
  // gate-up kernel between waited for it before this grid could launch, PdlTrigger following
  // its PdlWait) and the expert weights are constants; only act is the gate-up's output. At one
  // token (I = 512) that is the block's whole weight read, which then overlaps the gate-up
  // kernel's tail instead of following it.
  const int64_t pieces = inter / 8;
  const uint4* first_rows = warp < k ? DownExpertRows(ids[t * k + warp] - first_expert, num_local,
                                                      down, hidden, inter, h0)
                                     : nullptr;
  const float first_weight = first_rows != nullptr ? weights[t * k + warp] : 0.f;
  uint4 first_wv[2][kFewDownRows];
  if (first_rows != nullptr) LoadDownPieces(first_rows, rows, lane, pieces, first_wv);

  PdlWait();
  PdlTrigger();
  if (s_first) {
    s_g = s_gu[s_piece];
    s_u = s_gu[s_pieces + s_piece];
  }

  float acc[kFewDownRows] = {};
  if (first_rows != nullptr) {
    float part[kFewDownRows] = {};
    DownSlotPartial(first_rows, rows, reinterpret_cast<const uint4*>(act + (t * k + warp) * inter),
                    pieces, lane, first_wv, part);
#pragma unroll
    for (int rr = 0; rr < kFewDownRows; ++rr) acc[rr] += first_weight * part[rr];
  }
  for (int j = warp + kFewWarps; j < k; j += kFewWarps) {
    const int64_t p = t * k + j;
    const uint4* r = DownExpertRows(ids[p] - first_expert, num_local, down, hidden, inter, h0);
    if (r == nullptr) continue;
    const float wj = weights[p];
    uint4 wv[2][kFewDownRows];
    LoadDownPieces(r, rows, lane, pieces, wv);
    float part[kFewDownRows] = {};
    DownSlotPartial(r, rows, reinterpret_cast<const uint4*>(act + p * inter), pieces, lane, wv,
                    part);
#pragma unroll
    for (int rr = 0; rr < kFewDownRows; ++rr) acc[rr] += wj * part[rr];
  }
#pragma unroll
  for (int rr = 0; rr < kFewDownRows; ++rr) acc[rr] = WarpSum(acc[rr]);
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < kFewDownRows; ++rr) partial[warp][rr] = acc[rr];
  }

  float shared_value = 0.f;
  if constexpr (kSharedExpert) {
    float sp[kFewDownRows] = {};
    if (s_first) AddSharedPair<kFewDownRows>(s_row, s_w, s_g, s_u, sp);
    AddSharedPairs(shared, t, h0, threadIdx.x + blockDim.x, s_pairs, sp);
    shared_value = SharedRowsSum(sp, shared_partial, rows);  // (its barrier covers partial too)
  } else {
    __syncthreads();
  }
  if (threadIdx.x < rows) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kFewWarps; ++w) sum += partial[w][threadIdx.x];
    const int64_t i = t * hidden + h0 + threadIdx.x;
    if constexpr (kSharedExpert) {
      // Rounded to bf16 as the separate projection (and SharedExpertInGateUp) stores it.
      out[i] =
          RoutedPlusShared(sum, Bf16ToF32(F32ToBf16(shared_value)), Load(shared.gate_logits, t));
    } else {
      out[i] = FewDownResult(out, shared, t, i, sum);
    }
  }
}

}  // namespace

namespace {
// out[p] = routes[e * stride + 1 + (p / k) mod routes[e * stride]] for e = ids[p], or -1
// (Backend::MapExpertIds).
__global__ void MapExpertIdsKernel(const int32_t* ids, const int32_t* routes, int stride,
                                   int64_t experts, int64_t n, int k, int32_t* out) {
  PdlWait();
  PdlTrigger();
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = ids[p];
    const int holders = e >= 0 && e < experts ? routes[e * stride] : 0;
    out[p] = holders > 0 ? routes[e * stride + 1 + (p / k) % holders] : -1;
  }
}
}  // namespace

void LaunchMapExpertIds(const int32_t* ids, const int32_t* routes, int stride, int64_t experts,
                        int64_t num_pairs, int k, int32_t* out, cudaStream_t stream) {
  if (num_pairs == 0) return;
  constexpr int kMapThreads = 256;
  LaunchPdl(
      "MapExpertIdsKernel", MapExpertIdsKernel,
      static_cast<unsigned>(std::min<int64_t>((num_pairs + kMapThreads - 1) / kMapThreads, 1024)),
      kMapThreads, 0, stream, ids, routes, stride, experts, num_pairs, k, out);
  CheckLaunch("MapExpertIds");
}

bool LaunchTopKSoftmaxWithSharedRows(AnyPtr logits, int64_t num_tokens, int num_experts, int k,
                                     bool renormalize, int32_t* ids, float* weights,
                                     const MoeSharedTerm& shared, int64_t hidden,
                                     uint16_t* shared_out, cudaStream_t stream) {
  static_assert(kMoeSharedBesideTopKMaxTokens == kSharedBesideTopKMaxTokens);
  if (num_tokens < 1 || num_tokens > kSharedBesideTopKMaxTokens || k < 1 || hidden < 1 ||
      shared.gate_up == nullptr || shared.down == nullptr || shared.inter < 8 ||
      shared.inter % 8 != 0 || shared.inter > kSharedBesideTopKMaxInter ||
      !Aligned16(shared.gate_up) || !Aligned16(shared.down) || shared_out == nullptr ||
      SelectTopKKernel(num_tokens, num_experts, k, IsAligned16(logits.data),
                       TopKOverrideFromEnv()) != TopKKernel::kBlockFilter) {
    return false;
  }
  constexpr int64_t kRowsPerBlock =
      int64_t{kSharedRowGroups} * kSharedUnitsPerGroup * kSharedRowsInGateUp;
  const int64_t shared_blocks = (hidden + kRowsPerBlock - 1) / kRowsPerBlock;
  LaunchPdl("TopKSoftmaxFilterSharedRowsKernel", TopKSoftmaxFilterSharedRowsKernel,
            static_cast<unsigned>(num_tokens + shared_blocks), kRegTopKThreads, 0, stream, logits,
            num_experts, k, renormalize, ids, weights, shared, num_tokens, hidden, shared_out);
  CheckLaunch("TopKSoftmaxWithSharedRows");
  return true;
}

void LaunchGemmFallback(const uint16_t* a, const uint16_t* w, int64_t m, int64_t n, int64_t k,
                        AnyMutPtr c, cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  GemmArgs args;
  args.a = a;
  args.lda = k;
  args.w = w;
  args.n = n;
  args.k = k;
  args.m = m;
  args.c = c;
  args.ldc = n;
  LaunchGroupedGemm<false>(args, 32, (m + 31) / 32, stream);
  CheckLaunch("GemmFallback");
}

size_t MoeScratchBytes(int64_t num_tokens, int k, int num_local_experts, int64_t hidden,
                       int64_t inter) {
  return CarveMoeScratch(nullptr, num_tokens, k, num_local_experts, hidden, inter).bytes;
}

const int32_t* LaunchMoeExperts(const uint16_t* x, const int32_t* ids, const float* weights,
                                const uint16_t* gate_up, const uint16_t* down, int64_t num_tokens,
                                int k, int num_local_experts, int first_expert, int64_t hidden,
                                int64_t inter, void* scratch, const MoeSharedTerm* shared,
                                uint16_t* out, cudaStream_t stream) {
  MoeScratch s =
      CarveMoeScratch(static_cast<char*>(scratch), num_tokens, k, num_local_experts, hidden, inter);
  const int64_t pairs = num_tokens * k;
  // Tensor cores need 16-byte rows: H and I multiples of 8 and 16-byte aligned operands.
  const bool tc = hidden % 8 == 0 && inter % 8 == 0 && Aligned16(x) && Aligned16(gate_up) &&
                  Aligned16(down) && !ForcedFma();
  s.bm = tc ? TcTileTokens(pairs, num_local_experts) : TileRows(pairs, num_local_experts);
  s.max_tiles = MaxTiles(pairs, num_local_experts, s.bm);
  if (shared != nullptr && (pairs == 0 || num_local_experts == 0)) {
    // Nothing would write out: the caller takes the unfused ops instead (launch.h).
    std::fprintf(stderr, "mobius cuda: MoeExperts with a shared term and no pairs\n");
    std::abort();
  }
  if (pairs == 0 || num_local_experts == 0) {
    const cudaError_t err =
        cudaMemsetAsync(s.counts, 0, sizeof(int32_t) * num_local_experts, stream);
    if (err != cudaSuccess) {
      std::fprintf(stderr, "mobius cuda: MoeExperts memset failed: %s\n", cudaGetErrorString(err));
      std::abort();
    }
    return s.counts;
  }
  if (pairs <= kFusedRoutePairs && num_local_experts <= kRouteSharedExperts && !ForcedFma()) {
    RouteSmallKernel<<<1, kScanThreads, 0, stream>>>(
        ids, static_cast<int>(pairs), k, first_expert, num_local_experts, s.bm, s.counts, s.offsets,
        s.tile_group, s.tile_row0, s.num_tiles, s.sorted_token, s.pair_pos);
    CheckLaunch("MoeRouteSmall");
  } else {
    // counts and cursor are adjacent: one memset clears both.
    const cudaError_t err = cudaMemsetAsync(
        s.counts, 0, reinterpret_cast<char*>(s.offsets) - reinterpret_cast<char*>(s.counts),
        stream);
    if (err != cudaSuccess) {
      std::fprintf(stderr, "mobius cuda: MoeExperts memset failed: %s\n", cudaGetErrorString(err));
      std::abort();
    }
    CountPairsKernel<<<GridFor(pairs, 256), 256, 0, stream>>>(ids, pairs, first_expert,
                                                              num_local_experts, s.counts);
    CheckLaunch("MoeCountPairs");
    ScanExpertsKernel<<<1, kScanThreads, 0, stream>>>(s.counts, num_local_experts, s.bm, s.offsets,
                                                      s.tile_group, s.tile_row0, s.num_tiles);
    CheckLaunch("MoeScanExperts");
    ScatterPairsKernel<<<GridFor(pairs, 256), 256, 0, stream>>>(
        ids, pairs, k, first_expert, num_local_experts, s.offsets, s.cursor, s.sorted_token,
        s.pair_pos);
    CheckLaunch("MoeScatterPairs");
  }

  // The grid covers the most tiles any routing can need; surplus blocks exit at once.
  if (tc) {
    TcArgs gu;
    gu.a = x;
    gu.lda = hidden;
    gu.a_rows = s.sorted_token;
    gu.w = gate_up;
    gu.w_group_stride = 2 * inter * hidden;
    gu.n_out = inter;
    gu.k = hidden;
    gu.tile_group = s.tile_group;
    gu.tile_row0 = s.tile_row0;
    gu.group_end = s.offsets + 1;
    gu.num_tiles = s.num_tiles;
    gu.c = s.act;
    gu.ldc = inter;
    LaunchTcGroupedGemm<true>(gu, s.bm, s.max_tiles, stream);
    CheckLaunch("MoeGateUp (tensor cores)");
    TcArgs dn = gu;
    dn.a = s.act;
    dn.lda = inter;
    dn.a_rows = nullptr;
    dn.w = down;
    dn.w_group_stride = hidden * inter;
    dn.n_out = hidden;
    dn.k = inter;
    dn.c = s.pair_out;
    dn.ldc = hidden;
    dn.c_bf16 = PairRowsBf16();
    LaunchTcGroupedGemm<false>(dn, s.bm, s.max_tiles, stream);
    CheckLaunch("MoeDown (tensor cores)");
  } else {
    GemmArgs gu;
    gu.a = x;
    gu.lda = hidden;
    gu.a_rows = s.sorted_token;
    gu.w = gate_up;
    gu.w_group_stride = 2 * inter * hidden;
    gu.n = inter;
    gu.k = hidden;
    gu.tile_group = s.tile_group;
    gu.tile_row0 = s.tile_row0;
    gu.group_end = s.offsets + 1;
    gu.num_tiles = s.num_tiles;
    gu.c = AnyMutPtr{s.act, false};
    gu.ldc = inter;
    LaunchGroupedGemm<true>(gu, s.bm, s.max_tiles, stream);
    CheckLaunch("MoeGateUp");

    GemmArgs dn = gu;
    dn.a = s.act;
    dn.lda = inter;
    dn.a_rows = nullptr;
    dn.w = down;
    dn.w_group_stride = hidden * inter;
    dn.n = hidden;
    dn.k = inter;
    dn.c = AnyMutPtr{s.pair_out, true};
    dn.ldc = hidden;
    LaunchGroupedGemm<false>(dn, s.bm, s.max_tiles, stream);
    CheckLaunch("MoeDown");
  }

  const bool vec = hidden % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0 &&
                   (shared == nullptr || reinterpret_cast<uintptr_t>(shared->value) % 8 == 0);
  const int64_t per_block = kCombineThreads * (vec ? 4 : 1);
  const dim3 grid(static_cast<unsigned>((hidden + per_block - 1) / per_block),
                  static_cast<unsigned>(num_tokens));
  const int32_t* pair_pos = s.pair_pos;
  auto combine = [&](auto* pair_out) {
    using PairRow = std::remove_const_t<std::remove_pointer_t<decltype(pair_out)>>;
    LaunchPdl("MoeCombine", vec ? CombineKernel<true, PairRow> : CombineKernel<false, PairRow>,
              grid, kCombineThreads, 0, stream, pair_out, pair_pos, weights, k, hidden,
              shared != nullptr ? shared->value : nullptr,
              shared != nullptr ? shared->gate_logits : AnyPtr{}, out);
  };
  if (tc && PairRowsBf16()) {
    combine(reinterpret_cast<const uint16_t*>(s.pair_out));
  } else {
    combine(static_cast<const float*>(s.pair_out));
  }
  CheckLaunch("MoeCombine");
  return s.counts;
}

namespace {

using FewGateUpFn = void (*)(const uint16_t*, const int32_t*, const uint16_t*, int64_t, int64_t,
                             int, int, int, uint16_t*, MoeSharedTerm, int64_t, uint16_t*);
using FewDownFn = void (*)(const uint16_t*, const int32_t*, const float*, const uint16_t*, int64_t,
                           int64_t, int, int, int, uint16_t*, MoeSharedTerm);

// The few-token kernels' shape: gate-up columns per warp group, pieces in flight per row, warps
// per column group (split hidden), down rows per block (0: the first, expert-serial down kernel).
struct FewConfig {
  int cols = 1, unroll = 2, split = 1, down_rows = 4;
};

// MOBIUS_MOE_FEW (A/B runs): "v1" = the first kernels (2 columns, unroll 2, expert-serial down);
// otherwise tokens c1/c2 (columns), u2/u4/u8 (unroll), s2/s4 (split), d2/d4/d8 (down rows)
// override the default.
FewConfig FewConfigFor() {
  static const std::string variant = [] {
    const char* env = std::getenv("MOBIUS_MOE_FEW");
    return std::string(env != nullptr ? env : "");
  }();
  FewConfig c;
  if (variant == "v1") return FewConfig{2, 2, 1, 0};
  auto has = [](std::string_view token) { return variant.find(token) != std::string::npos; };
  if (has("c1")) c.cols = 1;
  if (has("c2")) c.cols = 2;
  if (has("u2")) c.unroll = 2;
  if (has("u4")) c.unroll = 4;
  if (has("u8")) c.unroll = 8;
  if (has("s2")) c.split = 2;
  if (has("s4")) c.split = 4;
  if (has("d2")) c.down_rows = 2;
  if (has("d4")) c.down_rows = 4;
  if (has("d8")) c.down_rows = 8;
  return c;
}

template <int kSplit>
FewGateUpFn FewGateUpSplit(const FewConfig& c) {
  if (c.cols == 1) {
    return c.unroll == 4   ? MoeFewGateUpKernel<1, 4, kSplit>
           : c.unroll == 8 ? MoeFewGateUpKernel<1, 8, kSplit>
                           : MoeFewGateUpKernel<1, 2, kSplit>;
  }
  return c.unroll == 4   ? MoeFewGateUpKernel<2, 4, kSplit>
         : c.unroll == 8 ? MoeFewGateUpKernel<2, 8, kSplit>
                         : MoeFewGateUpKernel<2, 2, kSplit>;
}

// The gate-up kernel that also computes the shared expert's rows: one or two columns per warp
// at the default unroll and split, with the default four-row down blocks whose per-row sums it
// reproduces (null otherwise, and the down kernel computes them).
FewGateUpFn FewGateUpWithSharedRows(const FewConfig& c) {
  const FewConfig d;
  if (c.unroll != d.unroll || c.split != d.split || c.down_rows != kSharedRowsInGateUp) {
    return nullptr;
  }
  return c.cols == 1   ? MoeFewGateUpKernel<1, 2, 1, true>
         : c.cols == 2 ? MoeFewGateUpKernel<2, 2, 1, true>
                       : nullptr;
}

// Blocks of the gate-up kernel with the shared rows resident at once: one wave. Queried once,
// as TcGemvSplit does (the variant is fixed per process by FewConfigFor); a failed query leaves
// one block per SM, a smaller first wave.
int64_t SharedRowsFirstWave(FewGateUpFn kernel) {
  static const int64_t blocks = [kernel] {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kFewWarps * 32, 0);
    return static_cast<int64_t>(std::max(1, sms)) * std::max(1, per_sm);
  }();
  return blocks;
}

FewGateUpFn FewGateUp(const FewConfig& c) {
  return c.split == 4   ? FewGateUpSplit<4>(c)
         : c.split == 2 ? FewGateUpSplit<2>(c)
                        : FewGateUpSplit<1>(c);
}

template <int kFewDownRows>
FewDownFn FewDownRows(bool shared_expert) {
  return shared_expert ? MoeFewDownRowsKernel<kFewDownRows, true>
                       : MoeFewDownRowsKernel<kFewDownRows, false>;
}

// The down kernel of `c`, with the shared expert's projection inside (kSharedExpert) or not;
// null where that combination does not exist (the first kernel takes a finished term only).
FewDownFn FewDown(const FewConfig& c, bool shared_expert) {
  switch (c.down_rows) {
    case 0:
      return shared_expert ? nullptr : MoeFewDownKernel;
    case 2:
      return FewDownRows<2>(shared_expert);
    case 8:
      return FewDownRows<8>(shared_expert);
    default:
      return FewDownRows<4>(shared_expert);
  }
}

}  // namespace

bool LaunchMoeExpertsFewTokens(const uint16_t* x, const int32_t* ids, const float* weights,
                               const uint16_t* gate_up, const uint16_t* down, int64_t num_tokens,
                               int k, int num_local_experts, int first_expert, int64_t hidden,
                               int64_t inter, uint16_t* act_scratch, uint16_t* out,
                               const MoeSharedTerm* shared, cudaStream_t stream) {
  static const bool grouped_only = MoeGemmKnob() == 2;
  const int64_t pairs = num_tokens * k;
  if (pairs == 0 || pairs > kMoeFewTokensMaxPairs || hidden % 8 != 0 || inter % 8 != 0 ||
      !Aligned16(x) || !Aligned16(gate_up) || !Aligned16(down) || !Aligned16(act_scratch) ||
      ForcedFma() || grouped_only) {
    return false;
  }
  const bool shared_expert = shared != nullptr && shared->value == nullptr;
  if (shared_expert && (num_tokens > shared->fused_max_tokens || shared->gate_up == nullptr ||
                        shared->down == nullptr || shared->inter <= 0 || shared->inter % 8 != 0 ||
                        !Aligned16(shared->gate_up) || !Aligned16(shared->down))) {
    return false;
  }
  const FewConfig c = FewConfigFor();
  // The shared expert's down projection: in the gate-up kernel (before its PdlWait) by default,
  // the down kernel then adding the finished rows; MOBIUS_MOE_SHARED_IN_GATEUP=0 leaves it to
  // the down kernel (A/B runs). Both give the same bits.
  static const bool in_gate_up = KnobChoice("MOBIUS_MOE_SHARED_IN_GATEUP", {"0", "1"}) != 1;
  const MoeSharedTerm term = shared == nullptr ? MoeSharedTerm{} : *shared;
  MoeSharedTerm down_term = term;
  uint16_t* shared_out = nullptr;
  FewGateUpFn gate_up_kernel = FewGateUp(c);
  FewDownFn down_kernel = FewDown(c, shared_expert);
  const FewGateUpFn with_rows = FewGateUpWithSharedRows(c);
  const int64_t cols_per_block = static_cast<int64_t>(c.cols) * kFewWarps / c.split;
  const dim3 gate_up_grid(static_cast<unsigned>((inter + cols_per_block - 1) / cols_per_block),
                          static_cast<unsigned>(pairs));
  MoeSharedTerm gate_up_term = term;
  if (shared_expert && in_gate_up && term.rows_in_gate_up && with_rows != nullptr) {
    shared_out = act_scratch + MoeFewTokensSharedRowsOffset(num_tokens, k, inter);
    down_term.value = shared_out;
    gate_up_kernel = with_rows;
    down_kernel = FewDown(c, /*shared_expert=*/false);
    // Beyond kSharedRowsSpreadMaxTokens only the first wave's blocks take the shared rows
    // (SharedExpertInGateUp); MOBIUS_MOE_SHARED_SPREAD=grid spreads them over the grid.
    static const bool spread = KnobChoice("MOBIUS_MOE_SHARED_SPREAD", {"wave", "grid"}) == 1;
    if (num_tokens > kSharedRowsSpreadMaxTokens && !spread) {
      gate_up_term.unit_blocks = static_cast<int>(std::min<int64_t>(
          static_cast<int64_t>(gate_up_grid.x) * gate_up_grid.y, SharedRowsFirstWave(with_rows)));
    }
  }
  if (down_kernel == nullptr) return false;
  LaunchPdl("MoeFewGateUpKernel", gate_up_kernel, gate_up_grid, kFewWarps * 32, 0, stream, x, ids,
            gate_up, hidden, inter, k, first_expert, num_local_experts, act_scratch, gate_up_term,
            num_tokens, shared_out);
  CheckLaunch("MoeFewGateUp");
  // The first down kernel: two rows per warp, 16 per block.
  const int64_t rows_per_block = c.down_rows == 0 ? 2 * kFewWarps : c.down_rows;
  LaunchPdl("MoeFewDownKernel", down_kernel,
            dim3(static_cast<unsigned>((hidden + rows_per_block - 1) / rows_per_block),
                 static_cast<unsigned>(num_tokens)),
            kFewWarps * 32, 0, stream, act_scratch, ids, weights, down, hidden, inter, k,
            first_expert, num_local_experts, out, down_term);
  CheckLaunch("MoeFewDown");
  return true;
}

}  // namespace mobius::kernels::cuda
