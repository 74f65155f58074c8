// Mixture-of-experts kernels for many tokens: the device-side grouping of (token, expert) pairs
// by expert (counting sort), a grouped GEMM over the groups (tensor cores, or CUDA-core FMA
// tiles), and the weighted combine. Decode steps' few-token kernels are in moe_few_tokens.cu,
// the router's top-k in topk_softmax.cu. The grouped GEMM also serves as Linear's fallback when
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
#include "kernels/cuda/moe_common.cuh"
#include "kernels/cuda/ranked_lists.cuh"
#include "kernels/cuda/tuning_knobs.h"
#include "kernels/cuda/wgmma.cuh"

namespace mobius::kernels::cuda {

int MoeGemmKnob() {
  static const int choice = KnobChoice("MOBIUS_MOE_GEMM", {"fma", "grouped"});
  return choice;
}

bool ForcedFma() {
  static const bool forced = MoeGemmKnob() == 1;
  return forced;
}

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
  // down only: c holds bf16 pair rows instead of fp32 (see PairRowsBf16).
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

// A grouped-GEMM block's tile of the routing's tile table and its slice of weight rows.
struct GroupedTile {
  int tile = 0, slice = 0;
  int64_t group = 0, row0 = 0, row_end = 0;  // the tile's rows [row0, row_end) of its group
};
// False for blocks past the routing's tile count (the grid depends on the shapes only).
__device__ __forceinline__ bool LocateTile(const TcArgs& args, GroupedTile& t) {
  t.tile = blockIdx.x;
  t.slice = blockIdx.y;
  if (args.consecutive_slices > 0) {
    t.tile = blockIdx.x / args.consecutive_slices;
    t.slice = blockIdx.x % args.consecutive_slices;
  }
  if (t.tile >= *args.num_tiles) return false;
  t.group = args.tile_group[t.tile];
  t.row0 = args.tile_row0[t.tile];
  t.row_end = args.group_end[t.group];
  return true;
}
// src_row[i] = row of `a` for token i of the tile, -1 past its group (threads 0..kTokens-1).
template <int kTokens>
__device__ __forceinline__ void FillSourceRows(const TcArgs& args, const GroupedTile& t, int tid,
                                               int32_t* src_row) {
  if (tid < kTokens) {
    const int64_t r = t.row0 + tid;
    src_row[tid] =
        r < t.row_end ? (args.a_rows != nullptr ? args.a_rows[r] : static_cast<int>(r)) : -1;
  }
}
// One pipeline stage's 16-byte copies into shared rows: src[i] + k0 to base + dst[i]; a null
// source (a row past the group or the matrix) or K past its end writes zeros. With kMaySkip, a
// dst of kNoSharedRow marks a slot this thread does not copy.
constexpr uint32_t kNoSharedRow = 0xffffffffu;
template <int kChunks, bool kMaySkip>
__device__ __forceinline__ void CopyStageRows(uint32_t base, const uint32_t (&dst)[kChunks],
                                              const uint16_t* const (&src)[kChunks], int64_t k0,
                                              bool k_ok, const uint16_t* fallback) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    if (kMaySkip && dst[i] == kNoSharedRow) continue;
    const bool ok = k_ok && src[i] != nullptr;
    CopyAsync16(base + dst[i], ok ? src[i] + k0 : fallback, ok);
  }
}

// The grouped GEMMs' pipeline prologue: kStages - 1 stages, one cp.async group each. down issues
// the weights of all of them before waiting for gate_up (uncommitted, they join the first group),
// then the tokens; gate_up has waited already.
template <bool kGateUp, int kStages, typename LoadWeights, typename LoadTokens>
__device__ __forceinline__ void IssuePrologue(int num_k, LoadWeights& load_weights,
                                              LoadTokens& load_tokens) {
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
}

