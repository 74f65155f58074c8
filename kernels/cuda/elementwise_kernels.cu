// Row-wise and elementwise kernels: gathers, RMS norms, residual adds, gating. One block per row
// for the norms (fp32 statistics; one warp per row for short rows); grid-stride loops for the
// elementwise ops; 16-byte accesses wherever shapes and alignment allow.
#include <algorithm>
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kElemThreads = 256;

__global__ void GatherRowsKernel(AnyPtr src, const int32_t* rows, int64_t width, AnyMutPtr dst) {
  PdlWait();
  PdlTrigger();
  const int64_t r = blockIdx.x;
  const int64_t src_row = rows[r];
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    Store(dst, r * width + c, Load(src, src_row * width + c));
  }
}

// Same-dtype gather of rows whose byte width is a multiple of 16: 16-byte copies spread over
// blockIdx.y as well, so that a few very wide rows (a sequence's whole DeltaNet state, ~2 MB,
// copied for speculative rollback) use the whole GPU instead of one block per row.
constexpr int kCopyVecPerThread = 4;
__global__ void GatherRowsVecKernel(const uint4* src, const int32_t* rows, int64_t vecs_per_row,
                                    uint4* dst) {
  PdlWait();
  PdlTrigger();
  const int64_t r = blockIdx.x;
  const uint4* from = src + static_cast<int64_t>(rows[r]) * vecs_per_row;
  uint4* to = dst + r * vecs_per_row;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * blockDim.x * kCopyVecPerThread;
#pragma unroll
  for (int i = 0; i < kCopyVecPerThread; ++i) {
    const int64_t v = begin + i * blockDim.x + threadIdx.x;
    if (v < vecs_per_row) to[v] = from[v];
  }
}

// The tensors of one CopyRowsVecKernel launch, by value in its parameters (1 KB).
struct CopyRowsTable {
  uint4* base[kMaxCopyRowsTargets];
  int64_t vecs_per_row[kMaxCopyRowsTargets];
};

// In place: row to[r] = row from[r] of tensor blockIdx.z, 16 bytes at a time, rows over
// blockIdx.x and each row's pieces over blockIdx.y (Backend::CopyRows; no row is both a source
// and a destination). blockIdx.y covers the widest tensor's rows; narrower ones exit early.
__global__ void CopyRowsVecKernel(const CopyRowsTable table, const int32_t* from,
                                  const int32_t* to) {
  PdlWait();
  PdlTrigger();
  const int64_t r = blockIdx.x, vecs_per_row = table.vecs_per_row[blockIdx.z];
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * blockDim.x * kCopyVecPerThread;
  if (begin >= vecs_per_row) return;
  uint4* x = table.base[blockIdx.z];
  const uint4* src = x + static_cast<int64_t>(from[r]) * vecs_per_row;
  uint4* dst = x + static_cast<int64_t>(to[r]) * vecs_per_row;
#pragma unroll
  for (int i = 0; i < kCopyVecPerThread; ++i) {
    const int64_t v = begin + i * blockDim.x + threadIdx.x;
    if (v < vecs_per_row) dst[v] = src[v];
  }
}

// out = x / sqrt(mean(x^2) + eps) * (1 + w). When `residual` is set, first residual += delta
// (rounded to bf16 and stored), and the norm reads the stored sum.
__global__ void RmsNorm1pKernel(const uint16_t* x, uint16_t* residual, const uint16_t* delta,
                                AnyPtr w, float eps, int64_t dim, uint16_t* out) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  float sum = 0.0f;
  if (residual != nullptr) {
    uint16_t* res = residual + row * dim;
    const uint16_t* d = delta + row * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      const uint16_t r = F32ToBf16(Bf16ToF32(res[c]) + Bf16ToF32(d[c]));
      res[c] = r;
      const float v = Bf16ToF32(r);
      sum += v * v;
    }
    x = residual;
  } else {
    const uint16_t* xr = x + row * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      const float v = Bf16ToF32(xr[c]);
      sum += v * v;
    }
  }
  // Each thread re-reads only the elements it wrote itself above, so no barrier is needed for
  // the residual; BlockSum synchronises anyway.
  sum = BlockSum(sum, red);
  const float inv = rsqrtf(sum / static_cast<float>(dim) + eps);
  const uint16_t* xr = x + row * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    out[row * dim + c] = F32ToBf16(Bf16ToF32(xr[c]) * inv * (1.0f + Load(w, c)));
  }
}

