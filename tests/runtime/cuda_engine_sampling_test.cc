// The engine's sampled requests on the CUDA backend: drawn on the device (Backend::SampleRows)
// they take the tokens the host draws from the same logits and random streams. Seeded requests
// of several sampling rules (and greedy ones) decode one sequence a step, so that both runs see
// the same batches (bf16 kernels are not batch-invariant; engine_test covers mixed batches on
// the CPU); the two runs differ only in EngineOptions::sampling_place. Skipped without a GPU.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/model/fixture_util.h"
#include "worker/runtime/engine.h"

namespace mobius::worker {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

TEST(CudaEngineSamplingTest, DeviceDrawsMatchHostDraws) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto backend = kernels::CreateCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ASSERT_TRUE((*backend)->SamplesOnDevice());
  const std::string dir = testing::FixtureModelDir("intern-s2-mobius-tiny");
  std::unique_ptr<HybridModel> model = testing::LoadFixtureModel(dir, **backend);
  ASSERT_NE(model, nullptr);
  const std::vector<std::vector<int32_t>> prompts = testing::LoadReference(dir).prompts;
  ASSERT_FALSE(prompts.empty());

  auto run = [&](bool device_sampling, std::vector<std::vector<int32_t>>& outputs) {
    EngineOptions options;
    options.scheduler.max_num_seqs = 1;  // one sequence a step: the same batches in both runs
    options.scheduler.max_tokens_per_step = 16;
    options.max_model_len = 256;
    options.sampling_place =
        device_sampling ? EngineOptions::SamplingPlace::kAuto : EngineOptions::SamplingPlace::kHost;
    auto engine = Engine::Create(*model, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const size_t n = 2 * prompts.size();
    outputs.assign(n, {});
    std::vector<absl::Notification> done(n);
    for (size_t i = 0; i < n; ++i) {
      GenerationRequest r;
      r.request_id = "r" + std::to_string(i);
      r.prompt = prompts[i % prompts.size()];
      r.params.max_tokens = 24;
      r.params.ignore_eos = true;
      r.params.seed = 1000 + i;
      switch (i % 5) {
        case 0:
          r.params.temperature = 1.0f;
          break;
        case 1:
          r.params.temperature = 0.7f;
          r.params.top_p = 0.9f;
          break;
        case 2:
          r.params.top_k = 20;
          r.params.min_p = 0.02f;
          r.params.logprobs = 0;
          break;
        case 3:
          r.params.temperature = 0;  // greedy beside sampled rows
          break;
        default:
          // Drawn on the host from its row alone (penalties, top-n logprobs).
          r.params.temperature = 0.9f;
          r.params.presence_penalty = 0.5f;
          r.params.logprobs = 2;
          break;
      }
      ASSERT_TRUE((*engine)
                      ->Enqueue(r,
                                [&outputs, &done, i](const GenerationOutput& out) {
                                  outputs[i].insert(outputs[i].end(), out.tokens.begin(),
                                                    out.tokens.end());
                                  if (out.finish != FinishReason::kNone) done[i].Notify();
                                })
                      .ok());
    }
    for (auto& d : done) ASSERT_TRUE(d.WaitForNotificationWithTimeout(absl::Seconds(60)));
  };
  std::vector<std::vector<int32_t>> on_device, on_host;
  run(true, on_device);
  model->DropCaches();
  run(false, on_host);
  ASSERT_EQ(on_device.size(), on_host.size());
  for (size_t i = 0; i < on_device.size(); ++i) {
    EXPECT_EQ(on_device[i].size(), 24u) << "request " << i;
    EXPECT_EQ(on_device[i], on_host[i]) << "request " << i;
  }
}

}  // namespace
}  // namespace mobius::worker
