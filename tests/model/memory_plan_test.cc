// Device-memory planning (worker/model/memory_plan) on the release-scale config, with a backend
// that reports chosen memory figures.
#include "worker/model/memory_plan.h"

#include <memory>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/runtime/scheduler.h"

namespace mobius::worker {
namespace {

// Reports chosen memory figures; planning calls nothing else, so the ops do nothing.
class FakeDeviceBackend : public kernels::Backend {
 public:
  FakeDeviceBackend(int64_t free_bytes, int64_t total_bytes)
      : cpu_(kernels::CreateCpuBackend(1)), info_{free_bytes, total_bytes} {}
  absl::StatusOr<kernels::DeviceMemoryInfo> MemoryInfo() override { return info_; }
  // Everything else is the CPU backend's (planning calls none of it).
  kernels::Device device() const override { return cpu_->device(); }
  std::string name() const override { return "fake-device"; }
  kernels::DType activation_dtype() const override { return kernels::DType::kBF16; }
  absl::StatusOr<kernels::Tensor> Allocate(kernels::DType d, std::vector<int64_t> s) override {
    return cpu_->Allocate(d, std::move(s));
  }
  void CopyFromHost(const void* s, kernels::DType d, kernels::Tensor& t) override {
    cpu_->CopyFromHost(s, d, t);
  }
  void CopyToHostF32(const kernels::Tensor& s, float* d) override { cpu_->CopyToHostF32(s, d); }
  void CopyToHostI32(const kernels::Tensor& s, int32_t* d) override { cpu_->CopyToHostI32(s, d); }
  void Synchronize() override {}
  void Linear(const kernels::Tensor&, const kernels::Tensor&, kernels::Tensor&) override {}
  void EmbeddingLookup(std::span<const int32_t>, const kernels::Tensor&,
                       kernels::Tensor&) override {}
  void GatherRows(const kernels::Tensor&, std::span<const int32_t>, kernels::Tensor&) override {}
  void RmsNorm1p(const kernels::Tensor&, const kernels::Tensor&, float, kernels::Tensor&) override {
  }
  void AddRmsNorm1p(kernels::Tensor&, const kernels::Tensor&, const kernels::Tensor&, float,
                    kernels::Tensor&) override {}
  void Add(kernels::Tensor&, const kernels::Tensor&) override {}
  void SiluAndMul(const kernels::Tensor&, kernels::Tensor&) override {}
  void AddSigmoidScaled(kernels::Tensor&, const kernels::Tensor&, const kernels::Tensor&) override {
  }
  void CausalConv1dSilu(const kernels::Tensor&, const kernels::Tensor&, kernels::Tensor&,
                        std::span<const kernels::SequenceSegment>, kernels::Tensor&) override {}
  void DeltaRuleGates(const kernels::Tensor&, const kernels::Tensor&, const kernels::Tensor&,
                      const kernels::Tensor&, kernels::Tensor&, kernels::Tensor&) override {}
  void GatedDeltaRule(const kernels::Tensor&, const kernels::Tensor&, const kernels::Tensor&,
                      const kernels::DeltaRuleDims&, kernels::Tensor&,
                      std::span<const kernels::SequenceSegment>, kernels::DeltaRuleAlgorithm,
                      kernels::Tensor&) override {}
  void GatedRmsNorm(const kernels::Tensor&, const kernels::Tensor&, const kernels::Tensor&, float,
                    kernels::Tensor&) override {}
  void QkNormRope(const kernels::Tensor&, kernels::Tensor&, const kernels::Tensor&,
                  const kernels::Tensor&, float, const kernels::RopeParams&,
                  std::span<const kernels::SequenceSegment>, kernels::Tensor&,
                  kernels::Tensor&) override {}
  void WriteKvCache(const kernels::Tensor&, const kernels::Tensor&,
                    std::span<const kernels::SequenceSegment>, kernels::Tensor&,
                    kernels::Tensor&) override {}
  void PagedAttention(const kernels::Tensor&, const kernels::Tensor&, const kernels::Tensor&,
                      std::span<const kernels::SequenceSegment>, float, kernels::Tensor&) override {
  }
  void MulSigmoid(kernels::Tensor&, const kernels::Tensor&) override {}
  void TopKSoftmax(const kernels::Tensor&, int, bool, kernels::Tensor&, kernels::Tensor&) override {
  }
  void MoeExperts(const kernels::Tensor&, const kernels::Tensor&, const kernels::Tensor&,
                  const kernels::Tensor&, const kernels::Tensor&, int, kernels::Tensor&,
                  std::span<int64_t>) override {}

