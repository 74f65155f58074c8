// Helpers for the CPU kernel tests: random host data, host <-> backend tensors, and closeness
// checks against naive double-precision references written in the tests themselves.
#ifndef MOBIUS_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define MOBIUS_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace mobius::kernels::testing {

inline std::vector<float> RandomVector(std::mt19937& rng, int64_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

inline std::vector<float> UniformVector(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

inline Tensor MakeF32(Backend& backend, std::vector<int64_t> shape, const std::vector<float>& v) {
  auto t = backend.Allocate(DType::kF32, std::move(shape));
  EXPECT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->numel(), static_cast<int64_t>(v.size()));
  backend.CopyFromHost(v.data(), DType::kF32, *t);
  return *t;
}

inline Tensor MakeI32(Backend& backend, std::vector<int64_t> shape, const std::vector<int32_t>& v) {
  auto t = backend.Allocate(DType::kI32, std::move(shape));
  EXPECT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->numel(), static_cast<int64_t>(v.size()));
  backend.CopyFromHost(v.data(), DType::kI32, *t);
  return *t;
}

inline Tensor Zeros(Backend& backend, std::vector<int64_t> shape, DType dtype = DType::kF32) {
  auto t = backend.Allocate(dtype, std::move(shape));
  EXPECT_TRUE(t.ok()) << t.status();
  return *t;
}

inline std::vector<float> ToHost(Backend& backend, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  backend.CopyToHostF32(t, v.data());
  return v;
}

// Every element within atol + rtol * |expected|.
template <typename Expected>
void ExpectAllClose(const std::vector<float>& actual, const std::vector<Expected>& expected,
                    double atol, double rtol, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double e = static_cast<double>(expected[i]);
    const double diff = std::abs(static_cast<double>(actual[i]) - e);
    if (!(diff <= atol + rtol * std::abs(e))) {
      ADD_FAILURE() << what << ": element " << i << " is " << actual[i] << ", expected " << e;
      if (++reported >= 5) return;
    }
  }
}

// max |actual - expected| relative to max |expected| (a norm-wise relative error).
template <typename Expected>
double MaxRelativeError(const std::vector<float>& actual, const std::vector<Expected>& expected) {
  double max_diff = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double e = static_cast<double>(expected[i]);
    max_diff = std::max(max_diff, std::abs(static_cast<double>(actual[i]) - e));
    max_ref = std::max(max_ref, std::abs(e));
  }
  return max_ref == 0.0 ? max_diff : max_diff / max_ref;
}

inline double SigmoidD(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double SiluD(double x) { return x * SigmoidD(x); }

}  // namespace mobius::kernels::testing

#endif  // MOBIUS_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
