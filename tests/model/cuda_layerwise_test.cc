// Where the bf16 CUDA model departs from the fp32 CPU model: the fixture truncated to its first
// N layers, both backends, the same prompt; prints the logits error per N and per position range
// and asserts that one layer agrees on the first tokens. Skipped without a GPU.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/model/fixture_util.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/weight_loader.h"

namespace mobius::testing {
namespace {

std::vector<float> RunPrompt(worker::HybridModel& model, const std::vector<int32_t>& prompt) {
  EXPECT_TRUE(model.CreateCaches(1, 256).ok());
  worker::SequenceCache seq;
  EXPECT_TRUE(model.StartSequence(seq).ok());
  worker::ForwardOptions options;
  options.logits = worker::LogitsMode::kAllTokens;
  std::vector<float> logits;
  worker::SequenceStep step{prompt, &seq};
  EXPECT_TRUE(model.Forward(std::span(&step, 1), options, logits).ok());
  return logits;
}

TEST(CudaLayerwiseTest, ErrorPerDepth) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  for (const char* name : {"qwen3next-tiny", "intern-s2-mobius-tiny"}) {
    const std::string dir = FixtureModelDir(name);
    auto full = worker::LoadModelConfig(dir);
    ASSERT_TRUE(full.ok());
    auto checkpoint = worker::Checkpoint::Open(dir);
    ASSERT_TRUE(checkpoint.ok());
    ModelReference ref = LoadReference(dir);
    const auto& prompt = ref.prompts[3];
    auto cpu = kernels::CreateCpuBackend(4);
    auto cuda = kernels::CreateCudaBackend(0);
    ASSERT_TRUE(cuda.ok());
    for (int layers = 0; layers <= full->num_hidden_layers; ++layers) {
      worker::ModelConfig c = *full;
      c.num_hidden_layers = std::max(layers, 1);
      c.layer_types.resize(c.num_hidden_layers);
      c.mlp_types.resize(c.num_hidden_layers);
      if (c.family == worker::ModelFamily::kQwen3Next) c.num_blocks = c.num_hidden_layers;
      auto wa = worker::LoadCheckpointWeights(c, **checkpoint, *cpu);
      auto wb = worker::LoadCheckpointWeights(c, **checkpoint, **cuda);
      ASSERT_TRUE(wa.ok() && wb.ok());
      worker::HybridModel a(c, *std::move(wa), *cpu), b(c, *std::move(wb), **cuda);
      std::vector<float> la = RunPrompt(a, prompt), lb = RunPrompt(b, prompt);
      const int V = c.vocab_size;
      auto err = [&](int t0, int t1) {
        return RelativeError(lb.data() + t0 * V, la.data() + t0 * V, size_t(t1 - t0) * V);
      };
      std::printf(
          "[layerwise] %s layers=%d types=%s: all %.2e | t<8 %.2e | t 60-70 %.2e | "
          "t>120 %.2e\n",
          name, c.num_hidden_layers,
          c.layer_types.back() == worker::LayerType::kFullAttention ? "..A" : "..D",
          err(0, prompt.size()), err(0, 8), err(60, 70), err(120, prompt.size()));
      // One layer in bf16 stays close to fp32 on the first tokens (measured on an H200:
      // 7.5e-3 and 1.4e-2); the error that grows later comes from routing flips.
      if (layers == 1) {
        EXPECT_LT(err(0, 8), 5e-2) << name;
      }
      if (layers <= 1) {
        std::string bad;
        for (size_t t = 0; t < prompt.size(); ++t) {
          if (err(t, t + 1) > 3e-2) bad += " " + std::to_string(t);
        }
        std::printf("[layerwise]   positions with error > 3e-2:%s\n", bad.c_str());
      }
    }
  }
}

}  // namespace
}  // namespace mobius::testing
