#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "absl/strings/str_format.h"
#include "kernels/cpu/cpu_math.h"

namespace mobius::kernels {
namespace {

// Requests above this size are mapped fresh from the kernel: its pages arrive zeroed and are only
// touched when used, so a large KV cache costs no memset up front.
constexpr size_t kMmapThreshold = size_t{1} << 20;
constexpr size_t kAlignment = 64;

// Read once: glibc answers _SC_PHYS_PAGES with a sysinfo() system call, and every tensor a step
// allocates asks (it was 16% of a CPU worker's time serving the tiny fixture model).
size_t PhysicalMemoryBytes() {
  static const size_t bytes = [] {
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page_size <= 0) return SIZE_MAX;
    return static_cast<size_t>(pages) * static_cast<size_t>(page_size);
  }();
  return bytes;
}

// 64-byte-aligned, zeroed host memory; nullptr on failure.
std::shared_ptr<void> AllocateZeroed(size_t bytes) {
  bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (bytes == 0) bytes = kAlignment;  // a zero-element tensor still gets a non-null address
  if (bytes >= kMmapThreshold) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    return std::shared_ptr<void>(p, [bytes](void* q) { munmap(q, bytes); });
  }
  void* p = nullptr;
  if (posix_memalign(&p, kAlignment, bytes) != 0) return nullptr;
  std::memset(p, 0, bytes);
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

int64_t RowLength(const Tensor& t) { return t.rank() == 0 ? 1 : t.dim(-1); }

}  // namespace

CpuBackend::CpuBackend(int num_threads)
    : num_threads_(num_threads > 0 ? num_threads : omp_get_num_procs()) {
  openblas_set_num_threads(num_threads_);
}

std::string CpuBackend::name() const {
  return absl::StrFormat("cpu-fp32 (%d threads)", num_threads_);
}

absl::StatusOr<Tensor> CpuBackend::Allocate(DType dtype, std::vector<int64_t> shape) {
  Tensor probe(nullptr, nullptr, dtype, shape, Device::kCpu);
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("cannot allocate a %s tensor of shape %s: negative dimension",
                          DTypeName(dtype), probe.ShapeString()));
    }
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cannot allocate a %s tensor of shape %s: element count overflows",
                          DTypeName(dtype), probe.ShapeString()));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(dtype)), &bytes) ||
      bytes > PhysicalMemoryBytes()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cannot allocate %d bytes for a %s tensor of shape %s: more than the host's %d bytes",
        bytes, DTypeName(dtype), probe.ShapeString(), PhysicalMemoryBytes()));
  }
  std::shared_ptr<void> storage = AllocateZeroed(static_cast<size_t>(bytes));
  if (!storage) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cannot allocate %d bytes for a %s tensor of shape %s: out of host memory",
                        bytes, DTypeName(dtype), probe.ShapeString()));
  }
  void* data = storage.get();
  return Tensor(std::move(storage), data, dtype, std::move(shape), Device::kCpu);
}

void CpuBackend::CopyFromHost(const void* src, DType src_dtype, Tensor& dst) {
  const int64_t n = dst.numel();
  if (src_dtype == dst.dtype()) {
    std::memcpy(dst.raw(), src, dst.nbytes());
    return;
  }
  // Widen to fp32 first; a BF16 destination then rounds to nearest even.
  auto load = [src, src_dtype](int64_t i) { return LoadAsFloat(src, src_dtype, i); };
  switch (dst.dtype()) {
    case DType::kF32: {
      float* d = dst.data<float>();
#pragma omp parallel for num_threads(num_threads_) if (n > cpu::kParallelGrain)
      for (int64_t i = 0; i < n; ++i) d[i] = load(i);
      break;
    }
    case DType::kBF16: {
      uint16_t* d = dst.data<uint16_t>();
#pragma omp parallel for num_threads(num_threads_) if (n > cpu::kParallelGrain)
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToBF16(load(i));
      break;
    }
    case DType::kF16:
    case DType::kI32:
      // Not a conversion the interface defines (only I32 -> I32, handled above).
      break;
  }
}

void CpuBackend::CopyToHostF32(const Tensor& src, float* dst) {
  const int64_t n = src.numel();
  switch (src.dtype()) {
    case DType::kF32:
      std::memcpy(dst, src.raw(), static_cast<size_t>(n) * sizeof(float));
      break;
    case DType::kBF16: {
      const uint16_t* s = src.data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(s[i]);
      break;
    }
    case DType::kF16: {
      const uint16_t* s = src.data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToFloat(s[i]);
      break;
    }
    case DType::kI32: {
      const int32_t* s = src.data<int32_t>();
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      break;
    }
  }
}

void CpuBackend::CopyToHostI32(const Tensor& src, int32_t* dst) {
  std::memcpy(dst, src.raw(), src.nbytes());
}

void CpuBackend::ZeroFill(Tensor& t) {
  if (!t.empty()) std::memset(t.raw(), 0, t.nbytes());
}

