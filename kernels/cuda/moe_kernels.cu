// Mixture-of-experts kernels: router top-k softmax, the device-side grouping of (token, expert)
// pairs by expert (counting sort), a grouped GEMM over the groups, and the weighted combine.
// The grouped GEMM also serves as Linear's fallback when cuBLASLt offers no algorithm.
#include <climits>

#include "kernels/cuda/common.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kTopKThreads = 256;
constexpr int kScanThreads = 1024;

// ---------------------------------------------------------------------------------------------
// TopKSoftmax: one block per token, looping over any number of experts.

__device__ __forceinline__ bool Better(float v, int i, float best_v, int best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

__global__ void TopKSoftmaxKernel(AnyPtr logits, int num_experts, int k, bool renormalize,
                                  int32_t* ids, float* weights) {
  extern __shared__ int chosen[];  // [k]
  __shared__ float red[32];
  __shared__ float best_v_s[32];
  __shared__ int best_i_s[32];
  const int64_t t = blockIdx.x;
  const int64_t base = t * num_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  float mx = -INFINITY;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    mx = fmaxf(mx, Load(logits, base + e));
  mx = BlockMax(mx, red);
  float sum = 0.0f;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    sum += expf(Load(logits, base + e) - mx);
  }
  sum = BlockSum(sum, red);

  float selected_sum = 0.0f;  // meaningful in thread 0
  for (int j = 0; j < k; ++j) {
    float best_v = -INFINITY;
    int best_i = INT_MAX;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      bool taken = false;
      for (int c = 0; c < j; ++c) taken |= chosen[c] == e;
      const float v = Load(logits, base + e);
      if (!taken && Better(v, e, best_v, best_i)) {
        best_v = v;
        best_i = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (Better(ov, oi, best_v, best_i)) {
        best_v = ov;
        best_i = oi;
      }
    }
    if (lane == 0) {
      best_v_s[warp] = best_v;
      best_i_s[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
        if (Better(best_v_s[w], best_i_s[w], best_v, best_i)) {
          best_v = best_v_s[w];
          best_i = best_i_s[w];
        }
      }
      chosen[j] = best_i;
      const float p = expf(best_v - mx) / sum;
      ids[t * k + j] = best_i;
      weights[t * k + j] = p;
      selected_sum += p;
    }
    __syncthreads();
  }
  if (renormalize && threadIdx.x == 0) {
    const float inv = 1.0f / selected_sum;
    for (int j = 0; j < k; ++j) weights[t * k + j] *= inv;
  }
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM: C[row, n] = A[a_row(row), :] @ W_g[n, :]^T for the rows of each group g, with
// groups described by a tile table (tile -> group, first row; group -> end row). With kGateUp,
// W_g holds 2N rows [gate; up] and C = silu(A W_gate^T) * (A W_up^T).
// TODO(perf): CUDA-core FMA tiles; move to wgmma / a CUTLASS-style grouped GEMM.

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

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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
__global__ void __launch_bounds__(kScanThreads)
    ScanExpertsKernel(const int32_t* counts, int num_local, int bm, int32_t* offsets,
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

// out[t, :] += sum_j weights[t, j] * pair_out[pair_pos[t, j], :], in a fixed order.
__global__ void CombineKernel(const float* pair_out, const int32_t* pair_pos, const float* weights,
                              int k, int64_t hidden, uint16_t* out) {
  const int64_t t = blockIdx.x;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int pos = pair_pos[t * k + j];
      if (pos >= 0) acc += weights[t * k + j] * pair_out[pos * hidden + h];
    }
    out[t * hidden + h] = F32ToBf16(Bf16ToF32(out[t * hidden + h]) + acc);
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
  float* pair_out;
  int64_t max_tiles;
  int bm;
  size_t bytes;
};

MoeScratch CarveMoeScratch(char* base, int64_t num_tokens, int k, int num_local, int64_t hidden,
                           int64_t inter) {
  const int64_t pairs = num_tokens * k;
  MoeScratch s;
  s.bm = TileRows(pairs, num_local);
  s.max_tiles = (pairs + s.bm - 1) / s.bm + (num_local < pairs ? num_local : pairs);
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

void LaunchTopKSoftmax(AnyPtr logits, int64_t num_tokens, int num_experts, int k, bool renormalize,
                       int32_t* ids, float* weights, cudaStream_t stream) {
  if (num_tokens == 0 || k == 0) return;
  TopKSoftmaxKernel<<<static_cast<unsigned>(num_tokens), kTopKThreads, sizeof(int) * k, stream>>>(
      logits, num_experts, k, renormalize, ids, weights);
  CheckLaunch("TopKSoftmax");
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
                                int64_t inter, void* scratch, uint16_t* out, cudaStream_t stream) {
  const MoeScratch s =
      CarveMoeScratch(static_cast<char*>(scratch), num_tokens, k, num_local_experts, hidden, inter);
  const int64_t pairs = num_tokens * k;
  // counts and cursor are adjacent: one memset clears both.
  const cudaError_t err = cudaMemsetAsync(
      s.counts, 0, reinterpret_cast<char*>(s.offsets) - reinterpret_cast<char*>(s.counts), stream);
  if (err != cudaSuccess) {
    std::fprintf(stderr, "mobius cuda: MoeExperts memset failed: %s\n", cudaGetErrorString(err));
    std::abort();
  }
  if (pairs == 0 || num_local_experts == 0) return s.counts;
  CountPairsKernel<<<GridFor(pairs, 256), 256, 0, stream>>>(ids, pairs, first_expert,
                                                            num_local_experts, s.counts);
  CheckLaunch("MoeCountPairs");
  ScanExpertsKernel<<<1, kScanThreads, 0, stream>>>(s.counts, num_local_experts, s.bm, s.offsets,
                                                    s.tile_group, s.tile_row0, s.num_tiles);
  CheckLaunch("MoeScanExperts");
  ScatterPairsKernel<<<GridFor(pairs, 256), 256, 0, stream>>>(ids, pairs, k, first_expert,
                                                              num_local_experts, s.offsets,
                                                              s.cursor, s.sorted_token, s.pair_pos);
  CheckLaunch("MoeScatterPairs");

  // The grid covers the most tiles any routing can need; surplus blocks exit at once.
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

  CombineKernel<<<static_cast<unsigned>(num_tokens), 256, 0, stream>>>(s.pair_out, s.pair_pos,
                                                                       weights, k, hidden, out);
  CheckLaunch("MoeCombine");
  return s.counts;
}

}  // namespace mobius::kernels::cuda
