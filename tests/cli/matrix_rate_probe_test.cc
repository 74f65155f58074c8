// The matrix-rate probe `mobius bench engine` divides a step's FLOPs by, on the CPU backend.
#include "cli/matrix_rate_probe.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace mobius::cli {
namespace {

using ::testing::HasSubstr;

TEST(MatrixRateProbeTest, TimesTheProductItReports) {
  kernels::CpuBackend backend(1);
  absl::StatusOr<MatrixRate> rate = MeasureMatrixRate(backend, 64, 2);
  ASSERT_TRUE(rate.ok()) << rate.status();
  EXPECT_EQ(rate->dim, 64);
  EXPECT_EQ(rate->calls_per_round, 2);
  ASSERT_GT(rate->per_call_s, 0);
  // The rate is the product's FLOPs over the time it reports for one product, and a CPU's: well
  // above a MFLOP/s and below 10 TFLOP/s (a probe that skipped the product or timed something
  // else would land outside).
  EXPECT_DOUBLE_EQ(rate->flops_per_second, 2.0 * 64 * 64 * 64 / rate->per_call_s);
  EXPECT_GT(rate->flops_per_second, 1e6);
  EXPECT_LT(rate->flops_per_second, 1e13);
}

TEST(MatrixRateProbeTest, RejectsAnEmptyProductOrNoCalls) {
  kernels::CpuBackend backend(1);
  absl::StatusOr<MatrixRate> no_dim = MeasureMatrixRate(backend, 0, 2);
  EXPECT_EQ(no_dim.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_dim.status().message(), HasSubstr("dim = 0"));
  absl::StatusOr<MatrixRate> no_calls = MeasureMatrixRate(backend, 8, 0);
  EXPECT_EQ(no_calls.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_calls.status().message(), HasSubstr("calls = 0"));
}

}  // namespace
}  // namespace mobius::cli