// out = x / sqrt(mean(x^2) + eps) * w * silu(z).
__global__ void GatedRmsNormKernel(const uint16_t* x, const uint16_t* z, AnyPtr w, float eps,
                                   int64_t dim, uint16_t* out) {
  __shared__ float red[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * dim;
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    const float v = Bf16ToF32(x[base + c]);
    sum += v * v;
  }
  sum = BlockSum(sum, red);
  const float inv = rsqrtf(sum / static_cast<float>(dim) + eps);
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    const float v = Bf16ToF32(x[base + c]) * inv * Load(w, c);
    out[base + c] = F32ToBf16(v * Silu(Bf16ToF32(z[base + c])));
  }
}

__global__ void AddKernel(uint16_t* x, const uint16_t* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = F32ToBf16(Bf16ToF32(x[i]) + Bf16ToF32(y[i]));
  }
}

__global__ void MulSigmoidKernel(uint16_t* x, const uint16_t* gate, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = F32ToBf16(Bf16ToF32(x[i]) * Sigmoid(Bf16ToF32(gate[i])));
  }
}

__global__ void SiluAndMulKernel(const uint16_t* gate_up, int64_t rows, int64_t inter,
                                 uint16_t* out) {
  const int64_t n = rows * inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float g = Bf16ToF32(gate_up[r * 2 * inter + c]);
    const float u = Bf16ToF32(gate_up[r * 2 * inter + inter + c]);
    out[i] = F32ToBf16(Silu(g) * u);
  }
}

__global__ void AddSigmoidScaledKernel(uint16_t* x, const uint16_t* y, AnyPtr gate_logits,
                                       int64_t rows, int64_t dim) {
  const int64_t n = rows * dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = Sigmoid(Load(gate_logits, i / dim));
    x[i] = F32ToBf16(Bf16ToF32(x[i]) + s * Bf16ToF32(y[i]));
  }
}

// ---- 16-byte paths: rows (or arrays) whose lengths are multiples of 8 and whose pointers are
// 16-byte aligned, which every model shape is. One access moves eight bf16 values; the scalar
// kernels above remain for odd shapes.

// RmsNorm1p / AddRmsNorm1p over rows of `dim` (dim % 8 == 0): one block per row. Each thread
// keeps its eight-element pieces in registers between the statistics and the scaling (at most
// kMaxPieces of them: dim <= 8 * kMaxPieces * blockDim.x).
constexpr int kMaxPieces = 4;

