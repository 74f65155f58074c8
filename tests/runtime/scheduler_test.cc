// The scheduler's admission and chunking: the token budget, and the separate cap on the logits
// rows of prompts being scored (prompt_logprobs).
#include "worker/runtime/scheduler.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace mobius::worker {
namespace {

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = kernels::CreateCpuBackend(1);
    auto kv = PagedKvCache::Create(
        {.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = 4, .num_blocks = 64},
        *backend_);
    ASSERT_TRUE(kv.ok()) << kv.status();
    kv_ = *std::move(kv);
    auto slots = StateSlotPool::Create({.num_layers = 1,
                                        .conv_dim = 4,
                                        .conv_kernel = 2,
                                        .num_v_heads = 1,
                                        .k_head_dim = 2,
                                        .v_head_dim = 2,
                                        .num_slots = 8},
                                       *backend_);
    ASSERT_TRUE(slots.ok()) << slots.status();
    slots_ = *std::move(slots);
  }

  std::unique_ptr<Sequence> Make(const std::string& id, int prompt_tokens, bool scored) {
    auto seq = std::make_unique<Sequence>();
    seq->request_id = id;
    seq->prompt.assign(prompt_tokens, 1);
    if (scored) seq->params.prompt_logprobs = 0;
    return seq;
  }

  // The plan's (id, begin, count) per chunk; each chunk's tokens count as computed.
  static std::vector<std::tuple<std::string, int, int>> Run(StepPlan plan) {
    std::vector<std::tuple<std::string, int, int>> out;
    for (const ScheduledChunk& c : plan.chunks) {
      out.emplace_back(c.sequence->request_id, c.begin, c.count);
      c.sequence->num_computed += c.count;
    }
    return out;
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<PagedKvCache> kv_;
  std::unique_ptr<StateSlotPool> slots_;
};

using Chunks = std::vector<std::tuple<std::string, int, int>>;

// Scored prompts prefill at most 16 rows a step between them; a scored sequence that finds no
// rows left waits in its place while an unscored one behind it is admitted.
TEST_F(SchedulerTest, ScoredRowsAreCappedAndDoNotHoldBackOthers) {
  Scheduler scheduler(
      {.max_num_seqs = 8, .max_tokens_per_step = 100, .max_prompt_score_rows_per_step = 16}, *kv_,
      *slots_);
  scheduler.Add(Make("a", 20, true));
  scheduler.Add(Make("b", 10, true));
  scheduler.Add(Make("c", 10, false));
  EXPECT_EQ(Run(scheduler.Schedule()), (Chunks{{"a", 0, 16}, {"c", 0, 10}}));
  EXPECT_EQ(scheduler.num_waiting(), 1);
  // a's last 4 rows, then b gets the 12 left (all 10 of its tokens); c has nothing to compute.
  EXPECT_EQ(Run(scheduler.Schedule()), (Chunks{{"a", 16, 4}, {"b", 0, 10}}));
  EXPECT_EQ(scheduler.num_waiting(), 0);
}

}  // namespace
}  // namespace mobius::worker