 private:
  std::unique_ptr<kernels::Backend> cpu_;
  kernels::DeviceMemoryInfo info_;
};

ModelConfig ReleaseConfig() {
  auto config =
      LoadModelConfig(std::string(MOBIUS_CONFIGS_DIR) + "/intern-s2-mobius-35b/config.json");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

constexpr int64_t kGiB = int64_t{1} << 30;

TEST(MemoryPlanTest, BlockAndSlotSizesOfTheReleaseModel) {
  FakeDeviceBackend backend(70 * kGiB, 140 * kGiB);
  MemoryPlanOptions options;
  auto plan = PlanDeviceMemory(ReleaseConfig(), backend, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // 10 attention layers x (k + v) x 16 positions x 2 kv heads x 256 dims x 2 bytes.
  EXPECT_EQ(plan->kv_block_bytes, 10 * 2 * 16 * 2 * 256 * 2);
  // 30 DeltaNet layers x 4 bytes x (conv 8192 channels x 3 taps + 32 heads x 128 x 128).
  EXPECT_EQ(plan->state_slot_bytes, int64_t{30} * 4 * (8192 * 3 + 32 * 128 * 128));
  // 64 sequences of 8192 tokens want 64 x 512 blocks (21 GB): they fit in 70 GB free.
  EXPECT_EQ(plan->max_useful_blocks, 64 * 512);
  EXPECT_EQ(plan->num_kv_blocks, plan->max_useful_blocks);
  EXPECT_NE(plan->Summary().find("32768 blocks"), std::string::npos) << plan->Summary();
}

// The reserve is sized for the step the scheduler will plan: both default to one budget.
TEST(MemoryPlanTest, PlansForTheSchedulersDefaultBudget) {
  EXPECT_EQ(MemoryPlanOptions{}.max_tokens_per_step, kDefaultMaxTokensPerStep);
  EXPECT_EQ(SchedulerOptions{}.max_tokens_per_step, kDefaultMaxTokensPerStep);
}

// One sequence of 1024 tokens can never fill an 8192-token step: the reserve is the 1024-token
// step's (twice its estimate with a quarter for bucket rounding, and 1 GiB).
TEST(MemoryPlanTest, ReservesNoMoreThanTheCachesCanSchedule) {
  FakeDeviceBackend backend(60 * kGiB, 140 * kGiB);
  MemoryPlanOptions options;
  options.max_num_seqs = 1;
  options.max_model_len = 1024;
  options.max_tokens_per_step = 8192;
  auto plan = PlanDeviceMemory(ReleaseConfig(), backend, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t live = EstimateStepActivationBytes(ReleaseConfig(), 1024, 1, 2);
  EXPECT_EQ(plan->activation_reserve, 2 * (live + live / 4 + (int64_t{1} << 20)) + kGiB);
}

TEST(MemoryPlanTest, TightMemoryGivesFewerBlocksWithinTheUtilization) {
  // 140 GiB device, 80 GiB used by the weights: 0.9 x 140 - 80 = 46 GiB may still be taken.
  FakeDeviceBackend backend(60 * kGiB, 140 * kGiB);
  MemoryPlanOptions options;
  options.max_num_seqs = 256;
  options.max_model_len = 32768;  // wants 256 x 2048 blocks = 343 GB
  auto plan = PlanDeviceMemory(ReleaseConfig(), backend, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t allowed = static_cast<int64_t>(0.9 * 140 * kGiB) - 80 * kGiB;
  const int64_t expected =
      (allowed - plan->activation_reserve - 256 * plan->state_slot_bytes) / plan->kv_block_bytes;
  EXPECT_EQ(plan->num_kv_blocks, expected);
  EXPECT_LT(plan->num_kv_blocks, plan->max_useful_blocks);
  // The reserve is the budget's step, 256 logits rows: twice its estimate with a quarter for
  // bucket rounding and 1 MiB, and 1 GiB for workspaces.
  const int64_t live =
      EstimateStepActivationBytes(ReleaseConfig(), options.max_tokens_per_step, 256, 2);
  EXPECT_EQ(plan->activation_reserve, 2 * (live + live / 4 + (int64_t{1} << 20)) + kGiB);
}

// A verify step carries every sequence's drafts beside the token budget, a logits row per
// draft, and keeps every DeltaNet layer's inputs until the next step: the reserve grows by
// exactly that, and the KV cache shrinks by it.
TEST(MemoryPlanTest, SpeculativeDecodingReservesItsVerifyStep) {
  FakeDeviceBackend backend(60 * kGiB, 140 * kGiB);
  const ModelConfig config = ReleaseConfig();
  MemoryPlanOptions options;
  options.max_num_seqs = 64;
  options.max_model_len = 32768;
  auto plain = PlanDeviceMemory(config, backend, options);
  options.spec_tokens = 4;
  auto speculative = PlanDeviceMemory(config, backend, options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(speculative.ok()) << speculative.status();
  // The budget + 64 x 4 tokens, 64 x 5 logits rows.
  const int budget = options.max_tokens_per_step;
  const int64_t verify = EstimateStepActivationBytes(config, budget + 256, 320, 2);
  // 30 DeltaNet layers x (8192 bf16 conv channels + fp32 decay and beta of 32 heads) a token.
  const int64_t kept = int64_t{budget + 256} * 30 * (8192 * 2 + 2 * 4 * 32);
  EXPECT_EQ(EstimateKeptStateInputBytes(config, budget + 256, 2), kept);
  // Each step's live bytes plus a quarter (bucket rounding) and 1 MiB, twice, and 1 GiB.
  auto reserve = [](int64_t live) { return 2 * (live + live / 4 + (int64_t{1} << 20)) + kGiB; };
  EXPECT_EQ(speculative->activation_reserve, reserve(verify + kept));
  EXPECT_EQ(plain->activation_reserve, reserve(EstimateStepActivationBytes(config, budget, 64, 2)));
  EXPECT_LT(speculative->num_kv_blocks, plain->num_kv_blocks);
  // An absurd draft count is refused by name instead of overflowing the token count.
  options.spec_tokens = 1 << 30;
  const absl::Status huge = PlanDeviceMemory(config, backend, options).status();
  EXPECT_EQ(huge.code(), absl::StatusCode::kInvalidArgument) << huge;
  EXPECT_NE(huge.message().find("spec_tokens"), std::string::npos) << huge;
}

TEST(MemoryPlanTest, NotEvenOneSequenceIsAClearError) {
  FakeDeviceBackend backend(2 * kGiB, 140 * kGiB);
  MemoryPlanOptions options;
  auto plan = PlanDeviceMemory(ReleaseConfig(), backend, options);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find("max_model_len 8192"), std::string::npos) << plan.status();
}

TEST(MemoryPlanTest, BadUtilizationAndCpuBackend) {
  FakeDeviceBackend backend(70 * kGiB, 140 * kGiB);
  MemoryPlanOptions options;
  options.memory_utilization = 1.5;
  EXPECT_EQ(PlanDeviceMemory(ReleaseConfig(), backend, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto cpu = kernels::CreateCpuBackend(1);
  EXPECT_EQ(PlanDeviceMemory(ReleaseConfig(), *cpu, MemoryPlanOptions{}).status().code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace mobius::worker