__global__ void RmsNorm1pVecKernel(const uint16_t* x, uint16_t* residual, const uint16_t* delta,
                                   AnyPtr w, float eps, int64_t dim, uint16_t* out,
                                   bool trigger_early) {
  __shared__ float red[32];
  // With trigger_early the successor is launched as this block starts, not after its wait (the
  // one exception to the backend's trigger-after-wait contract): every successor of a norm is a
  // projection (skinny or tensor-core GEMV, or a library GEMM launched without PDL), another
  // norm, GatherRows (which waits first) or a collective launched without PDL; none reads more
  // than weights before its wait, so the projections' blocks can take the SMs that
  // the predecessor's blocks leave and stream weights beside the predecessor's tail and this
  // norm. Everything two launches back is complete when the predecessor triggers, so those
  // reads stay valid; what a kernel after a norm must not read before its wait is the norm's
  // predecessor's output. Batch 1 2.405 / 2.415 -> 2.366 / 2.383 ms, batch 8 6.449 / 6.442 ->
  // 6.412 / 6.420 (performance.md, thirtieth version). MOBIUS_NORM_EARLY_TRIGGER=0 turns it off.
  if (trigger_early) PdlTrigger();
  const int64_t row = blockIdx.x;
  const int64_t pieces = dim / 8;
  // The weights are no kernel's output: their loads go out before PdlWait, while the predecessor
  // still runs, instead of after the block reduction (a memory round trip off the critical path of
  // a kernel that runs twice per layer at batch 1).
  float wv[kMaxPieces][8];
#pragma unroll
  for (int p = 0; p < kMaxPieces; ++p) {
    const int64_t c8 = threadIdx.x + static_cast<int64_t>(p) * blockDim.x;
    if (c8 >= pieces) break;
    Load8(w, c8 * 8, wv[p]);
  }
  PdlWait();
  if (!trigger_early) PdlTrigger();
  float v[kMaxPieces][8];
  float sum = 0.0f;
#pragma unroll
  for (int p = 0; p < kMaxPieces; ++p) {
    const int64_t c8 = threadIdx.x + static_cast<int64_t>(p) * blockDim.x;
    if (c8 >= pieces) break;
    const int64_t off = row * dim + c8 * 8;
    if (residual != nullptr) {
      float r[8], d[8];
      UnpackBf16x8(*reinterpret_cast<const uint4*>(residual + off), r);
      UnpackBf16x8(*reinterpret_cast<const uint4*>(delta + off), d);
#pragma unroll
      for (int i = 0; i < 8; ++i) r[i] += d[i];
      const uint4 packed = PackBf16x8(r);
      *reinterpret_cast<uint4*>(residual + off) = packed;
      UnpackBf16x8(packed, v[p]);  // the norm reads the stored (rounded) sum
    } else {
      UnpackBf16x8(*reinterpret_cast<const uint4*>(x + off), v[p]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += v[p][i] * v[p][i];
  }
  sum = BlockSum(sum, red);
  const float inv = rsqrtf(sum / static_cast<float>(dim) + eps);
#pragma unroll
  for (int p = 0; p < kMaxPieces; ++p) {
    const int64_t c8 = threadIdx.x + static_cast<int64_t>(p) * blockDim.x;
    if (c8 >= pieces) break;
    float o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = v[p][i] * inv * (1.0f + wv[p][i]);
    *reinterpret_cast<uint4*>(out + row * dim + c8 * 8) = PackBf16x8(o);
  }
}

// GatedRmsNorm over short rows (dim % 8 == 0, dim <= 8 * 32 * kMaxPieces): one warp per row, so
// a block of eight warps normalises eight heads without a block barrier.
__global__ void GatedRmsNormWarpKernel(const uint16_t* x, const uint16_t* z, AnyPtr w, float eps,
                                       int64_t rows, int64_t dim, uint16_t* out) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t pieces = dim / 8, base = row * dim;
  float v[kMaxPieces][8];
  float sum = 0.0f;
#pragma unroll
  for (int p = 0; p < kMaxPieces; ++p) {
    const int64_t c8 = lane + 32 * p;
    if (c8 >= pieces) break;
    UnpackBf16x8(*reinterpret_cast<const uint4*>(x + base + c8 * 8), v[p]);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += v[p][i] * v[p][i];
  }
  sum = WarpSum(sum);
  const float inv = rsqrtf(sum / static_cast<float>(dim) + eps);
#pragma unroll
  for (int p = 0; p < kMaxPieces; ++p) {
    const int64_t c8 = lane + 32 * p;
    if (c8 >= pieces) break;
    float wv[8], zv[8], o[8];
    Load8(w, c8 * 8, wv);
    UnpackBf16x8(*reinterpret_cast<const uint4*>(z + base + c8 * 8), zv);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = v[p][i] * inv * wv[i] * Silu(zv[i]);
    *reinterpret_cast<uint4*>(out + base + c8 * 8) = PackBf16x8(o);
  }
}

// GatedRmsNorm for rows of at most 16 pieces of eight (dim <= 128, a DeltaNet value head): each
// lane owns one piece and 32 / (dim / 8) rows share a warp, reducing over their lane group. All
// loads are issued before the reduction.
__global__ void GatedRmsNormSubWarpKernel(const uint16_t* x, const uint16_t* z, AnyPtr w, float eps,
                                          int64_t rows, int64_t dim, uint16_t* out) {
  PdlWait();
  PdlTrigger();
  const int lanes = static_cast<int>(dim / 8);  // a power of two dividing 32
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t row = warp * (32 / lanes) + lane / lanes;
  const int piece = lane % lanes;
  const bool active = row < rows;
  float v[8] = {}, zv[8] = {}, wv[8] = {};
  const int64_t off = row * dim + piece * 8;
  if (active) {
    UnpackBf16x8(*reinterpret_cast<const uint4*>(x + off), v);
    UnpackBf16x8(*reinterpret_cast<const uint4*>(z + off), zv);
    Load8(w, piece * 8, wv);
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += v[i] * v[i];
  for (int o = lanes / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (!active) return;
  const float inv = rsqrtf(sum / static_cast<float>(dim) + eps);
  float o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = v[i] * inv * wv[i] * Silu(zv[i]);
  *reinterpret_cast<uint4*>(out + off) = PackBf16x8(o);
}

// out = silu(gate) * up, eight columns per thread (inter % 8 == 0).
__global__ void SiluAndMulVecKernel(const uint16_t* gate_up, int64_t rows, int64_t inter,
                                    uint16_t* out) {
  PdlWait();
  PdlTrigger();
  const int64_t per_row = inter / 8, n = rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * 8;
    float g[8], u[8];
    UnpackBf16x8(*reinterpret_cast<const uint4*>(gate_up + r * 2 * inter + c), g);
    UnpackBf16x8(*reinterpret_cast<const uint4*>(gate_up + r * 2 * inter + inter + c), u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = Silu(g[j]) * u[j];
    *reinterpret_cast<uint4*>(out + r * inter + c) = PackBf16x8(g);
  }
}

// x += sigmoid(gate_logits[row]) * y, eight columns per thread (dim % 8 == 0).
__global__ void AddSigmoidScaledVecKernel(uint16_t* x, const uint16_t* y, AnyPtr gate_logits,
                                          int64_t rows, int64_t dim) {
  PdlWait();
  PdlTrigger();
  const int64_t per_row = dim / 8, n = rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row;
    const float s = Sigmoid(Load(gate_logits, r));
    float xv[8], yv[8];
    UnpackBf16x8(reinterpret_cast<const uint4*>(x)[i], xv);
    UnpackBf16x8(reinterpret_cast<const uint4*>(y)[i], yv);
#pragma unroll
    for (int j = 0; j < 8; ++j) xv[j] += s * yv[j];
    reinterpret_cast<uint4*>(x)[i] = PackBf16x8(xv);
  }
}

// x *= sigmoid(gate), eight elements per thread (n % 8 == 0).
__global__ void MulSigmoidVecKernel(uint16_t* x, const uint16_t* gate, int64_t n8) {
  PdlWait();
  PdlTrigger();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float xv[8], gv[8];
    UnpackBf16x8(reinterpret_cast<const uint4*>(x)[i], xv);
    UnpackBf16x8(reinterpret_cast<const uint4*>(gate)[i], gv);
#pragma unroll
    for (int j = 0; j < 8; ++j) xv[j] *= Sigmoid(gv[j]);
    reinterpret_cast<uint4*>(x)[i] = PackBf16x8(xv);
  }
}

bool Vec8(int64_t n, const void* a, const void* b = nullptr, const void* c = nullptr) {
  return n % 8 == 0 && IsAligned16(a) && (b == nullptr || IsAligned16(b)) &&
         (c == nullptr || IsAligned16(c));
}
bool Vec8(AnyPtr w) { return IsAligned16(w.data); }

// Threads per row block of the vectorised norms: enough for the row in kMaxPieces passes, a
// multiple of 32, at most 1024.
int NormThreads(int64_t dim) {
  const int64_t pieces = dim / 8;
  int64_t threads = (pieces + kMaxPieces - 1) / kMaxPieces;
  threads = std::max<int64_t>(threads, std::min<int64_t>(pieces, 256));
  threads = (threads + 31) / 32 * 32;
  return static_cast<int>(std::min<int64_t>(threads, 1024));
}

}  // namespace

