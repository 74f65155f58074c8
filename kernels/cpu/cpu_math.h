// Scalar helpers shared by the CPU kernels (internal to kernels/cpu).
#ifndef MOBIUS_KERNELS_CPU_CPU_MATH_H_
#define MOBIUS_KERNELS_CPU_CPU_MATH_H_

#include <cmath>
#include <cstdint>

namespace mobius::kernels::cpu {

// Below this many elements an elementwise loop is not worth waking the thread team for.
inline constexpr int64_t kParallelGrain = 1 << 15;

[[nodiscard]] inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
[[nodiscard]] inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// 1 / sqrt(mean(x^2) + eps) of one row, accumulated in fp32.
[[nodiscard]] inline float RmsScale(const float* x, int64_t n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

}  // namespace mobius::kernels::cpu

#endif  // MOBIUS_KERNELS_CPU_CPU_MATH_H_
