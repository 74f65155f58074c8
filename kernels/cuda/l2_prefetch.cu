// Weights moved into L2 ahead of the kernel that reads them (Backend::PrefetchWeights).
//
// A DeltaNet layer's decode step at one token leaves DRAM nearly idle for ~14 us (the conv,
// the recurrent delta rule and the gated norm read a few MB), and then the out-projection and,
// after the post-attention norm, the shared expert + router fan-out stream ~31 MB of weights
// at 4-6 us over their bytes each (performance.md, per-kernel profiles). Issued in that gap,
// bulk L2 prefetches let those two kernels read from L2. The kernel is part of the stream's
// PDL chain: it waits for its predecessor before prefetching (so the copy does not compete
// with the projection that precedes it) and only then lets its successor start, so the chain's
// guarantee that a kernel's predecessors have all finished once it passes PdlWait holds.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"

namespace mobius::kernels::cuda {
namespace {

constexpr int kPrefetchBlocks = 16;
constexpr int kPrefetchThreads = 32;
constexpr int64_t kPrefetchPiece = 64 << 10;  // bytes per cp.async.bulk.prefetch

struct PrefetchArgs {
  L2PrefetchRegion regions[kMaxL2PrefetchRegions];
  int count = 0;
};

__device__ __forceinline__ void PrefetchL2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

// Thread i of block b takes pieces b * kPrefetchThreads + i, + kPrefetchBlocks *
// kPrefetchThreads, ... of each region.
__global__ void __launch_bounds__(kPrefetchThreads) L2PrefetchKernel(const PrefetchArgs args) {
  PdlWait();
  PdlTrigger();  // the prefetches below are only issued, never waited for
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPrefetchThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kPrefetchThreads;
  for (int r = 0; r < args.count; ++r) {
    const auto* base = static_cast<const char*>(args.regions[r].data);
    const int64_t bytes = args.regions[r].bytes / 16 * 16;
    for (int64_t off = first * kPrefetchPiece; off < bytes; off += stride * kPrefetchPiece) {
      const int64_t n = bytes - off < kPrefetchPiece ? bytes - off : kPrefetchPiece;
      PrefetchL2(base + off, static_cast<uint32_t>(n));
    }
  }
}

}  // namespace

void LaunchL2Prefetch(const L2PrefetchRegion* regions, int count, cudaStream_t stream) {
  PrefetchArgs args;
  for (int i = 0; i < count && args.count < kMaxL2PrefetchRegions; ++i) {
    if (regions[i].data == nullptr || regions[i].bytes < 16 || !IsAligned16(regions[i].data)) {
      continue;
    }
    args.regions[args.count++] = regions[i];
  }
  if (args.count == 0) return;
  LaunchPdl("L2PrefetchKernel", L2PrefetchKernel, kPrefetchBlocks, kPrefetchThreads, 0, stream,
            args);
  CheckLaunch("L2Prefetch");
}

}  // namespace mobius::kernels::cuda