void LaunchGatherRows(AnyPtr src, const int32_t* rows, int64_t num_rows, int64_t width,
                      AnyMutPtr dst, cudaStream_t stream) {
  if (num_rows == 0 || width == 0) return;
  const int64_t row_bytes = width * (src.f32 ? 4 : 2);
  if (src.f32 == dst.f32 && row_bytes % 16 == 0 &&
      reinterpret_cast<uintptr_t>(src.data) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(dst.data) % 16 == 0) {
    const int64_t vecs = row_bytes / 16;
    const int64_t per_block = int64_t{kElemThreads} * kCopyVecPerThread;
    const dim3 grid(static_cast<unsigned>(num_rows),
                    static_cast<unsigned>((vecs + per_block - 1) / per_block));
    LaunchPdl("GatherRowsVecKernel", GatherRowsVecKernel, grid, kElemThreads, 0, stream,
              static_cast<const uint4*>(src.data), rows, vecs, static_cast<uint4*>(dst.data));
    CheckLaunch("GatherRows");
    return;
  }
  LaunchPdl("GatherRowsKernel", GatherRowsKernel, static_cast<unsigned>(num_rows), kRowThreads, 0,
            stream, src, rows, width, dst);
  CheckLaunch("GatherRows");
}

bool LaunchCopyRows(const CopyRowsTarget* targets, int num_targets, const int32_t* from,
                    const int32_t* to, int64_t num_rows, cudaStream_t stream) {
  if (num_targets > kMaxCopyRowsTargets || num_rows > INT32_MAX) return false;
  CopyRowsTable table{};
  int64_t max_vecs = 0;
  for (int i = 0; i < num_targets; ++i) {
    const CopyRowsTarget& t = targets[i];
    if (t.row_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(t.base) % 16 != 0) return false;
    table.base[i] = static_cast<uint4*>(t.base);
    table.vecs_per_row[i] = t.row_bytes / 16;
    max_vecs = std::max(max_vecs, table.vecs_per_row[i]);
  }
  if (num_rows == 0 || max_vecs == 0) return true;
  const int64_t per_block = int64_t{kElemThreads} * kCopyVecPerThread;
  const int64_t pieces = (max_vecs + per_block - 1) / per_block;
  if (pieces > 65535) return false;  // gridDim.y's limit: rows over 1 GiB
  const dim3 grid(static_cast<unsigned>(num_rows), static_cast<unsigned>(pieces),
                  static_cast<unsigned>(num_targets));
  LaunchPdl("CopyRowsVecKernel", CopyRowsVecKernel, grid, kElemThreads, 0, stream, table, from, to);
  CheckLaunch("CopyRows");
  return true;
}