// Expert weight row of shared row r for a block whose slice starts at feature m0: gate_up keeps
// kHalf features' gate rows, then their up rows ([2 * n_out, K] weights, gate rows first); down
// one row per feature. `valid`: the row is inside the matrix.
template <bool kGateUp, int kHalf>
__device__ __forceinline__ int64_t ExpertWeightRow(int r, int64_t m0, int64_t n_out, bool& valid) {
  if constexpr (kGateUp) {
    static_assert((kHalf & (kHalf - 1)) == 0, "a power of two: r's split is a shift and a mask");
    constexpr int kShift = [] {
      int shift = 0;
      while ((1 << shift) < kHalf) ++shift;
      return shift;
    }();
    const int64_t feature = m0 + (r & (kHalf - 1));
    valid = feature < n_out;
    return (r >> kShift) * n_out + feature;
  } else {
    valid = m0 + r < n_out;
    return m0 + r;
  }
}
// The down GEMM's output: pair `pos`'s value of `feature`, in bf16 or fp32 pair rows.
__device__ __forceinline__ void StorePairRowValue(const TcArgs& args, int64_t pos, int64_t feature,
                                                  float v) {
  if (args.c_bf16) {
    static_cast<uint16_t*>(args.c)[pos * args.ldc + feature] = F32ToBf16(v);
  } else {
    static_cast<float*>(args.c)[pos * args.ldc + feature] = v;
  }
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
  GroupedTile t;
  if (!LocateTile(args, t)) return;
  const int64_t row0 = t.row0, row_end = t.row_end;
  // n8 fragments that hold tokens of this tile (the expert's last tile is usually partial):
  // the others are neither multiplied nor read from shared memory.
  const int live_nt = static_cast<int>((min(static_cast<int64_t>(kBN), row_end - row0) + 7) / 8);
  const int64_t m0 = static_cast<int64_t>(t.slice) * (kGateUp ? 16 : 32) * kWarpsM;
  const uint16_t* w = args.w + t.group * args.w_group_stride;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % kWarpsM, wk = warp / kWarpsM;
  FillSourceRows<kBN>(args, t, tid, src_row);
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
    b_dst[i] = r < kBN ? Cfg::kStageA + Swizzle(r, chunk) : kNoSharedRow;
  }

  const uint32_t smem_base = SharedAddress(smem);
  const int num_k = static_cast<int>((args.k + kTcBK - 1) / kTcBK);
  auto load_weights = [&](int kt) {
    const int64_t k0 = static_cast<int64_t>(kt) * kTcBK;
    CopyStageRows<Cfg::kChunksA, false>(smem_base + (kt % kStages) * Cfg::kStageBytes, a_dst, a_src,
                                        k0, k0 + chunk * 8 < args.k, w);
  };
  auto load_tokens = [&](int kt) {
    const int64_t k0 = static_cast<int64_t>(kt) * kTcBK;
    CopyStageRows<Cfg::kChunksB, true>(smem_base + (kt % kStages) * Cfg::kStageBytes, b_dst, b_src,
                                       k0, k0 + chunk * 8 < args.k, args.a);
  };

  float acc[2][kNT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.0f;

  IssuePrologue<kGateUp, kStages>(num_k, load_weights, load_tokens);
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
          if (feature < args.n_out) StorePairRowValue(args, pos, feature, acc[mt][j][e]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The same grouped GEMM on Hopper's warpgroup MMA (wgmma), for 64- and 128-token tiles: experts
// that see 40 or more tokens each, i.e. prefill over banks of few experts (Qwen3-Next's 512 at 8K
// tokens: 160 pairs an expert). There the products, not the weight stream, set the time, and the
// mma.sync kernel above reaches only ~230 (gate-up) and ~185 (down) TFLOP/s (ncu, H100,
// Qwen3-Next's 8K prefill), bound by its ldmatrix traffic and issue rate. A block owns 128 weight
// rows and the tile's tokens. gate_up: the slice's 64 features' gate rows (shared rows 0-63) then
// their up rows (64-127), so a thread holds a feature's gate and up sums at the same index of its
// two accumulators and SiLU(gate) * up stays in registers; down: 128 features. The stages are the
// kernel above's 128-byte rows with the XOR swizzle, which is wgmma's 128-byte swizzle, so each
// warpgroup's two m64n64k16 per 16 K (N: its 64 tokens) read them from shared memory as they land
// (stage bases 1024-byte aligned).
//
// Two forms (WgmmaTile): 64 tokens on one warpgroup (two m64n64k16 per 16 K, 4 stages), and 128
// tokens on two warpgroups of 64 sharing the weight rows (each the 64-token form's products on
// its half; 3 stages of 32 KB, so two blocks an SM as before). A block reads its weight rows once
// per tile: at 64 tokens an expert of 160 pairs is three tiles, so its weights cross from L2 into
// shared memory three times where 128-token tiles need two.
// Measured, the 64-token form against the mma.sync kernel's (H100, session 49): 512 experts at
// top-10, 8192 tokens 2685 -> 2066 us, 4096 tokens 1633 -> 1467 us; Qwen3-Next's 8K prefill (12
// layers) 57.5 -> 49.9 ms, still 1.9x its bound there (~250 TFLOP/s). The 128-token form against
// the 64-token one (H100, session 52, medians of two rounds): 8192 tokens 2083 -> 2018 us, 4096
// tokens 1467 -> 1344 us; Qwen3-Next's 8K prefill 48.1 -> 46.7 ms, 4K 27.9 -> 27.4 ms.
// Measured and removed: weights on N (64 tokens x 256 weight rows, m64n256k16, one block an SM;
// session 50, 8192 tokens 2925 us), 128 tokens on one warpgroup (two m64n128k16; session 52,
// 2118 / 2100 us) and 256 weight rows x 128 tokens on two warpgroups (one block an SM; 2157 /
// 2164 us).

// kGroups warpgroups of 64 tokens each, sharing the block's 128 weight rows.
template <int kGroupsT, int kStagesT>
struct WgmmaTile {
  static constexpr int kGroups = kGroupsT, kStages = kStagesT;
  static_assert(kGroups == 1 || kGroups == 2);
  static constexpr int kGroupTokens = 64;
  static constexpr int kThreads = 128 * kGroups;
  static constexpr int kRows = 128;  // weight rows a block
  static constexpr int kTokens = kGroupTokens * kGroups;
  static constexpr int kStageA = kRows * kTcRowBytes;  // a stage: weight rows, then tokens
  static constexpr int kStageBytes = kStageA + kTokens * kTcRowBytes;
  static constexpr int kSmem = kStages * kStageBytes + 1024;  // + slack for the alignment
  // 16-byte copies a thread makes per stage: column `tid % 8` of rows tid / 8 + i * kRowStep.
  static constexpr int kRowStep = kThreads / 8;
  static constexpr int kChunksA = kRows / kRowStep, kChunksB = kTokens / kRowStep;
  static constexpr int kAcc = kGroupTokens / 2;  // accumulators a thread per 64 weight rows
};
using WgmmaTile64 = WgmmaTile<1, 4>;
using WgmmaTile128 = WgmmaTile<2, 3>;

// The wgmma kernels' main loop over K: stage kt's copies land (then the async-proxy fence, since
// cp.async wrote through the generic proxy and wgmma reads through the async one), issue(base)
// queues and commits the wgmmas of the stage at shared address `base`, and once stage kt - 1's
// products are done in every warp its buffer takes stage kt + kStages - 1's copies while stage
// kt's stay in flight. On return every product is done and every copy has landed.
template <int kStages, int kStageBytes, typename Issue, typename LoadWeights, typename LoadTokens>
__device__ __forceinline__ void RunWgmmaStages(int num_k, uint32_t smem_base, Issue&& issue,
                                               LoadWeights& load_weights, LoadTokens& load_tokens) {
  for (int kt = 0; kt < num_k; ++kt) {
    CopyAsyncWait<kStages - 2>();
    wgmma::FenceProxyAsync();
    __syncthreads();  // stage kt landed for every thread
    issue(smem_base + (kt % kStages) * kStageBytes);
    wgmma::Wait<1>();
    __syncthreads();
    if (kt + kStages - 1 < num_k) {
      load_weights(kt + kStages - 1);
      load_tokens(kt + kStages - 1);
    }
    CopyAsyncCommit();
  }
  wgmma::Wait<0>();
  CopyAsyncWait<0>();
}

template <bool kGateUp, typename Tile>
__global__ void __launch_bounds__(Tile::kThreads) TcGroupedGemmWgmmaKernel(const TcArgs args) {
  extern __shared__ char smem_raw[];
  __shared__ int32_t src_row[Tile::kTokens];  // row of `a` for each token of the tile, -1: past it
  // gate_up waits for the grouping at once (down requests its first weight stages before waiting
  // for gate_up's activations, in IssuePrologue).
  if constexpr (kGateUp) {
    PdlWait();
    PdlTrigger();
  }
  GroupedTile t;
  if (!LocateTile(args, t)) return;
  FillSourceRows<Tile::kTokens>(args, t, threadIdx.x, src_row);
  __syncthreads();
  const int64_t row0 = t.row0, row_end = t.row_end;
  const int64_t m0 = static_cast<int64_t>(t.slice) * (kGateUp ? Tile::kRows / 2 : Tile::kRows);
  const uint16_t* w = args.w + t.group * args.w_group_stride;
  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, group = tid >> 7;

  // Rows past the matrix or the group are zero-filled.
  const int chunk = tid & 7;
  const uint16_t* a_src[Tile::kChunksA];
  uint32_t a_dst[Tile::kChunksA];
#pragma unroll
  for (int i = 0; i < Tile::kChunksA; ++i) {
    const int r = (tid >> 3) + i * Tile::kRowStep;
    bool valid;
    const int64_t grow = ExpertWeightRow<kGateUp, Tile::kRows / 2>(r, m0, args.n_out, valid);
    a_src[i] = valid ? w + grow * args.k + chunk * 8 : nullptr;
    a_dst[i] = Swizzle(r, chunk);
  }
  const uint16_t* b_src[Tile::kChunksB];
  uint32_t b_dst[Tile::kChunksB];
#pragma unroll
  for (int i = 0; i < Tile::kChunksB; ++i) {
    const int r = (tid >> 3) + i * Tile::kRowStep;
    const int sr = src_row[r];
    b_src[i] = sr >= 0 ? args.a + sr * args.lda + chunk * 8 : nullptr;
    b_dst[i] = Tile::kStageA + Swizzle(r, chunk);
  }

  const uint32_t smem_base = (SharedAddress(smem_raw) + 1023u) & ~1023u;
  const int num_k = static_cast<int>((args.k + kTcBK - 1) / kTcBK);
  auto load_weights = [&](int kt) {
    const int64_t k0 = static_cast<int64_t>(kt) * kTcBK;
    CopyStageRows<Tile::kChunksA, false>(smem_base + (kt % Tile::kStages) * Tile::kStageBytes,
                                         a_dst, a_src, k0, k0 + chunk * 8 < args.k, w);
  };
  auto load_tokens = [&](int kt) {
    const int64_t k0 = static_cast<int64_t>(kt) * kTcBK;
    CopyStageRows<Tile::kChunksB, false>(smem_base + (kt % Tile::kStages) * Tile::kStageBytes,
                                         b_dst, b_src, k0, k0 + chunk * 8 < args.k, args.a);
  };

  IssuePrologue<kGateUp, Tile::kStages>(num_k, load_weights, load_tokens);

  // This warpgroup's tokens: shared token rows [token0, + 64); the weight rows: the block's two
  // 64-row halves (gate_up: the slice's 64 features' gate rows, then their up rows; down: 128
  // consecutive features from m0). A group whose tokens all lie past the tile's end (the last
  // tile of an expert) skips its products.
  const int token0 = group * Tile::kGroupTokens;
  const bool busy = row0 + token0 < row_end;
  // acc[h]: the weight rows at shared row 64 h x the group's tokens.
  float acc[2][Tile::kAcc];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < Tile::kAcc; ++i) acc[h][i] = 0.0f;
  RunWgmmaStages<Tile::kStages, Tile::kStageBytes>(
      num_k, smem_base,
      [&](uint32_t base) {
        if (!busy) return;
        wgmma::FenceRegisters(acc[0]);
        wgmma::FenceRegisters(acc[1]);
        wgmma::Fence();
#pragma unroll
        for (int kk = 0; kk < kTcBK / 16; ++kk) {
          const uint64_t desc_b =
              wgmma::KMajorDescriptor(base + Tile::kStageA + token0 * kTcRowBytes + kk * 32);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            wgmma::WgmmaSS_m64n64k16(
                acc[h], wgmma::KMajorDescriptor(base + h * 64 * kTcRowBytes + kk * 32), desc_b, 1);
          }
        }
        wgmma::Commit();
        wgmma::FenceRegisters(acc[0]);
        wgmma::FenceRegisters(acc[1]);
      },
      load_weights, load_tokens);
  wgmma::FenceRegisters(acc[0]);
  wgmma::FenceRegisters(acc[1]);
  if (!busy) return;

  // Accumulator element 4j + e of warp w (of its warpgroup): weight row 16w + lane / 4 + 8 (e / 2)
  // of each 64-row half, token 8j + 2 (lane % 4) + e % 2 of the group's (the m16n8 fragment
  // layout, one per 8 tokens).
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < Tile::kGroupTokens / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = token0 + j * 8 + tq * 2 + (e & 1);
      if (row0 + n >= row_end) continue;
      const int64_t pos = row0 + n;
      const int row = warp * 16 + g + 8 * (e >> 1);
      if constexpr (kGateUp) {
        const int64_t feature = m0 + row;
        if (feature < args.n_out) {
          static_cast<uint16_t*>(args.c)[pos * args.ldc + feature] =
              F32ToBf16(Silu(acc[0][j * 4 + e]) * acc[1][j * 4 + e]);
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t feature = m0 + h * 64 + row;
          if (feature < args.n_out) StorePairRowValue(args, pos, feature, acc[h][j * 4 + e]);
        }
      }
    }
  }
}

