// Dummy weights (worker/model/dummy_weights.cc) against their definition, written out here
// independently: element f of parameter p (its index in ListParameters' list) is drawn from the
// splitmix64 stream seeded with seed ^ 0x100000001b3 (p + 1) ^ (c << 1), c = the first element of
// f's chunk of 2^20, at f's place in that chunk; u = the draw's top 24 bits / 2^24, and a
// projection or embedding value is (2u - 1) 0.02 sqrt(3), rounded to bf16. The loader generates
// the chunks on worker threads into a ring of host buffers and uploads them in order, so every
// element in its place also checks that no chunk lands in another's place.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/dtype.h"
#include "nlohmann/json.hpp"
#include "tests/model/fixture_util.h"
#include "worker/model/model_config.h"
#include "worker/model/parameter_layout.h"
#include "worker/model/weight_loader.h"

namespace mobius {
namespace {

float DefinedValue(uint64_t seed, size_t p, int64_t f) {
  constexpr int64_t kChunk = int64_t{1} << 20;
  constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;
  const int64_t c = f / kChunk * kChunk;
  uint64_t state = seed ^ (0x100000001b3ull * (p + 1)) ^ (static_cast<uint64_t>(c) << 1);
  state += static_cast<uint64_t>(f - c) * kGamma;  // the draws before f in its chunk
  uint64_t z = state + kGamma;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
  return kernels::BF16ToFloat(kernels::FloatToBF16((2 * u - 1) * (0.02f * std::sqrt(3.0f))));
}

// The qwen3next-tiny fixture's config with a vocabulary of 20000: its embedding and lm_head
// (20000 x 128) span three chunks each.
std::string WriteWideVocabularyConfig() {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "dummy_weights_wide_vocabulary";
  std::filesystem::create_directories(dir);
  std::ifstream in(std::filesystem::path(testing::FixtureModelDir("qwen3next-tiny")) /
                   "config.json");
  EXPECT_TRUE(in) << "cannot read the qwen3next-tiny fixture's config.json";
  nlohmann::json config = nlohmann::json::parse(in);
  config["vocab_size"] = 20000;
  const std::filesystem::path file = dir / "config.json";
  std::ofstream(file) << config.dump();
  return file.string();
}

TEST(DummyWeightsTest, EveryElementIsItsDefinedValue) {
  absl::StatusOr<worker::ModelConfig> config = worker::LoadModelConfig(WriteWideVocabularyConfig());
  ASSERT_TRUE(config.ok()) << config.status();
  auto backend = kernels::CreateCpuBackend(1);
  constexpr uint64_t kSeed = 5;
  auto weights = worker::CreateDummyWeights(*config, *backend, kSeed, /*include_mtp=*/false);
  ASSERT_TRUE(weights.ok()) << weights.status();
  worker::LayoutOptions options;
  options.prefix = worker::DefaultTensorPrefix(*config);
  const std::vector<worker::ParameterSpec> specs =
      worker::ListParameters(*config, options, nullptr);
  struct Checked {
    std::string name;
    const kernels::Tensor* tensor;
  };
  const Checked checked[] = {
      {"embed", &weights->embed},
      {"lm_head", &weights->lm_head},
      {"layers.0.linear.in_proj_qkv", &weights->layers[0].linear->in_proj_qkv},
      {"banks.1.gate_up", &weights->banks[1].gate_up}};
  for (const Checked& c : checked) {
    size_t p = 0;
    while (p < specs.size() && specs[p].name != c.name) ++p;
    ASSERT_LT(p, specs.size()) << c.name << " is not a parameter";
    ASSERT_EQ(c.tensor->numel(), specs[p].numel()) << c.name;
    std::vector<float> host(static_cast<size_t>(c.tensor->numel()));
    backend->CopyToHostF32(*c.tensor, host.data());
    int64_t wrong = 0, first_wrong = -1;
    for (int64_t f = 0; f < c.tensor->numel(); ++f) {
      if (host[f] != DefinedValue(kSeed, p, f) && wrong++ == 0) first_wrong = f;
    }
    EXPECT_EQ(wrong, 0) << c.name << " (" << c.tensor->numel() << " elements), first at "
                        << first_wrong;
  }
  EXPECT_GT(weights->embed.numel(), int64_t{2} << 20);  // three chunks, as meant
}

}  // namespace
}  // namespace mobius
