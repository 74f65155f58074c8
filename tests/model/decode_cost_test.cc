// The performance model's byte and FLOP counts and its bounds (worker/model/decode_cost) on the
// release-scale config.
#include "worker/model/decode_cost.h"

#include <algorithm>

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

// bench/configs/qwen3-next-80b-a3b-12-layers.json: Qwen3-Next-80B-A3B's shapes on 12 of its 48
// layers (so that dummy weights fit one 80 GB GPU), for kernel A/Bs with 512-expert banks
// (docs/cuda-backend.md, next steps). It parses as that model: 9 DeltaNet and 3 attention layers,
// and an 8K prompt touches every one of each layer's 512 experts (2048 x 3 x 512 bf16 each).
TEST(DecodeCostTest, QwenNextBenchConfigHasTheReleasedShapes) {
  auto config =
      LoadModelConfig(std::string(MOBIUS_BENCH_CONFIGS_DIR) + "/qwen3-next-80b-a3b-12-layers.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->family, ModelFamily::kQwen3Next);
  EXPECT_EQ(config->hidden_size, 2048);
  EXPECT_EQ(
      std::count(config->layer_types.begin(), config->layer_types.end(), LayerType::kFullAttention),
      3);
  EXPECT_EQ(config->num_experts, 512);
  EXPECT_EQ(config->num_experts_per_tok, 10);
  EXPECT_EQ(config->moe_intermediate_size, 512);
  DecodeCostOptions o;
  o.batch = 8192;
  o.sequences = 1;
  const double experts = EstimateDecodeStepBytes(*config, o).routed_experts;
  EXPECT_NEAR(experts, 12.0 * 512 * 3 * 512 * 2048 * 2, 1e-6 * experts);
}

// The release architecture, written out: 30 DeltaNet layers (q, k 16 x 128 each, v and z
// 32 x 128, b and a 32 each, out 4096 -> 2048), 10 attention layers (q and its gate 2 x 16 x 256,
// k and v 2 x 256 each, o 4096 -> 2048), 40 MoE layers (shared expert 3 x 512 x 2048, its gate,
// router 2560 x 2048), hidden 2048.
constexpr double kH = 2048;
constexpr double kDeltaNetMatmul = (2 * 16 * 128 + 32 * 128 + 32 * 128 + 2 * 32) * kH + kH * 4096;
constexpr double kAttentionMatmul = (2 * 16 * 256 + 2 * 2 * 256) * kH + kH * 16 * 256;
constexpr double kMoeDenseMatmul = 3 * 512 * kH + kH + 2560 * kH;
constexpr double kDenseMatmul = 30 * kDeltaNetMatmul + 10 * kAttentionMatmul + 40 * kMoeDenseMatmul;

TEST(DecodeCostTest, DenseBytesAreTheMatmulWeightsPlusNormsConvAndGates) {
  // Norms: 2 per layer + the final one (hidden); DeltaNet: conv 8192 x 4 taps, A and dt (32
  // each), the gated norm (128); attention: the q and k norms (256 each).
  const double other = 81 * kH + 30 * (8192 * 4 + 2 * 32 + 128) + 10 * 2 * 256;
  EXPECT_DOUBLE_EQ(EstimateDecodeStepBytes(ReleaseConfig(), DecodeCostOptions{}).dense_weights,
                   (kDenseMatmul + other) * 2);
}

TEST(DecodeCostTest, DecodeFlopsCountEachKindOfWork) {
  DecodeCostOptions o;
  o.batch = 4;
  o.context = 1000;
  const DecodeStepFlops f = EstimateDecodeStepFlops(ReleaseConfig(), o);
  EXPECT_DOUBLE_EQ(f.dense_projections, 2 * 4 * kDenseMatmul);
  EXPECT_DOUBLE_EQ(f.lm_head, 2 * 4 * 248320 * kH);  // a logits row per sequence
  EXPECT_DOUBLE_EQ(f.routed_experts, 2 * 4 * 40 * 8 * 3 * 512 * kH);
  // Each of the 4 queries sees its 1000 cached positions and itself, in 16 heads of 256.
  EXPECT_DOUBLE_EQ(f.attention, 4.0 * 10 * 16 * 256 * 4 * 1001);
  EXPECT_DOUBLE_EQ(f.delta_rule, 7.0 * 4 * 30 * 32 * 128 * 128);
  EXPECT_DOUBLE_EQ(f.total(),
                   f.dense_projections + f.lm_head + f.routed_experts + f.attention + f.delta_rule);
}

TEST(DecodeCostTest, PrefillFlopsAreCausalWithOneLogitsRow) {
  DecodeCostOptions o;
  o.batch = 8192;
  o.sequences = 1;
  const ModelConfig config = ReleaseConfig();
  const DecodeStepFlops f = EstimateDecodeStepFlops(config, o);
  // Token t sees positions 0..t: 8192 x 8193 / 2 pairs.
  EXPECT_DOUBLE_EQ(f.attention, 4.0 * 10 * 16 * 256 * (8192.0 * 8193 / 2));
  EXPECT_DOUBLE_EQ(f.lm_head, 2 * 248320 * kH);
  o.logits_rows = 8192;  // every token's logits
  EXPECT_DOUBLE_EQ(EstimateDecodeStepFlops(config, o).lm_head, 2.0 * 8192 * 248320 * kH);
  // Two sequences of 4096 new tokens after 100 cached each.
  o.logits_rows = 0;
  o.sequences = 2;
  o.context = 100;
  const DecodeStepFlops two = EstimateDecodeStepFlops(config, o);
  EXPECT_DOUBLE_EQ(two.attention, 4.0 * 10 * 16 * 256 * 2 * (4096.0 * 100 + 4096.0 * 4097 / 2));
  EXPECT_DOUBLE_EQ(two.lm_head, 2 * 2 * 248320 * kH);
}

TEST(DecodeCostTest, BoundsAreTheRooflineAndTheSerialSumOfEachPartsLimit) {
  const ModelConfig config = ReleaseConfig();
  constexpr double kBandwidth = 4e12, kRate = 8e14;
  // Batch 1: every part is bandwidth-bound, so the serial bound is the bytes bound.
  DecodeCostOptions decode;
  const DecodeStepBytes db = EstimateDecodeStepBytes(config, decode);
  const StepBound d = BoundStep(db, EstimateDecodeStepFlops(config, decode), kBandwidth, kRate);
  EXPECT_DOUBLE_EQ(d.bytes, db.total() / kBandwidth);
  EXPECT_GT(d.bytes, d.flops);
  EXPECT_DOUBLE_EQ(d.roofline(), d.bytes);
  EXPECT_NEAR(d.serial, d.bytes, 1e-12);

  // An 8K prefill: the experts are bandwidth-bound, the dense projections and attention
  // compute-bound, so the serial bound exceeds both the bytes and the FLOP bound.
  DecodeCostOptions prefill;
  prefill.batch = 8192;
  prefill.sequences = 1;
  const DecodeStepBytes pb = EstimateDecodeStepBytes(config, prefill);
  const DecodeStepFlops pf = EstimateDecodeStepFlops(config, prefill);
  const StepBound p = BoundStep(pb, pf, kBandwidth, kRate);
  EXPECT_DOUBLE_EQ(p.flops, pf.total() / kRate);
  EXPECT_DOUBLE_EQ(p.roofline(), p.bytes);
  const double expected_serial = (pf.dense_projections / kRate) + (pb.lm_head / kBandwidth) +
                                 (pb.routed_experts / kBandwidth) + (pf.attention / kRate) +
                                 (pf.delta_rule / kRate);
  EXPECT_NEAR(p.serial, expected_serial, 1e-12);
  EXPECT_GT(p.serial, p.bytes * 1.1);

  // Without both ceilings there is no bound.
  for (const auto& [bandwidth, rate] : {std::pair{0.0, kRate}, std::pair{kBandwidth, 0.0}}) {
    const StepBound none = BoundStep(pb, pf, bandwidth, rate);
    EXPECT_EQ(none.bytes, 0);
    EXPECT_EQ(none.flops, 0);
    EXPECT_EQ(none.serial, 0);
  }
}

}  // namespace
}  // namespace mobius::worker
