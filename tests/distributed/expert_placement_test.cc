// ExpertPlacement (issue 5): load-aware orders are permutations of each bank, give every rank
// the same number of experts, spread a skewed load better than the contiguous placement, are
// deterministic, and refuse loads that do not fit; with replicas, the hottest experts get more
// holders, each (token, expert) pair is routed to exactly one holder's slot of that expert, and
// the imbalance a single dominant expert leaves falls.
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

// One expert with most of the load: no permutation can balance it, replicas can.
TEST(ExpertPlacementTest, ReplicasSplitADominantExpert) {
  constexpr int kExperts = 16, kWorld = 4, kReplicas = 2;
  std::vector<std::vector<double>> loads = {std::vector<double>(kExperts, 1.0),
                                            std::vector<double>(kExperts, 2.0)};
  loads[0][5] = 1000;  // bank 0: expert 5 dominates
  loads[1][0] = 300;   // bank 1: experts 0 and 9 are hot
  loads[1][9] = 200;
  absl::StatusOr<ExpertPlacement> plain = ExpertPlacement::BalanceLoads(loads, kWorld);
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::BalanceLoads(loads, kWorld, kReplicas);
  ASSERT_TRUE(plain.ok() && p.ok()) << p.status();
  EXPECT_EQ(p->replicas_per_rank(), kReplicas);
  // A balanced load gets no replicas: no copy would lower the peak.
  absl::StatusOr<ExpertPlacement> flat =
      ExpertPlacement::BalanceLoads({std::vector<double>(kExperts, 1.0)}, kWorld, kReplicas);
  ASSERT_TRUE(flat.ok());
  EXPECT_EQ(flat->replicas_per_rank(), 0);
  EXPECT_FALSE(p->identity());
  ASSERT_TRUE(p->Validate(kWorld, kExperts).ok()) << p->Validate(kWorld, kExperts);
  // The dominant expert ends up on every rank (one primary + three replicas).
  const auto& order = p->order(0);
  const int hot = static_cast<int>(std::find(order.begin(), order.end(), 5) - order.begin());
  int holders = 0;
  for (int r = 0; r < kWorld; ++r) {
    const auto held = p->HeldPositions(0, kWorld, r);
    holders += std::count(held.begin(), held.end(), hot);
  }
  EXPECT_EQ(holders, kWorld);
  EXPECT_LT(p->Imbalance(loads, kWorld), 0.6 * plain->Imbalance(loads, kWorld));
  // Same loads, same placement.
  absl::StatusOr<ExpertPlacement> again = ExpertPlacement::BalanceLoads(loads, kWorld, kReplicas);
  for (int b = 0; b < 2; ++b) {
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(again->replicas(b, r), p->replicas(b, r));
  }
  // Every (token, position) pair goes to exactly one rank, to a slot that holds that position,
  // and the holders of a replicated position share its tokens.
  for (int b = 0; b < 2; ++b) {
    std::vector<std::vector<int32_t>> tables, held;
    for (int r = 0; r < kWorld; ++r) {
      tables.push_back(p->RouteTable(b, kWorld, r));
      held.push_back(p->HeldPositions(b, kWorld, r));
      EXPECT_GE(held.back().size(), static_cast<size_t>(kExperts / kWorld));
      EXPECT_LE(held.back().size(), static_cast<size_t>(kExperts / kWorld + kReplicas));
    }
    for (int j = 0; j < kExperts; ++j) {
      std::vector<int> ranks_used;
      for (int t = 0; t < 64; ++t) {
        int owners = 0;
        for (int r = 0; r < kWorld; ++r) {
          const int32_t* row = tables[r].data() + j * (kWorld + 1);
          ASSERT_GE(row[0], 1);
          const int32_t slot = row[1 + t % row[0]];
          if (slot < 0) continue;
          ++owners;
          ASSERT_LT(slot, static_cast<int32_t>(held[r].size()));
          EXPECT_EQ(held[r][slot], j) << "bank " << b << " rank " << r << " slot " << slot;
          if (std::find(ranks_used.begin(), ranks_used.end(), r) == ranks_used.end()) {
            ranks_used.push_back(r);
          }
        }
        EXPECT_EQ(owners, 1) << "bank " << b << " position " << j << " token " << t;
      }
      EXPECT_EQ(static_cast<int>(ranks_used.size()), tables[0][j * (kWorld + 1)]) << j;
    }
  }
}

TEST(ExpertPlacementTest, RefusesBadReplicas) {
  std::vector<std::vector<double>> loads = {std::vector<double>(8, 1.0)};
  EXPECT_FALSE(ExpertPlacement::BalanceLoads(loads, 2, 5).ok());  // a rank lacks only 4
  EXPECT_FALSE(ExpertPlacement::BalanceLoads(loads, 2, -1).ok());
  EXPECT_TRUE(ExpertPlacement::BalanceLoads(loads, 2, 4).ok());
  std::vector<int32_t> order(8);
  std::iota(order.begin(), order.end(), 0);
  // Rank 0 replicating its own position 1; a repeated position; out of range; missing ranks.
  EXPECT_FALSE(ExpertPlacement::FromOrders({order}, {{{1}, {2}}}).Validate(2, 8).ok());
  EXPECT_FALSE(ExpertPlacement::FromOrders({order}, {{{4}, {2, 2}}}).Validate(2, 8).ok());
  EXPECT_FALSE(ExpertPlacement::FromOrders({order}, {{{9}, {2}}}).Validate(2, 8).ok());
  EXPECT_FALSE(ExpertPlacement::FromOrders({order}, {{{4}}}).Validate(2, 8).ok());
  EXPECT_TRUE(ExpertPlacement::FromOrders({order}, {{{4}, {2}}}).Validate(2, 8).ok());
  EXPECT_TRUE(ExpertPlacement::FromOrders({order}, {{{4, 5}, {}}}).Validate(2, 8).ok());
}

}  // namespace
}  // namespace mobius::testing
