// Row-wise and elementwise kernels: gathers, RMS norms, residual adds, gating. One block per row
// for the norms (fp32 statistics); grid-stride loops for the elementwise ops.
#include "kernels/cuda/common.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kElemThreads = 256;

__global__ void GatherRowsKernel(AnyPtr src, const int32_t* rows, int64_t width, AnyMutPtr dst) {
  const int64_t r = blockIdx.x;
  const int64_t src_row = rows[r];
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    Store(dst, r * width + c, Load(src, src_row * width + c));
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

}  // namespace

void LaunchGatherRows(AnyPtr src, const int32_t* rows, int64_t num_rows, int64_t width,
                      AnyMutPtr dst, cudaStream_t stream) {
  if (num_rows == 0 || width == 0) return;
  GatherRowsKernel<<<static_cast<unsigned>(num_rows), kRowThreads, 0, stream>>>(src, rows, width,
                                                                                dst);
  CheckLaunch("GatherRows");
}

void LaunchRmsNorm1p(const uint16_t* x, AnyPtr w, float eps, int64_t rows, int64_t dim,
                     uint16_t* out, cudaStream_t stream) {
  if (rows == 0) return;
  RmsNorm1pKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(x, nullptr, nullptr, w,
                                                                           eps, dim, out);
  CheckLaunch("RmsNorm1p");
}

void LaunchAddRmsNorm1p(uint16_t* residual, const uint16_t* delta, AnyPtr w, float eps,
                        int64_t rows, int64_t dim, uint16_t* out, cudaStream_t stream) {
  if (rows == 0) return;
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
  SiluAndMulKernel<<<GridFor(rows * inter, kElemThreads), kElemThreads, 0, stream>>>(gate_up, rows,
                                                                                     inter, out);
  CheckLaunch("SiluAndMul");
}

void LaunchAddSigmoidScaled(uint16_t* x, const uint16_t* y, AnyPtr gate_logits, int64_t rows,
                            int64_t dim, cudaStream_t stream) {
  if (rows * dim == 0) return;
  AddSigmoidScaledKernel<<<GridFor(rows * dim, kElemThreads), kElemThreads, 0, stream>>>(
      x, y, gate_logits, rows, dim);
  CheckLaunch("AddSigmoidScaled");
}

void LaunchGatedRmsNorm(const uint16_t* x, const uint16_t* z, AnyPtr w, float eps, int64_t rows,
                        int64_t dim, uint16_t* out, cudaStream_t stream) {
  if (rows == 0) return;
  GatedRmsNormKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(x, z, w, eps, dim,
                                                                              out);
  CheckLaunch("GatedRmsNorm");
}

void LaunchMulSigmoid(uint16_t* x, const uint16_t* gate, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  MulSigmoidKernel<<<GridFor(n, kElemThreads), kElemThreads, 0, stream>>>(x, gate, n);
  CheckLaunch("MulSigmoid");
}

}  // namespace mobius::kernels::cuda
