// mbarriers and asynchronous copies into shared memory (sm_90): the pieces the producer /
// consumer pipelines of the attention kernels share. Addresses are shared-window (32-bit).
#ifndef MOBIUS_KERNELS_CUDA_ASYNC_COPY_CUH_
#define MOBIUS_KERNELS_CUDA_ASYNC_COPY_CUH_

#include <cuda.h>

#include <cstdint>

namespace mobius::kernels::cuda {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; `valid` false writes zeros (src-size 0 reads nothing).
__device__ __forceinline__ void CopyAsync16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem, bool valid) {
  CopyAsync16(SharedAddress(smem), gmem, valid);
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n"); }
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void BarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void BarrierWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Arrives on `bar` once all of this thread's earlier cp.async copies have landed (counted against
// the barrier's expected arrivals).
__device__ __forceinline__ void CopyAsyncArrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// The bulk tensor copy engine (TMA): one box of a tensor map into shared memory, completing as
// transaction bytes on `bar`.
__device__ __forceinline__ void TensorLoad3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                             int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// `bytes` (a multiple of 16) of contiguous global memory into shared memory by the bulk copy
// engine, both addresses 16-byte aligned; completes as transaction bytes on `bar`. One thread
// issues what cp.async needs a 16-byte instruction per thread for, so the issuing warps' address
// registers are not held by a queue of copies.
__device__ __forceinline__ void BulkLoad(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Arrives on `bar` and adds `bytes` to the transactions its phase waits for.
__device__ __forceinline__ void BarrierArriveExpect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_ASYNC_COPY_CUH_
