// The skinny GEMM (one or two rows of x) with its weights streamed by the bulk copy engine:
// y_i[M, n_i] = x[M, K] @ w_i[n_i, K]^T for the targets of a fan-out, one block per SM.
//
// The register-streaming kernel (skinny_gemm.cu) runs one short block per 8 weight rows: at one
// row a 16.8 MB projection takes ~10 us against 3.9 us at bandwidth, and a 1544-block fan-out
// spends ~1.8 us on dispatching its blocks alone (mobius_chain_bench: 2.27 us a dependent step at
// 1544 blocks, 0.49 at 132). Here each SM holds one block that walks its share of 8-row tiles
// (tiles b, b + grid, ...): one thread issues each tile as one bulk copy into a ring of shared
// memory stages, eight consumer warps each reduce one row of the landed tile against x (in
// shared memory), and the stage goes back to the producer. The first stages are requested before
// the PDL wait (they read only weights); x is read after it.
#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/skinny_targets.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kTileRows = 8;  // one weight row per consumer warp
constexpr int kConsumerWarps = kTileRows;
constexpr int kThreads = (kConsumerWarps + 1) * 32;  // + the producer warp
constexpr int kMaxStages = 8;
constexpr int64_t kStageBudget = 96 * 1024;    // bytes of stages aimed for (at least two stages)
constexpr uint32_t kMaxCopyBytes = 16 * 1024;  // one bulk copy's size, at most

struct StreamArgs {
  const uint16_t* x = nullptr;
  int64_t k = 0;
  int64_t x_stride = 0;  // elements between rows of x: k, or 2k for a gate/up input
  int64_t num_tiles = 0;
  int stages = 0;
  SkinnyTargetTable table;  // targets aligned to kTileRows rows
};

int StagesFor(int64_t k) {
  const int64_t stage_bytes = kTileRows * k * 2;
  return static_cast<int>(std::clamp<int64_t>(kStageBudget / stage_bytes, 2, kMaxStages));
}
size_t SmemBytes(int64_t k, int m, int stages) {
  return static_cast<size_t>(stages) * kTileRows * k * 2 + static_cast<size_t>(m) * k * 2 +
         2 * kMaxStages * sizeof(uint64_t);
}

// Tile `tile` of the fan-out: its target, first row (relative to the target) and row count.
__device__ __forceinline__ bool LocateTile(const StreamArgs& a, int64_t tile, int& target,
                                           int64_t& row0, int& rows) {
  row0 = tile * kTileRows;
  if (!LocateTargetRow(a.table, row0, target)) return false;
  rows = static_cast<int>(std::min<int64_t>(kTileRows, a.table.targets[target].n - row0));
  return rows > 0;
}

