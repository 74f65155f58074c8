#include "worker/distributed/collective_util.h"

#include <cstring>

#include "absl/strings/str_format.h"

namespace mobius::worker {

using kernels::DType;
using kernels::Tensor;

absl::Status CheckReducible(const Tensor& t, std::string_view op) {
  if (t.empty()) return absl::InvalidArgumentError(absl::StrFormat("%s: empty tensor", op));
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: dtype %s is not reducible (F32 or BF16)", op, DTypeName(t.dtype())));
  }
  return absl::OkStatus();
}

absl::Status CheckHost(const Tensor& t, std::string_view op) {
  if (t.device() != kernels::Device::kCpu) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tensor %s is not in host memory", op, t.ShapeString()));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckRowsOf(const Tensor& small, const Tensor& big, int world, std::string_view op) {
  if (small.empty() || big.empty() || small.rank() == 0 || big.rank() == 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: empty or scalar tensor", op));
  }
  if (small.dtype() != big.dtype()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: dtypes differ (%s vs %s)", op, DTypeName(small.dtype()), DTypeName(big.dtype())));
  }
  if (big.dim(0) != small.dim(0) * world ||
      big.numel() != small.numel() * static_cast<int64_t>(world)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: shapes %s and %s do not differ by a factor %d in dim 0", op,
                        small.ShapeString(), big.ShapeString(), world));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckAllGather(const Tensor& in, const Tensor& out, int world) {
  return CheckRowsOf(in, out, world, "AllGather");
}

absl::Status CheckReduceScatter(const Tensor& in, const Tensor& out, int world) {
  if (absl::Status s = CheckReducible(in, "ReduceScatterSum"); !s.ok()) return s;
  return CheckRowsOf(out, in, world, "ReduceScatterSum");
}

absl::Status CheckRoot(int root, int world, std::string_view op) {
  if (root < 0 || root >= world) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: root %d outside [0, %d)", op, root, world));
  }
  return absl::OkStatus();
}

void AccumulateF32(float* acc, const void* src, DType dtype, int64_t n) {
  if (dtype == DType::kF32) {
    const float* s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] += s[i];
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] += kernels::BF16ToFloat(s[i]);
  }
}

void StoreF32As(const float* src, void* dst, DType dtype, int64_t n) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = kernels::FloatToBF16(src[i]);
  }
}

void LoadAsF32(const void* src, DType dtype, float* dst, int64_t n) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = kernels::BF16ToFloat(s[i]);
  }
}

}  // namespace mobius::worker
