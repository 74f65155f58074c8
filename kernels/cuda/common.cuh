// Device helpers shared by the CUDA kernels: bf16 <-> fp32, mixed-dtype loads, block reductions,
// and the launch check.
#ifndef MOBIUS_KERNELS_CUDA_COMMON_CUH_
#define MOBIUS_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {

// The slot that receives segment `seg`'s updated conv and delta-rule states: its state_slot
// unless the step writes them elsewhere (a speculative verify step's spare slot).
__device__ __forceinline__ int StateOutSlot(const SegmentMeta& segs, int seg) {
  return segs.state_out_slot != nullptr ? segs.state_out_slot[seg] : segs.state_slot[seg];
}

// Aborts with the kernel's name when a launch failed (bad configuration, missing image, ...).
inline void CheckLaunch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::fprintf(stderr, "mobius cuda: launch of %s failed: %s\n", what, cudaGetErrorString(err));
    std::abort();
  }
}

__device__ __forceinline__ float Bf16ToF32(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
// Round to nearest even (the hardware conversion), NaN preserved.
__device__ __forceinline__ uint16_t F32ToBf16(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ float Load(AnyPtr p, int64_t i) {
  return p.f32 ? static_cast<const float*>(p.data)[i]
               : Bf16ToF32(static_cast<const uint16_t*>(p.data)[i]);
}
__device__ __forceinline__ void Store(AnyMutPtr p, int64_t i, float v) {
  if (p.f32) {
    static_cast<float*>(p.data)[i] = v;
  } else {
    static_cast<uint16_t*>(p.data)[i] = F32ToBf16(v);
  }
}

// Eight bf16 values moved as one 16-byte access (the vectorised paths of the row kernels).
__device__ __forceinline__ void UnpackBf16x8(uint4 v, float* out) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
// Two floats as one bf16x2 word (lo in the low half), round to nearest.
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

__device__ __forceinline__ uint4 PackBf16x8(const float* in) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    words[i] = static_cast<uint32_t>(F32ToBf16(in[2 * i])) |
               (static_cast<uint32_t>(F32ToBf16(in[2 * i + 1])) << 16);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}
// Eight consecutive elements of an fp32-or-bf16 array starting at `i` (a multiple of 8, the
// array 16-byte aligned).
__device__ __forceinline__ void Load8(AnyPtr p, int64_t i, float* out) {
  if (p.f32) {
    const float4* f = reinterpret_cast<const float4*>(static_cast<const float*>(p.data) + i);
    const float4 a = f[0], b = f[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    UnpackBf16x8(*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.data) + i), out);
  }
}
__host__ __device__ __forceinline__ bool IsAligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Element offset of (row, 16-byte chunk) in a row-major [rows][kCols] bf16 tile whose chunks are
// XOR-swizzled by row (chunk c of row r stored at c ^ (r % 8); rows of fewer than 8 chunks use
// r % chunks): ldmatrix's eight row reads of one chunk column then fall in different bank
// groups without padding the rows.
template <int kCols>
__host__ __device__ __forceinline__ int TileOffset(int row, int chunk) {
  constexpr int kChunks = kCols / 8;
  constexpr int kSwizzle = kChunks < 8 ? kChunks : 8;
  return row * kCols + ((chunk ^ (row & (kSwizzle - 1))) * 8);
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
// An output value y gated by a bf16 gate as Backend::MulSigmoid gates a stored output: y rounded
// to bf16 first, then times sigmoid(gate) (the caller rounds the product as it stores it).
__device__ __forceinline__ float GatedOutput(float y, float gate) {
  return Bf16ToF32(F32ToBf16(y)) * Sigmoid(gate);
}
__device__ __forceinline__ float Silu(float x) { return x / (1.0f + __expf(-x)); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 floats. Contains __syncthreads: call from uniform control flow.
__device__ __forceinline__ float BlockSum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpSum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x >> 5;
  v = lane < num_warps ? shared[lane] : 0.0f;
  return WarpSum(v);
}
__device__ __forceinline__ float BlockMax(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x >> 5;
  v = lane < num_warps ? shared[lane] : -INFINITY;
  return WarpMax(v);
}

// silu(gate) * up for eight bf16 pairs, rounded to bf16 as SiluAndMul stores it (the
// projections that form their input from a gate/up row).
__device__ __forceinline__ void SiluMulPiece(uint4 gate, uint4 up, float (&out)[8]) {
  float u[8];
  UnpackBf16x8(gate, out);
  UnpackBf16x8(up, u);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = Bf16ToF32(F32ToBf16(Silu(out[i]) * u[i]));
}

// The warp-level tensor-core product (mma.sync m16n8k16): d += a (16 x 16, row-major fragment)
// * b (16 x 8, column-major fragment), bf16 in, fp32 accumulate.
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90): a kernel launched with LaunchPdl may be scheduled while
// its predecessor on the stream is still running (hiding the launch gap between the short
// kernels of a decode step); it calls PdlWait before touching memory the predecessor may write or
// read, which waits for the predecessor's completion and memory flush. PdlTrigger lets this
// kernel's own successor be scheduled early. Both are no-ops in kernels launched the ordinary way.
__device__ __forceinline__ void PdlWait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void PdlTrigger() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
// MOBIUS_PDL=0 launches everything the ordinary way (read once; before/after timings).
inline bool PdlEnabled() {
  static const bool on = KnobChoice("MOBIUS_PDL", {"0", "1"}) != 1 &&
                         KnobChoice("MOBIUS_MOE_PDL", {"0", "1"}) != 1;  // the older name
  return on;
}
// Launches `kernel` with the programmatic-serialization attribute (see PdlWait) and, where
// `cluster_blocks` > 1, in thread-block clusters of that many blocks along x; aborts with `what`
// named when the launch fails.
template <typename... Params, typename... Args>
void LaunchPdlInClusters(const char* what, unsigned cluster_blocks, void (*kernel)(Params...),
                         dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2] = {};
  unsigned num_attrs = 0;
  if (cluster_blocks > 1) {
    attrs[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attrs[num_attrs].val.clusterDim.x = cluster_blocks;
    attrs[num_attrs].val.clusterDim.y = 1;
    attrs[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  if (PdlEnabled()) {
    attrs[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  config.attrs = attrs;
  config.numAttrs = num_attrs;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    std::fprintf(stderr, "mobius cuda: launch of %s failed: %s\n", what, cudaGetErrorString(err));
    std::abort();
  }
}
// Launches `kernel` with the programmatic-serialization attribute (see PdlWait); aborts with
// `what` named when the launch fails.
template <typename... Params, typename... Args>
void LaunchPdl(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
               cudaStream_t stream, Args&&... args) {
  LaunchPdlInClusters(what, 1, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

inline unsigned GridFor(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_COMMON_CUH_