template <int kM, bool kSiluMul>
__global__ void __launch_bounds__(kThreads, 1) StreamGemvKernel(StreamArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int64_t k = a.k, pieces = k / 8;
  const int stages = a.stages;
  uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);
  uint16_t* xs = tiles + static_cast<int64_t>(stages) * kTileRows * k;
  uint64_t* bars = reinterpret_cast<uint64_t*>(xs + kM * k);
  const uint32_t full0 = SharedAddress(bars), empty0 = SharedAddress(bars + kMaxStages);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      BarrierInit(full0 + 8 * s, 1);
      BarrierInit(empty0 + 8 * s, kConsumerWarps);
    }
    wgmma::FenceProxyAsync();  // the initialised barriers, visible to the copy engine
  }
  __syncthreads();

  if (warp == kConsumerWarps) {
    // The producer: weights only, so it never waits for the predecessor.
    if (lane != 0) return;
    int n = 0;
    for (int64_t tile = blockIdx.x; tile < a.num_tiles; tile += gridDim.x, ++n) {
      int target, rows;
      int64_t row0;
      if (!LocateTile(a, tile, target, row0, rows)) continue;
      const int s = n % stages;
      if (n >= stages) BarrierWait(empty0 + 8 * s, ((n / stages) - 1) & 1);
      const uint32_t bytes = static_cast<uint32_t>(rows * k * 2);
      const uint32_t full = full0 + 8 * s;
      BarrierArriveExpect(full, bytes);
      const char* src = reinterpret_cast<const char*>(a.table.targets[target].w + row0 * k);
      const uint32_t dst = SharedAddress(tiles + static_cast<int64_t>(s) * kTileRows * k);
      for (uint32_t off = 0; off < bytes; off += kMaxCopyBytes) {
        BulkLoad(dst + off, src + off, bytes - off < kMaxCopyBytes ? bytes - off : kMaxCopyBytes,
                 full);
      }
    }
    return;
  }

  // The consumers: x into shared memory once the predecessor is done.
  PdlWait();
  for (int64_t i = threadIdx.x; i < kM * pieces; i += kConsumerWarps * 32) {
    const int64_t m = i / pieces, p = i % pieces;
    const uint4* xr = reinterpret_cast<const uint4*>(a.x + m * a.x_stride);
    uint4 v;
    if constexpr (kSiluMul) {
      float f[8];
      SiluMulPiece(__ldg(xr + p), __ldg(xr + pieces + p), f);
      v = make_uint4(PackBf16x2(f[0], f[1]), PackBf16x2(f[2], f[3]), PackBf16x2(f[4], f[5]),
                     PackBf16x2(f[6], f[7]));
    } else {
      v = __ldg(xr + p);
    }
    reinterpret_cast<uint4*>(xs + m * k)[p] = v;
  }
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerWarps * 32) : "memory");
  PdlTrigger();

  int n = 0;
  for (int64_t tile = blockIdx.x; tile < a.num_tiles; tile += gridDim.x, ++n) {
    int target, rows;
    int64_t row0;
    if (!LocateTile(a, tile, target, row0, rows)) continue;
    const int s = n % stages;
    BarrierWait(full0 + 8 * s, (n / stages) & 1);
    if (warp < rows) {
      const uint4* w =
          reinterpret_cast<const uint4*>(tiles + (static_cast<int64_t>(s) * kTileRows + warp) * k);
      float acc[kM] = {};
      for (int64_t p = lane; p < pieces; p += 32) {
        float wf[8];
        UnpackBf16x8(w[p], wf);
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          float xv[8];
          UnpackBf16x8(reinterpret_cast<const uint4*>(xs + m * k)[p], xv);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[m] += wf[i] * xv[i];
        }
      }
      const SkinnyTarget& tg = a.table.targets[target];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        const float sum = WarpSum(acc[m]);
        if (lane == m) Store(tg.y, m * tg.n + row0 + warp, sum);
      }
    }
    __syncwarp();
    if (lane == 0) BarrierArrive(empty0 + 8 * s);
  }
}

template <int kM, bool kSiluMul>
void Launch(const StreamArgs& args, cudaStream_t stream) {
  auto* kernel = StreamGemvKernel<kM, kSiluMul>;
  const size_t smem = SmemBytes(args.k, kM, args.stages);
  static int device_sms = 0;
  static size_t configured = 0;  // the dynamic shared memory this instantiation allows
  if (device_sms == 0) {
    int device = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (smem > configured) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem));
    configured = smem;
  }
  const int64_t grid = std::min<int64_t>(args.num_tiles, std::max(1, device_sms));
  LaunchPdl("StreamGemvKernel", kernel, static_cast<unsigned>(grid), kThreads, smem, stream, args);
}

}  // namespace

int StreamGemvMode() {
  static const int mode = [] {
    const char* env = std::getenv("MOBIUS_SKINNY_STREAM");
    return env == nullptr ? 0 : std::atoi(env);
  }();
  return mode;
}

bool StreamGemvSupports(int64_t m, int64_t k) {
  return m >= 1 && m <= 2 && k % 8 == 0 && k > 0 &&
         SmemBytes(k, static_cast<int>(m), 2) <= 200 * 1024;
}

void LaunchStreamGemv(const uint16_t* x, int64_t m, int64_t k, const SkinnyTarget* targets,
                      int num_targets, cudaStream_t stream, bool silu_mul) {
  StreamArgs args;
  args.x = x;
  args.k = k;
  args.x_stride = silu_mul ? 2 * k : k;
  args.stages = StagesFor(k);
  int64_t rows = 0;
  args.table = MakeSkinnyTargetTable(targets, num_targets, kTileRows, &rows);
  args.num_tiles = rows / kTileRows;
  if (args.num_tiles == 0) return;
  if (m == 1) {
    silu_mul ? Launch<1, true>(args, stream) : Launch<1, false>(args, stream);
  } else {
    silu_mul ? Launch<2, true>(args, stream) : Launch<2, false>(args, stream);
  }
  CheckLaunch("StreamGemv");
}

}  // namespace mobius::kernels::cuda
