// The performance model's byte counts (worker/model/decode_cost) on the release-scale config.
#include "worker/model/decode_cost.h"

#include "gtest/gtest.h"

namespace mobius::worker {
namespace {

ModelConfig ReleaseConfig() {
  auto config =
      LoadModelConfig(std::string(MOBIUS_CONFIGS_DIR) + "/intern-s2-mobius-35b/config.json");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

// One sequence's DeltaNet state, read and written: 30 layers x (32 x 128 x 128 recurrent +
// 8192 x 3 conv) fp32 values x 2.
constexpr double kStatePerSequence = 30.0 * (32 * 128 * 128 + 8192 * 3) * 4 * 2;

TEST(DecodeCostTest, DecodeReadsEverySequencesState) {
  DecodeCostOptions o;
  o.batch = 64;
  EXPECT_DOUBLE_EQ(EstimateDecodeStepBytes(ReleaseConfig(), o).recurrent_state,
                   64 * kStatePerSequence);
}

TEST(DecodeCostTest, PrefillOfOneSequenceReadsItsStateOnce) {
  DecodeCostOptions o;
  o.batch = 8192;
  o.sequences = 1;
  const DecodeStepBytes b = EstimateDecodeStepBytes(ReleaseConfig(), o);
  EXPECT_DOUBLE_EQ(b.recurrent_state, kStatePerSequence);
  // 8192 tokens x top-8 touch (nearly) all 2560 experts of each of the 40 layers' banks:
  // 2560 x 3 x 512 x 2048 x 2 bytes per layer.
  EXPECT_NEAR(b.routed_experts, 40.0 * 2560 * 3 * 512 * 2048 * 2, 1e-6 * b.routed_experts);
}

}  // namespace
}  // namespace mobius::worker
