// Device helpers of the kernel micro-benchmark: random fills and a stream-blocking sleep.
#ifndef MOBIUS_BENCH_KERNELS_BENCH_DEVICE_H_
#define MOBIUS_BENCH_KERNELS_BENCH_DEVICE_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace mobius::bench {

// p[i] = lo + (hi - lo) * u_i with u_i uniform in [0, 1) from a hash of (seed, i); bf16 or f32.
cudaError_t FillUniform(void* p, size_t n, bool bf16, float lo, float hi, uint64_t seed,
                        cudaStream_t stream);

// Queues one single-thread kernel that spins for `ns` nanoseconds of the device's global timer,
// so that work queued behind it while it runs later executes back to back, without host gaps.
cudaError_t SleepOnStream(cudaStream_t stream, uint64_t ns);

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_KERNELS_BENCH_DEVICE_H_
