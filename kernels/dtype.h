// Element types of tensors, on disk and in device memory, and the scalar conversions between
// them. bf16/f16 values are carried as raw 16-bit patterns; compute happens in fp32.
#ifndef MOBIUS_KERNELS_DTYPE_H_
#define MOBIUS_KERNELS_DTYPE_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace mobius::kernels {

enum class DType { kF32, kBF16, kF16, kI32 };

[[nodiscard]] constexpr size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
  }
  return 0;
}

[[nodiscard]] constexpr std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kI32:
      return "I32";
  }
  return "?";
}

// Parses the dtype names used in safetensors headers ("BF16", "F16", "F32", "I32").
[[nodiscard]] inline std::optional<DType> ParseDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  if (name == "I32") return DType::kI32;
  return std::nullopt;
}

[[nodiscard]] inline float BF16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// Round-to-nearest-even, NaN preserved (quiet).
[[nodiscard]] inline uint16_t FloatToBF16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

[[nodiscard]] inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

// Element i of a host array of `dtype`, widened to fp32 (I32 converts by value).
[[nodiscard]] inline float LoadAsFloat(const void* src, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(src)[i];
    case DType::kBF16:
      return BF16ToFloat(static_cast<const uint16_t*>(src)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(src)[i]);
    case DType::kI32:
      return static_cast<float>(static_cast<const int32_t*>(src)[i]);
  }
  return 0.0f;
}

}  // namespace mobius::kernels

#endif  // MOBIUS_KERNELS_DTYPE_H_