bool NormTriggersEarly() {
  static const bool early = KnobChoice("MOBIUS_NORM_EARLY_TRIGGER", {"0", "1"}) != 1;
  return early;
}

void LaunchRmsNorm1p(const uint16_t* x, AnyPtr w, float eps, int64_t rows, int64_t dim,
                     uint16_t* out, cudaStream_t stream) {
  if (rows == 0) return;
  if (Vec8(dim, x, out) && Vec8(w) && dim <= 8 * kMaxPieces * 1024) {
    LaunchPdl("RmsNorm1pVecKernel", RmsNorm1pVecKernel, static_cast<unsigned>(rows),
              NormThreads(dim), 0, stream, x, nullptr, nullptr, w, eps, dim, out,
              NormTriggersEarly());
    CheckLaunch("RmsNorm1p");
    return;
  }
  RmsNorm1pKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(x, nullptr, nullptr, w,
                                                                           eps, dim, out);
  CheckLaunch("RmsNorm1p");
}

void LaunchAddRmsNorm1p(uint16_t* residual, const uint16_t* delta, AnyPtr w, float eps,
                        int64_t rows, int64_t dim, uint16_t* out, cudaStream_t stream) {
  if (rows == 0) return;
  if (Vec8(dim, residual, delta, out) && Vec8(w) && dim <= 8 * kMaxPieces * 1024) {
    LaunchPdl("RmsNorm1pVecKernel", RmsNorm1pVecKernel, static_cast<unsigned>(rows),
              NormThreads(dim), 0, stream, nullptr, residual, delta, w, eps, dim, out,
              NormTriggersEarly());
    CheckLaunch("AddRmsNorm1p");
    return;
  }
  RmsNorm1pKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(nullptr, residual, delta,
                                                                           w, eps, dim, out);
  CheckLaunch("AddRmsNorm1p");
}

