#include <cuda_bf16.h>

#include "bench/kernels/bench_device.h"

namespace mobius::bench {
namespace {

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <typename T>
__global__ void FillKernel(T* p, size_t n, float lo, float scale, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = SplitMix64(seed * 0x100000001B3ull + i);
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    const float v = lo + scale * u;
    if constexpr (sizeof(T) == 2) {
      p[i] = __float2bfloat16(v);
    } else {
      p[i] = v;
    }
  }
}

__global__ void SleepKernel(uint64_t ns) {
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) break;
    __nanosleep(2000);
  }
}

}  // namespace

cudaError_t FillUniform(void* p, size_t n, bool bf16, float lo, float hi, uint64_t seed,
                        cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int threads = 256;
  const size_t want = (n + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 65536 ? want : 65536);
  if (bf16) {
    FillKernel<<<blocks, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, lo, hi - lo,
                                               seed);
  } else {
    FillKernel<<<blocks, threads, 0, stream>>>(static_cast<float*>(p), n, lo, hi - lo, seed);
  }
  return cudaGetLastError();
}

cudaError_t SleepOnStream(cudaStream_t stream, uint64_t ns) {
  SleepKernel<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

}  // namespace mobius::bench
