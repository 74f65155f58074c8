#include "tests/model/fixture_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/model_factory.h"

namespace mobius::testing {

// The environment variable lets a test binary built here run on another machine (the GPU host).
std::string FixturesDir() {
  const char* env = std::getenv("MOBIUS_FIXTURES_DIR");
  return env != nullptr && *env != '\0' ? env : MOBIUS_FIXTURES_DIR;
}
std::string FixtureParamName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

std::string FixtureModelDir(const std::string& name) { return FixturesDir() + "/" + name; }

ModelReference LoadReference(const std::string& model_dir) {
  ModelReference ref;
  std::ifstream in(model_dir + "/reference.json");
  if (!in) {
    ADD_FAILURE() << "missing fixture " << model_dir << "/reference.json (set MOBIUS_FIXTURES_DIR)";
    return ref;
  }
  nlohmann::json j = nlohmann::json::parse(in);
  for (const auto& p : j["prompts"]) ref.prompts.push_back(p.get<std::vector<int32_t>>());
  for (const auto& g : j["greedy"]) {
    ref.greedy.emplace_back(g["prompt_index"].get<int>(), g["tokens"].get<std::vector<int32_t>>());
  }
  auto file = worker::SafetensorsFile::Open(model_dir + "/reference_logits.safetensors");
  if (!file.ok()) {
    ADD_FAILURE() << file.status();
    return ref;
  }
  for (size_t i = 0; i < ref.prompts.size(); ++i) {
    auto it = (*file)->tensors().find("logits_" + std::to_string(i));
    if (it == (*file)->tensors().end()) {
      ADD_FAILURE() << "reference logits_" << i << " missing";
      return ref;
    }
    std::vector<float> v(it->second.num_elements());
    worker::ConvertToFloat(it->second, v.data());
    ref.logits.push_back(std::move(v));
  }
  return ref;
}

double RelativeError(const float* a, const float* b, size_t n) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < n; ++i) {
    // std::max drops a NaN difference: a non-finite value on either side is an infinite error.
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return HUGE_VAL;
    max_diff = std::max(max_diff, std::fabs(double(a[i]) - double(b[i])));
    max_ref = std::max(max_ref, std::fabs(double(b[i])));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

std::unique_ptr<worker::HybridModel> LoadFixtureModel(const std::string& model_dir,
                                                      kernels::Backend& backend) {
  worker::ModelSource source;
  source.model_dir = model_dir;
  auto model = worker::LoadHybridModel(source, backend);
  if (!model.ok()) {
    ADD_FAILURE() << model.status();
    return nullptr;
  }
  return *std::move(model);
}

std::vector<float> PromptHiddenStates(worker::HybridModel& model,
                                      const std::vector<int32_t>& prompt) {
  worker::SequenceCache cache;
  if (absl::Status started = model.StartSequence(cache); !started.ok()) {
    ADD_FAILURE() << started;
    return {};
  }
  std::vector<worker::SequenceStep> batch = {{prompt, &cache}};
  std::vector<float> logits, hidden;
  worker::ForwardOptions options;
  options.hidden_out = &hidden;
  options.hidden_all_tokens = true;
  const absl::Status forward = model.Forward(batch, options, logits);
  model.ReleaseSequence(cache);
  if (!forward.ok()) {
    ADD_FAILURE() << forward;
    return {};
  }
  return hidden;
}

}  // namespace mobius::testing