void CpuBackend::Linear(const Tensor& x, const Tensor& w, Tensor& y) {
  // w is [N, K]; x and y may carry extra leading dims ([T, ...]), so rows are derived from numel.
  const int64_t K = RowLength(w);
  const int64_t N = K == 0 ? 0 : w.numel() / K;
  const int64_t T = K == 0 ? (N == 0 ? 0 : y.numel() / N) : x.numel() / K;
  if (T == 0 || N == 0) return;
  if (K == 0) {
    ZeroFill(y);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(T), static_cast<int>(N),
              static_cast<int>(K), 1.0f, x.data<float>(), static_cast<int>(K), w.data<float>(),
              static_cast<int>(K), 0.0f, y.data<float>(), static_cast<int>(N));
}

void CpuBackend::EmbeddingLookup(std::span<const int32_t> ids, const Tensor& table, Tensor& out) {
  GatherRows(table, ids, out);
}

void CpuBackend::GatherRows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n == 0) return;
  const int64_t d = out.numel() / n;
  const float* src = x.data<float>();
  float* dst = out.data<float>();
#pragma omp parallel for num_threads(num_threads_) if (n * d > cpu::kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * d, src + static_cast<int64_t>(rows[i]) * d, d * sizeof(float));
  }
}

void CpuBackend::RmsNorm1p(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const int64_t D = w.numel();
  const int64_t R = D == 0 ? 0 : x.numel() / D;
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* op = out.data<float>();
#pragma omp parallel for num_threads(num_threads_) if (R * D > cpu::kParallelGrain)
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = xp + r * D;
    float* orow = op + r * D;
    const float scale = cpu::RmsScale(xr, D, eps);
    for (int64_t i = 0; i < D; ++i) orow[i] = xr[i] * scale * (1.0f + wp[i]);
  }
}

void CpuBackend::AddRmsNorm1p(Tensor& residual, const Tensor& delta, const Tensor& w, float eps,
                              Tensor& out) {
  const int64_t D = w.numel();
  const int64_t R = D == 0 ? 0 : residual.numel() / D;
  float* hp = residual.data<float>();
  const float* dp = delta.data<float>();
  const float* wp = w.data<float>();
  float* op = out.data<float>();
#pragma omp parallel for num_threads(num_threads_) if (R * D > cpu::kParallelGrain)
  for (int64_t r = 0; r < R; ++r) {
    float* hr = hp + r * D;
    const float* dr = dp + r * D;
    for (int64_t i = 0; i < D; ++i) hr[i] += dr[i];
    const float scale = cpu::RmsScale(hr, D, eps);
    float* orow = op + r * D;
    for (int64_t i = 0; i < D; ++i) orow[i] = hr[i] * scale * (1.0f + wp[i]);
  }
}

void CpuBackend::Add(Tensor& x, const Tensor& y) {
  const int64_t n = x.numel();
  float* xp = x.data<float>();
  const float* yp = y.data<float>();
#pragma omp parallel for simd num_threads(num_threads_) if (n > cpu::kParallelGrain)
  for (int64_t i = 0; i < n; ++i) xp[i] += yp[i];
}

void CpuBackend::SiluAndMul(const Tensor& gate_up, Tensor& out) {
  const int64_t I = RowLength(out);
  const int64_t T = I == 0 ? 0 : out.numel() / I;
  const float* gu = gate_up.data<float>();
  float* op = out.data<float>();
#pragma omp parallel for num_threads(num_threads_) if (T * I > cpu::kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gu + t * 2 * I;
    const float* u = g + I;
    float* o = op + t * I;
    for (int64_t i = 0; i < I; ++i) o[i] = cpu::Silu(g[i]) * u[i];
  }
}

void CpuBackend::AddSigmoidScaled(Tensor& x, const Tensor& y, const Tensor& gate_logits) {
  const int64_t T = gate_logits.numel();
  const int64_t H = T == 0 ? 0 : x.numel() / T;
  float* xp = x.data<float>();
  const float* yp = y.data<float>();
  const float* gp = gate_logits.data<float>();
#pragma omp parallel for num_threads(num_threads_) if (T * H > cpu::kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const float s = cpu::Sigmoid(gp[t]);
    float* xr = xp + t * H;
    const float* yr = yp + t * H;
    for (int64_t i = 0; i < H; ++i) xr[i] += s * yr[i];
  }
}

void CpuBackend::MulSigmoid(Tensor& x, const Tensor& gate) {
  const int64_t n = x.numel();
  float* xp = x.data<float>();
  const float* gp = gate.data<float>();
#pragma omp parallel for num_threads(num_threads_) if (n > cpu::kParallelGrain)
  for (int64_t i = 0; i < n; ++i) xp[i] *= cpu::Sigmoid(gp[i]);
}

std::unique_ptr<Backend> CreateCpuBackend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads);
}

}  // namespace mobius::kernels