// Launches grouped-GEMM kernel kKernel over max_tiles tiles x the slices of `rows_per_slice`
// output features, raising its dynamic shared-memory limit first (once per kernel and device: a
// template parameter, so that each kernel has its own record). Benchmark knob (read once):
// MOBIUS_PDL=0 (or the older MOBIUS_MOE_PDL=0) launches the GEMMs and the combine without
// programmatic dependent launch.
template <bool kGateUp, auto kKernel>
void LaunchGroupedGrid(int threads, int smem, int64_t rows_per_slice, const TcArgs& args,
                       int64_t max_tiles, cudaStream_t stream) {
  static std::atomic<uint64_t> raised{0};  // a bit per device
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if ((raised.load(std::memory_order_relaxed) & bit) == 0) {
    const cudaError_t err =
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) {
      std::fprintf(stderr, "mobius cuda: MoE GEMM shared memory (%d bytes): %s\n", smem,
                   cudaGetErrorString(err));
      std::abort();
    }
    raised.fetch_or(bit, std::memory_order_relaxed);
  }
  const int64_t slices = (args.n_out + rows_per_slice - 1) / rows_per_slice;
  static const bool consecutive = KnobChoice("MOBIUS_MOE_SLICE_ORDER", {"0", "1"}) != 1;
  TcArgs a = args;
  a.consecutive_slices =
      consecutive && max_tiles * slices <= int64_t{0x7fffffff} ? static_cast<int>(slices) : 0;
  const dim3 grid = a.consecutive_slices > 0
                        ? dim3(static_cast<unsigned>(max_tiles * slices))
                        : dim3(static_cast<unsigned>(max_tiles), static_cast<unsigned>(slices));
  LaunchPdl(kGateUp ? "MoeGateUp" : "MoeDown", kKernel, grid, threads, smem, stream, a);
}

