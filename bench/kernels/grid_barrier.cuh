// The grid-wide barrier of the benchmark probes (mobius_chain_bench, mobius_persistent_bench):
// thread 0 of each co-resident block adds to `arrived`; the last arrival resets it and bumps
// `generation`, which the others poll with acquire loads. Both words start at zero.
#ifndef MOBIUS_BENCH_KERNELS_GRID_BARRIER_CUH_
#define MOBIUS_BENCH_KERNELS_GRID_BARRIER_CUH_

namespace mobius::bench {

__device__ __forceinline__ unsigned LoadAcquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Called by one thread per block; returns once every block of the grid has called it.
__device__ __forceinline__ void GridBarrier(unsigned* arrived, unsigned* generation) {
  const unsigned gen = LoadAcquire(generation);
  __threadfence();
  if (atomicAdd(arrived, 1u) == gridDim.x - 1) {
    *arrived = 0;
    __threadfence();
    atomicAdd(generation, 1u);
  } else {
    while (LoadAcquire(generation) == gen) {
    }
  }
}

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_KERNELS_GRID_BARRIER_CUH_
