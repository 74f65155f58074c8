// Access to the reference fixtures (../shared/fixtures): prompts, greedy continuations and
// reference logits produced by Hugging Face transformers / the model authors' code.
#ifndef MOBIUS_TESTS_MODEL_FIXTURE_UTIL_H_
#define MOBIUS_TESTS_MODEL_FIXTURE_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/model/hybrid_model.h"

namespace mobius::testing {

std::string FixturesDir();

// The reference models, for parameterised tests, and a test-name printer for them.
inline const std::vector<std::string> kFixtureModels = {"qwen3next-tiny", "intern-s2-mobius-tiny"};
std::string FixtureParamName(const ::testing::TestParamInfo<std::string>& info);
std::string FixtureModelDir(const std::string& name);

struct ModelReference {
  std::vector<std::vector<int32_t>> prompts;
  // greedy[i] = (prompt index, 24 tokens)
  std::vector<std::pair<int, std::vector<int32_t>>> greedy;
  std::vector<std::vector<float>> logits;  // logits[i]: [len(prompts[i]), vocab]
};

// Reads reference.json and reference_logits.safetensors of a fixture model; fails the calling
// test (ADD_FAILURE) and returns empty on error.
ModelReference LoadReference(const std::string& model_dir);

// max|a - b| / max|b|; infinite when either side holds a NaN or an infinity.
double RelativeError(const float* a, const float* b, size_t n);

std::unique_ptr<worker::HybridModel> LoadFixtureModel(const std::string& model_dir,
                                                      kernels::Backend& backend);

// The target's post-norm hidden state at every position of `prompt` ([len, hidden], as the MTP
// head observes them), from one forward in a sequence of its own that is released again. Fails
// the calling test (ADD_FAILURE) and returns empty on error.
std::vector<float> PromptHiddenStates(worker::HybridModel& model,
                                      const std::vector<int32_t>& prompt);

}  // namespace mobius::testing

#endif  // MOBIUS_TESTS_MODEL_FIXTURE_UTIL_H_