template <bool kGateUp, int kBN, int kWarpsM, int kWarpsK, int kStages>
void LaunchTc(const TcArgs& args, int64_t max_tiles, cudaStream_t stream) {
  using Cfg = TcConfig<kBN, kWarpsM, kWarpsK, kStages>;
  LaunchGroupedGrid<kGateUp, TcGroupedGemmKernel<kGateUp, kBN, kWarpsM, kWarpsK, kStages>>(
      Cfg::kThreads, Cfg::kSmem, kGateUp ? 16 * kWarpsM : 32 * kWarpsM, args, max_tiles, stream);
}

template <bool kGateUp, typename Tile>
void LaunchWgmma(const TcArgs& args, int64_t max_tiles, cudaStream_t stream) {
  LaunchGroupedGrid<kGateUp, TcGroupedGemmWgmmaKernel<kGateUp, Tile>>(
      Tile::kThreads, Tile::kSmem, kGateUp ? Tile::kRows / 2 : Tile::kRows, args, max_tiles,
      stream);
}

// The kernel for 64-token tiles. Benchmark knob (read once): MOBIUS_MOE_WGMMA=0 runs them on the
// mma.sync kernel (the form before session 49). 128-token tiles are wgmma-only.
bool WideTilesOnMmaSync() {
  static const bool mma_sync = KnobChoice("MOBIUS_MOE_WGMMA", {"0", "1"}) == 1;
  return mma_sync;
}

