// ExpertPlacement (issue 5): load-aware orders are permutations of each bank, give every rank
// the same number of experts, spread a skewed load better than the contiguous placement, are
// deterministic, and refuse loads that do not fit.
#include "worker/model/expert_placement.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mobius::testing {
namespace {

using worker::ExpertPlacement;

TEST(ExpertPlacementTest, ContiguousIsTheIdentity) {
  const ExpertPlacement p = ExpertPlacement::Contiguous(3, 40);
  EXPECT_TRUE(p.identity());
  ASSERT_EQ(p.num_banks(), 3);
  for (int j = 0; j < 40; ++j) EXPECT_EQ(p.order(2)[j], j);
}

TEST(ExpertPlacementTest, BalancesAZipfLoadAcrossRanks) {
  constexpr int kExperts = 2560, kBanks = 4;
  std::mt19937 rng(7);
  std::vector<std::vector<double>> loads(kBanks, std::vector<double>(kExperts));
  for (auto& bank : loads) {
    std::vector<int> rank_of(kExperts);
    std::iota(rank_of.begin(), rank_of.end(), 1);
    std::shuffle(rank_of.begin(), rank_of.end(), rng);
    for (int e = 0; e < kExperts; ++e) bank[e] = 1e6 / rank_of[e];  // Zipf, hot experts anywhere
  }
  for (int world : {2, 4, 8}) {
    absl::StatusOr<ExpertPlacement> p = ExpertPlacement::BalanceLoads(loads, world);
    ASSERT_TRUE(p.ok()) << p.status();
    for (int b = 0; b < kBanks; ++b) {
      std::vector<int32_t> sorted = p->order(b);
      std::sort(sorted.begin(), sorted.end());
      for (int j = 0; j < kExperts; ++j) ASSERT_EQ(sorted[j], j) << "bank " << b;
    }
    const double balanced = p->Imbalance(loads, world);
    const double contiguous = ExpertPlacement::Contiguous(kBanks, kExperts).Imbalance(loads, world);
    std::printf("world %d: max/mean rank load %.4f (contiguous %.4f)\n", world, balanced,
                contiguous);
    EXPECT_LT(balanced, contiguous);
    // Without replicas no rank can carry less than its heaviest expert: the greedy placement
    // stays within one heaviest expert per bank of the mean share.
    double mean = 0, heaviest = 0;
    for (const auto& bank : loads) {
      mean += std::accumulate(bank.begin(), bank.end(), 0.0) / world;
      heaviest += *std::max_element(bank.begin(), bank.end());
    }
    EXPECT_LE(balanced, 1.0 + heaviest / mean);
    // Deterministic: every rank computes the same placement from the same loads.
    absl::StatusOr<ExpertPlacement> again = ExpertPlacement::BalanceLoads(loads, world);
    for (int b = 0; b < kBanks; ++b) EXPECT_EQ(again->order(b), p->order(b));
  }
}

TEST(ExpertPlacementTest, HotExpertsLandOnDifferentRanks) {
  std::vector<std::vector<double>> loads = {std::vector<double>(8, 1.0)};
  loads[0][0] = loads[0][1] = 50;  // both on rank 0 when contiguous
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::BalanceLoads(loads, 2);
  ASSERT_TRUE(p.ok());
  const auto& o = p->order(0);
  const bool zero_first = std::find(o.begin(), o.begin() + 4, 0) != o.begin() + 4;
  const bool one_first = std::find(o.begin(), o.begin() + 4, 1) != o.begin() + 4;
  EXPECT_NE(zero_first, one_first);
}

TEST(ExpertPlacementTest, RefusesLoadsThatDoNotFit) {
  EXPECT_FALSE(ExpertPlacement::BalanceLoads({std::vector<double>(10, 1.0)}, 4).ok());
  EXPECT_FALSE(ExpertPlacement::BalanceLoads({{1, 2}, {1, 2, 3, 4}}, 2).ok());
  EXPECT_FALSE(ExpertPlacement::BalanceLoads({{1, -2}}, 2).ok());
  const std::string path = ::testing::TempDir() + "/bad_expert_load.json";
  std::ofstream(path) << R"({"banks": [[1, 2, "x", 4]]})";
  absl::StatusOr<ExpertPlacement> bad = ExpertPlacement::FromLoadFile(path, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bank 0 entry 2"), std::string::npos) << bad.status();
  EXPECT_FALSE(ExpertPlacement::FromLoadFile(path + ".missing", 2).ok());
  std::ofstream(path) << R"({"banks": [[5, 5, 1, 1]]})";  // contiguous: both hot on rank 0
  absl::StatusOr<ExpertPlacement> good = ExpertPlacement::FromLoadFile(path, 2);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_FALSE(good->identity());
}

}  // namespace
}  // namespace mobius::testing
