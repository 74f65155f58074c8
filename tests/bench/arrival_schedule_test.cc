// Arrival times: Poisson (exponential gaps, mean 1/rate, coefficient of variation 1, counts per
// window with variance equal to the mean), gamma burstiness, infinite rate, seeds, bad input.
#include "bench/serve/arrival_schedule.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mobius::bench {
namespace {

struct GapStats {
  double mean = 0;
  double cv = 0;  // std / mean
};

GapStats Gaps(const std::vector<double>& offsets) {
  std::vector<double> gaps;
  for (size_t i = 1; i < offsets.size(); ++i) gaps.push_back(offsets[i] - offsets[i - 1]);
  GapStats s;
  for (double g : gaps) s.mean += g;
  s.mean /= gaps.size();
  double var = 0;
  for (double g : gaps) var += (g - s.mean) * (g - s.mean);
  s.cv = std::sqrt(var / gaps.size()) / s.mean;
  return s;
}

TEST(ArrivalScheduleTest, InfiniteRateSendsEverythingAtOnce) {
  auto offsets = ArrivalOffsets(5, std::numeric_limits<double>::infinity(), 1, 0);
  ASSERT_TRUE(offsets.ok());
  EXPECT_THAT(*offsets, ::testing::Each(0.0));
  EXPECT_EQ(offsets->size(), 5u);
}

TEST(ArrivalScheduleTest, PoissonArrivals) {
  const double rate = 10;
  auto offsets = ArrivalOffsets(20001, rate, 1, 42);
  ASSERT_TRUE(offsets.ok());
  EXPECT_EQ((*offsets)[0], 0.0);  // the first request goes at once, as in vLLM
  for (size_t i = 1; i < offsets->size(); ++i) ASSERT_GE((*offsets)[i], (*offsets)[i - 1]);
  GapStats s = Gaps(*offsets);
  // 20000 exponential gaps: the standard error of the mean is 0.7%, of the CV about 1%.
  EXPECT_NEAR(s.mean, 1 / rate, 0.03 / rate);
  EXPECT_NEAR(s.cv, 1.0, 0.05);
  // P(gap < mean) = 1 - 1/e for an exponential distribution.
  int below = 0;
  for (size_t i = 1; i < offsets->size(); ++i) below += (*offsets)[i] - (*offsets)[i - 1] < 0.1;
  EXPECT_NEAR(below / 20000.0, 1 - std::exp(-1.0), 0.015);
  // Arrivals per one-second window are Poisson(10): variance / mean = 1.
  std::vector<int> counts(static_cast<size_t>(offsets->back()), 0);
  for (double t : *offsets) {
    if (static_cast<size_t>(t) < counts.size()) ++counts[static_cast<size_t>(t)];
  }
  double mean = 0, var = 0;
  for (int c : counts) mean += c;
  mean /= counts.size();
  for (int c : counts) var += (c - mean) * (c - mean);
  var /= counts.size();
  EXPECT_NEAR(mean, rate, 0.3);
  EXPECT_NEAR(var / mean, 1.0, 0.15);
}

TEST(ArrivalScheduleTest, BurstinessShapesTheGapsButKeepsTheRate) {
  // Gamma gaps with shape k have CV 1/sqrt(k).
  auto regular = ArrivalOffsets(20001, 5, 4, 7);
  auto bursty = ArrivalOffsets(20001, 5, 0.25, 7);
  ASSERT_TRUE(regular.ok() && bursty.ok());
  EXPECT_NEAR(Gaps(*regular).mean, 0.2, 0.006);
  EXPECT_NEAR(Gaps(*regular).cv, 0.5, 0.03);
  EXPECT_NEAR(Gaps(*bursty).mean, 0.2, 0.012);
  EXPECT_NEAR(Gaps(*bursty).cv, 2.0, 0.15);
}

TEST(ArrivalScheduleTest, SeedDecidesTheSchedule) {
  auto a = ArrivalOffsets(100, 3, 1, 1);
  auto b = ArrivalOffsets(100, 3, 1, 1);
  auto c = ArrivalOffsets(100, 3, 1, 2);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *c);
}

TEST(ArrivalScheduleTest, BadRateOrBurstinessNamesTheFlag) {
  for (double rate : {0.0, -1.0, std::nan("")}) {
    auto r = ArrivalOffsets(3, rate, 1, 0);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("--request-rate"));
  }
  auto b = ArrivalOffsets(3, 1, 0, 0);
  EXPECT_THAT(std::string(b.status().message()), ::testing::HasSubstr("--burstiness"));
}

}  // namespace
}  // namespace mobius::bench