// Token-tile widths of the tensor-core path, chosen from the mean number of pairs per local
// expert (shapes only, so the launch does not depend on the routing).
// Benchmark knobs (read once): MOBIUS_MOE_TILE_N=8|16|32|64|128 forces the token-tile width;
// MOBIUS_MOE_GEMM=fma forces the CUDA-core path with the multi-launch grouping (the old kernel).
int ForcedTileTokens() {
  static const int forced = [] {
    const int choice = KnobChoice("MOBIUS_MOE_TILE_N", {"8", "16", "32", "64", "128"});
    return choice == 0 ? 0 : 4 << choice;
  }();
  return forced;
}
// Pair rows in bf16: the tensor-core down GEMM writes its per-pair rows in bf16 and the combine
// reads them so, halving the rows' traffic (at 8192 tokens 0.54 GB written and read back per
// layer in fp32). Each row is rounded once more before the weighted sum (fp32 accumulation in
// the combine), as the reference's own bf16 expert outputs are. Measured on the H200, fp32 /
// bf16 rows: session 14, moe.T8192 4259 / 4213 us, T4096 3952 / 3916, 8K prefill 274.0 / 270.9
// ms, batch-256 decode 100.39 / 100.13 ms; session 38, 8K prefill 256.0 / 253.7 ms (four runs
// each). On from kPairRowsBf16MinTokens tokens a step (prefill chunks) and off below: the extra
// rounding separates the tensor-core path (verify steps of k + 1 tokens) from the few-token
// kernels (plain one-token steps) enough that on the tiny fixtures the MTP verify accepted 11%
// of the target's own greedy drafts instead of over 90% (CudaSpeculativeTest), so greedy
// outputs with MTP would no longer match those without. A step of verify rows alone stays
// below the threshold unless max_num_seqs x (spec_tokens + 1) reaches it; verify rows that
// share a step of 2048+ tokens with prefill chunks (under load) take bf16 rows too. Drafts are
// still checked against that step's own logits; what can change there is how many are
// accepted, and whether greedy outputs with MTP equal those without (a decode token's numerics
// already depend on the step it lands in). MOBIUS_MOE_PAIR_BF16=0 / 1 (read once) forces fp32 /
// bf16 rows at every size.
constexpr int64_t kPairRowsBf16MinTokens = 2048;
bool PairRowsBf16(int64_t num_tokens) {
  static const int forced = KnobChoice("MOBIUS_MOE_PAIR_BF16", {"0", "1"});
  if (forced != 0) return forced == 2;
  return num_tokens >= kPairRowsBf16MinTokens;
}