void LaunchAdd(uint16_t* x, const uint16_t* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  AddKernel<<<GridFor(n, kElemThreads), kElemThreads, 0, stream>>>(x, y, n);
  CheckLaunch("Add");
}

void LaunchSiluAndMul(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out,
                      cudaStream_t stream) {
  if (rows * inter == 0) return;
  if (Vec8(inter, gate_up, out)) {
    const int64_t n8 = rows * inter / 8;
    LaunchPdl("SiluAndMulVecKernel", SiluAndMulVecKernel, GridFor(n8, kElemThreads), kElemThreads,
              0, stream, gate_up, rows, inter, out);
    CheckLaunch("SiluAndMul");
    return;
  }
  SiluAndMulKernel<<<GridFor(rows * inter, kElemThreads), kElemThreads, 0, stream>>>(gate_up, rows,
                                                                                     inter, out);
  CheckLaunch("SiluAndMul");
}

void LaunchAddSigmoidScaled(uint16_t* x, const uint16_t* y, AnyPtr gate_logits, int64_t rows,
                            int64_t dim, cudaStream_t stream) {
  if (rows * dim == 0) return;
  if (Vec8(dim, x, y)) {
    LaunchPdl("AddSigmoidScaledVecKernel", AddSigmoidScaledVecKernel,
              GridFor(rows * dim / 8, kElemThreads), kElemThreads, 0, stream, x, y, gate_logits,
              rows, dim);
    CheckLaunch("AddSigmoidScaled");
    return;
  }
  AddSigmoidScaledKernel<<<GridFor(rows * dim, kElemThreads), kElemThreads, 0, stream>>>(
      x, y, gate_logits, rows, dim);
  CheckLaunch("AddSigmoidScaled");
}

void LaunchGatedRmsNorm(const uint16_t* x, const uint16_t* z, AnyPtr w, float eps, int64_t rows,
                        int64_t dim, uint16_t* out, cudaStream_t stream) {
  if (rows == 0) return;
  const int64_t pieces = dim / 8;
  if (Vec8(dim, x, z, out) && Vec8(w) && pieces <= 16 && (pieces & (pieces - 1)) == 0) {
    const int64_t rows_per_block = kRowThreads / pieces;
    LaunchPdl("GatedRmsNormSubWarpKernel", GatedRmsNormSubWarpKernel,
              static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block), kRowThreads, 0,
              stream, x, z, w, eps, rows, dim, out);
    CheckLaunch("GatedRmsNorm");
    return;
  }
  if (Vec8(dim, x, z, out) && Vec8(w) && dim <= 8 * 32 * kMaxPieces) {
    constexpr int kRowsPerBlock = kRowThreads / 32;
    GatedRmsNormWarpKernel<<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                             kRowThreads, 0, stream>>>(x, z, w, eps, rows, dim, out);
    CheckLaunch("GatedRmsNorm");
    return;
  }
  GatedRmsNormKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(x, z, w, eps, dim,
                                                                              out);
  CheckLaunch("GatedRmsNorm");
}

void LaunchMulSigmoid(uint16_t* x, const uint16_t* gate, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (Vec8(n, x, gate)) {
    LaunchPdl("MulSigmoidVecKernel", MulSigmoidVecKernel, GridFor(n / 8, kElemThreads),
              kElemThreads, 0, stream, x, gate, n / 8);
    CheckLaunch("MulSigmoid");
    return;
  }
  MulSigmoidKernel<<<GridFor(n, kElemThreads), kElemThreads, 0, stream>>>(x, gate, n);
  CheckLaunch("MulSigmoid");
}

}  // namespace mobius::kernels::cuda