int TcTileTokens(int64_t pairs, int64_t num_local) {
  const int forced = ForcedTileTokens();
  if (forced != 0) return forced;
  // Below 40 pairs per expert, 32-token tiles: a tile's n8 fragments past its last token are
  // skipped, so a tile of 1-8 tokens costs what an 8-token tile did, while an expert of up to 32
  // tokens is one tile (its weights read once). Measured against the former 8/16-token choice at
  // low means (H200, release dims): T = 256 2153 -> 2072 us, a 1K-token prefill 171.0 ->
  // 155.1 ms, batch-256 decode 104.2 -> 100.9 ms; T = 64 unchanged. From 40, 64-token tiles on
  // the wgmma kernel. (The release bank's 8K prefill, 25.6 pairs an expert, is bound by its weight
  // stream: on the H200 the mma.sync kernel's 64-token form was 3.7% slower there; the wgmma form
  // was not compared at that size on the same card.) From 64, 128-token tiles (two warpgroups of
  // 64 sharing the weight rows): there most experts hold more than one 64-token tile, and the
  // wider tile reads their weights once (H100, 512 experts at top-10: 80 pairs an expert 1467 ->
  // 1344 us, 160 pairs 2083 -> 2018 us; below 64 it loses: 40 pairs 1240 -> 1248 us, 60 pairs
  // 1311 -> 1325 us, session 53).
  if (pairs < 40 * num_local) return 32;
  if (pairs < 64 * num_local) return 64;
  return 128;
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
    case 64:
      if (WideTilesOnMmaSync()) {
        LaunchTc<kGateUp, 64, 4, 2, 4>(args, max_tiles, stream);
      } else {
        LaunchWgmma<kGateUp, WgmmaTile64>(args, max_tiles, stream);
      }
      break;
    default:
      LaunchWgmma<kGateUp, WgmmaTile128>(args, max_tiles, stream);
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
  const bool dn_bf16 = tc && PairRowsBf16(num_tokens);
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
    dn.c_bf16 = dn_bf16;
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
  if (dn_bf16) {
    combine(reinterpret_cast<const uint16_t*>(s.pair_out));
  } else {
    combine(static_cast<const float*>(s.pair_out));
  }
  CheckLaunch("MoeCombine");
  return s.counts;
}

}  // namespace mobius::kernels::cuda
