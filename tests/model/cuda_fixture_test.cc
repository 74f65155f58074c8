// The CUDA backend (bf16) against the fp32 reference fixtures. Skipped without a GPU.
//
// The yardstick is Hugging Face's own bf16 forward of the same checkpoint
// (tests/reference/hf_bf16_baseline.py, H200, 2026-11-30, qwen3next-tiny): relative error 4.4e-2
// for the 1-token prompt and 0.24 / 0.36 / 0.40 for the 7 / 33 / 130-token prompts, with argmax
// agreement 0.57-0.85 over all positions. These random tiny models amplify bf16 rounding (a
// near-tied top-k routing choice flips and the change spreads through later tokens), so the
// fixture README's "about 2e-2" holds only for a single token. We require: the 1-token prompt
// within 5e-2, every prompt within 0.5, and the reference's argmax at >= 85% of the positions
// where its top-2 gap exceeds 2e-2 of the largest logit.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "nlohmann/json.hpp"
#include "tests/model/fixture_util.h"
#include "worker/model/memory_plan.h"
#include "worker/model/model_factory.h"

namespace mobius::testing {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

class CudaFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaFixtureTest, PromptLogitsMatchReferenceInBf16) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto backend = kernels::CreateCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::string dir = FixtureModelDir(GetParam());
  auto model = LoadFixtureModel(dir, **backend);
  ASSERT_NE(model, nullptr);
  ModelReference ref = LoadReference(dir);
  ASSERT_TRUE(model->CreateCaches(4, 256).ok());
  const int vocab = model->config().vocab_size;
  for (size_t p = 0; p < ref.prompts.size(); ++p) {
    for (size_t chunk : {ref.prompts[p].size(), size_t{5}}) {
      worker::SequenceCache seq;
      ASSERT_TRUE(model->StartSequence(seq).ok());
      worker::ForwardOptions options;
      options.logits = worker::LogitsMode::kAllTokens;
      std::vector<float> all, logits;
      const auto& prompt = ref.prompts[p];
      for (size_t b = 0; b < prompt.size(); b += chunk) {
        worker::SequenceStep step{std::span(prompt).subspan(b, std::min(chunk, prompt.size() - b)),
                                  &seq};
        ASSERT_TRUE(model->Forward(std::span(&step, 1), options, logits).ok());
        all.insert(all.end(), logits.begin(), logits.end());
      }
      model->ReleaseSequence(seq);
      ASSERT_EQ(all.size(), ref.logits[p].size());
      const double err = RelativeError(all.data(), ref.logits[p].data(), all.size());
      EXPECT_LT(err, prompt.size() == 1 ? 5e-2 : 0.5) << "prompt " << p << " chunk " << chunk;
      // Argmax agreement where the reference is decisive.
      double max_ref = 0;
      for (float x : ref.logits[p]) max_ref = std::max(max_ref, double(std::fabs(x)));
      int checked = 0, agreed = 0;
      for (size_t t = 0; t < prompt.size(); ++t) {
        const float* r = ref.logits[p].data() + t * vocab;
        const float* a = all.data() + t * vocab;
        std::vector<float> sorted(r, r + vocab);
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
        if (sorted[0] - sorted[1] <= 2e-2 * max_ref) continue;
        ++checked;
        agreed += (std::max_element(a, a + vocab) - a) == (std::max_element(r, r + vocab) - r);
      }
      EXPECT_GE(agreed, 0.85 * checked) << "prompt " << p << " chunk " << chunk;
      std::printf("[cuda] %s prompt %zu chunk %zu: rel err %.2e, argmax %d/%d decisive\n",
                  GetParam().c_str(), p, chunk, err, agreed, checked);
    }
  }
}

// Greedy decoding of the reference prompts as one batch, `steps` decode steps after a ragged
// prefill; sequences leave the batch one by one near the end, so several batch sizes run.
// Returns every decode step's logits, concatenated.
std::vector<float> DecodeBatch(worker::HybridModel& model, const ModelReference& ref, int steps) {
  const size_t n = ref.prompts.size();
  std::vector<worker::SequenceCache> seqs(n);
  std::vector<std::vector<int32_t>> tokens(n);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_TRUE(model.StartSequence(seqs[i]).ok());
    tokens[i] = ref.prompts[i];
  }
  const int vocab = model.config().vocab_size;
  std::vector<float> logits, out;
  std::vector<int32_t> next(n);
  auto argmax = [&](int row) {
    const float* r = logits.data() + static_cast<size_t>(row) * vocab;
    return static_cast<int32_t>(std::max_element(r, r + vocab) - r);
  };
  {
    std::vector<worker::SequenceStep> prefill;
    for (size_t i = 0; i < n; ++i) prefill.push_back({tokens[i], &seqs[i]});
    EXPECT_TRUE(model.Forward(prefill, {}, logits).ok());
    for (size_t i = 0; i < n; ++i) next[i] = argmax(static_cast<int>(i));
  }
  for (int s = 0; s < steps; ++s) {
    // The last sequences drop out over the final steps: batch sizes n, n-1, ... 1.
    const size_t active = std::max<size_t>(1, std::min<size_t>(n, steps - s));
    std::vector<worker::SequenceStep> step;
    for (size_t i = 0; i < active; ++i) step.push_back({std::span(&next[i], 1), &seqs[i]});
    EXPECT_TRUE(model.Forward(step, {}, logits).ok());
    // Finite: an op that reads an unwritten (poisoned, NaN) temporary shows here.
    EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }))
        << "decode step " << s;
    out.insert(out.end(), logits.begin(), logits.end());
    for (size_t i = 0; i < active; ++i) next[i] = argmax(static_cast<int>(i));
  }
  for (auto& seq : seqs) model.ReleaseSequence(seq);
  return out;
}

// Recorded decode steps (CUDA graphs) compute what the op-by-op steps compute, while block
// tables, positions and the batch size change between replays.
TEST_P(CudaFixtureTest, RecordedDecodeStepsMatchOpByOpSteps) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto backend = kernels::CreateCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::string dir = FixtureModelDir(GetParam());
  auto model = LoadFixtureModel(dir, **backend);
  ASSERT_NE(model, nullptr);
  ModelReference ref = LoadReference(dir);
  // Block size 4: a sequence needs a new block every 4 steps.
  ASSERT_TRUE(model->CreateCaches(8, 256, /*block_size=*/4).ok());
  constexpr int kSteps = 24;
  model->SetDecodeCapture(0);
  const std::vector<float> eager = DecodeBatch(*model, ref, kSteps);
  model->SetDecodeCapture(8);
  const std::vector<float> recorded = DecodeBatch(*model, ref, kSteps);
  ASSERT_TRUE(model->capture_error().ok()) << model->capture_error();
  EXPECT_GE(model->num_decode_graphs(), 3);  // batch sizes 4 (or 3), ..., 1
  ASSERT_EQ(eager.size(), recorded.size());
  // Attention splits its work for the longest context a recording may replay, so sums are
  // ordered differently: equal up to float rounding, not bit for bit.
  EXPECT_LT(RelativeError(recorded.data(), eager.data(), eager.size()), 1e-3);
  // Dropping the caches drops the recordings (they point into the caches).
  model->DropCaches();
  EXPECT_EQ(model->num_decode_graphs(), 0);
  ASSERT_TRUE(model->CreateCaches(8, 256, 4).ok());
  const std::vector<float> again = DecodeBatch(*model, ref, kSteps);
  EXPECT_LT(RelativeError(again.data(), eager.data(), eager.size()), 1e-3);
}

// A config whose shapes the CUDA kernels do not take fails at load with the field named, before
// any weight is read, instead of aborting in the first step.
TEST(CudaModelLoad, UnsupportedShapesFailBeforeLoading) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto backend = kernels::CreateCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "cuda_unsupported_shapes";
  std::filesystem::create_directories(dir);
  std::ifstream in(std::filesystem::path(FixtureModelDir("qwen3next-tiny")) / "config.json");
  ASSERT_TRUE(in) << "cannot read the qwen3next-tiny fixture's config.json";
  const nlohmann::json base = nlohmann::json::parse(in);
  struct Case {
    const char* field;
    int value;
  };
  for (const Case c : {Case{"head_dim", 512}, Case{"linear_key_head_dim", 320},
                       Case{"linear_conv_kernel_dim", 32}}) {
    nlohmann::json config = base;
    config[c.field] = c.value;
    const std::filesystem::path file = dir / (std::string(c.field) + ".json");
    std::ofstream(file) << config.dump();
    worker::ModelSource source;
    source.config_path = file.string();
    source.load_format = worker::LoadFormat::kDummy;
    const absl::Status s = worker::LoadHybridModel(source, **backend).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(absl::StrCat(c.field, " = ", c.value)), std::string_view::npos) << s;
  }
  std::filesystem::remove_all(dir);
}

// The qwen3next-tiny fixture's config with its eight layers twice (16 layers), written under the
// test's temporary directory: deep enough that every layer's temporaries added up are far more
// than one layer's live set.
std::filesystem::path WriteSixteenLayerConfig() {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "cuda_sixteen_layers";
  std::filesystem::create_directories(dir);
  std::ifstream in(std::filesystem::path(FixtureModelDir("qwen3next-tiny")) / "config.json");
  EXPECT_TRUE(in) << "cannot read the qwen3next-tiny fixture's config.json";
  nlohmann::json config = nlohmann::json::parse(in);
  nlohmann::json layers = config["layer_types"];
  for (const auto& type : config["layer_types"]) layers.push_back(type);
  config["layer_types"] = layers;
  config["num_hidden_layers"] = layers.size();
  const std::filesystem::path file = dir / "config.json";
  std::ofstream(file) << config.dump();
  return file;
}

std::unique_ptr<worker::HybridModel> LoadDummyModel(const std::filesystem::path& config,
                                                    kernels::Backend& backend) {
  worker::ModelSource source;
  source.config_path = config.string();
  source.load_format = worker::LoadFormat::kDummy;
  auto model = worker::LoadHybridModel(source, backend);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

// Steps of `sequences` sequences with `tokens` tokens each, the shapes a model records: decode
// (one token) or a speculative verify step (every token's logits, DeltaNet inputs kept).
class UniformSteps {
 public:
  UniformSteps(worker::HybridModel& model, int sequences, int tokens)
      : model_(model), seqs_(sequences), tokens_(static_cast<size_t>(sequences) * tokens) {
    for (size_t i = 0; i < tokens_.size(); ++i) tokens_[i] = static_cast<int32_t>(i * 37 % 2048);
    for (int i = 0; i < sequences; ++i) {
      EXPECT_TRUE(model.StartSequence(seqs_[i]).ok());
      steps_.push_back(
          {std::span(tokens_).subspan(static_cast<size_t>(i) * tokens, tokens), &seqs_[i]});
    }
    if (tokens > 1) {
      options_.logits = worker::LogitsMode::kAllTokens;
      options_.keep_state_inputs = true;
    }
  }
  ~UniformSteps() {
    for (auto& seq : seqs_) model_.ReleaseSequence(seq);
  }
  // One step; its logits are finite (a block handed out again while still needed would show as
  // NaN under MOBIUS_UNINITIALIZED_FILL=poison).
  void Step() {
    std::vector<float> logits;
    ASSERT_TRUE(model_.Forward(steps_, options_, logits).ok());
    EXPECT_TRUE(
        std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
  }

 private:
  worker::HybridModel& model_;
  std::vector<worker::SequenceCache> seqs_;
  std::vector<int32_t> tokens_;
  std::vector<worker::SequenceStep> steps_;
  worker::ForwardOptions options_;
};

// A recorded step's intermediates come from the capture pool, which hands a released block to
// the same recording's later allocations: a recording then needs about one step's live set (the
// memory plan reserves EstimateStepBytes for it), not every layer's temporaries added up. The
// first step of a shape runs op by op and records it on the way; the pool's high-water mark is
// that recording's. (With MOBIUS_CAPTURE_POOL_REUSE=0 the recordings took 5.95 and 7.43 MB
// against estimates of 2.0 and 2.9 MB: this test fails.)
TEST(CudaRecordedStepMemory, ARecordingNeedsOneStepNotEveryLayersTemporaries) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const std::filesystem::path config = WriteSixteenLayerConfig();
  struct Case {
    const char* name;
    int sequences, tokens;
  };
  for (const Case c : {Case{"decode", 64, 1}, Case{"verify", 16, 5}}) {
    SCOPED_TRACE(c.name);
    auto backend = kernels::CreateCudaBackend(0);
    ASSERT_TRUE(backend.ok()) << backend.status();
    auto model = LoadDummyModel(config, **backend);
    ASSERT_NE(model, nullptr);
    ASSERT_EQ(model->config().num_hidden_layers, 16);
    ASSERT_TRUE(model->CreateCaches(c.sequences, 64).ok());
    model->SetDecodeCapture(c.sequences);
    UniformSteps steps(*model, c.sequences, c.tokens);
    steps.Step();
    ASSERT_TRUE(model->capture_error().ok()) << model->capture_error();
    ASSERT_EQ(model->num_decode_graphs(), 1);
    auto info = (*backend)->MemoryInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    const int t = c.sequences * c.tokens;
    const int64_t estimate = worker::EstimateStepBytes(model->config(), t, t, c.tokens > 1,
                                                       /*activation_bytes=*/2);
    std::printf("[cuda] %s recording: %lld bytes used, estimate %lld (pool holds %lld)\n", c.name,
                static_cast<long long>(info->recorded_step_peak_bytes),
                static_cast<long long>(estimate),
                static_cast<long long>(info->recorded_step_bytes));
    EXPECT_GT(info->recorded_step_peak_bytes, 0);
    EXPECT_LE(info->recorded_step_peak_bytes, estimate);
    steps.Step();  // replayed
  }
}

// A recording that runs out of device memory (simulated by MOBIUS_CAPTURE_POOL_LIMIT_KIB) fails
// only its own shape: that shape runs op by op from then on, and the decode step keeps replaying
// its recording. The decode recording below takes ~0.95 MB; the verify one (130 x 8 tokens, 4160
// routed pairs: the MoE's grouped path, whose scratch is its largest block, ~2.5 MB) has carved
// 3.6 MB when it asks for that scratch, which would pass the 4.7 MB limit: the MoE op must skip
// its launches (a memset of its counts among them) instead of failing on the missing scratch,
// and the recording's error is that first failure, not a later tensor's.
TEST(CudaRecordedStepMemory, AShapeWhoseRecordingRunsOutOfMemoryRunsOpByOp) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const std::filesystem::path config = WriteSixteenLayerConfig();
  setenv("MOBIUS_CAPTURE_POOL_LIMIT_KIB", "4800", 1);
  auto backend = kernels::CreateCudaBackend(0);  // its capture pool reads the limit
  unsetenv("MOBIUS_CAPTURE_POOL_LIMIT_KIB");
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto model = LoadDummyModel(config, **backend);
  ASSERT_NE(model, nullptr);
  ASSERT_TRUE(model->CreateCaches(194, 64).ok());
  model->SetDecodeCapture(130);
  UniformSteps decode(*model, 64, 1), verify(*model, 130, 8);
  decode.Step();
  ASSERT_TRUE(model->capture_error().ok()) << model->capture_error();
  EXPECT_TRUE(model->HasRecording(64, 1));
  verify.Step();  // op by op, then a recording that fails (twice: after the cache is returned)
  std::printf("[cuda] the verify recording: %s\n", model->capture_error().ToString().c_str());
  EXPECT_EQ(model->capture_error().code(), absl::StatusCode::kResourceExhausted)
      << model->capture_error();
  EXPECT_NE(model->capture_error().message().find("scratch"), std::string_view::npos)
      << model->capture_error();
  EXPECT_FALSE(model->HasRecording(130, 8));
  EXPECT_EQ(model->unrecordable_shapes().count({130, 8}), 1u);
  EXPECT_EQ(model->decode_capture_max_batch(), 130) << "recording stopped for every shape";
  verify.Step();
  decode.Step();
  EXPECT_EQ(model->num_decode_graphs(), 1);
  EXPECT_TRUE(model->HasRecording(64, 1));
}

// A step that the device's memory cannot hold fails with ResourceExhausted (its tensors, or an op
// scratch through Backend::TakeOpError) instead of aborting the process, and leaves its sequence
// where it was; with the memory free again a fresh sequence's prefill of the same prompt gives
// the same logits as before. The prompt runs once first, so that its kernels are loaded and the
// step metadata buffers sized; the block cache is emptied; then the test takes the device's
// free memory in ever smaller tensors, down to 1 MiB.
TEST(CudaStepMemory, AStepThatDoesNotFitFailsAndTheNextOneRuns) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto backend = kernels::CreateCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto model = LoadDummyModel(
      std::filesystem::path(FixtureModelDir("qwen3next-tiny")) / "config.json", **backend);
  ASSERT_NE(model, nullptr);
  const int tokens = 2048;
  ASSERT_TRUE(model->CreateCaches(3, tokens).ok());
  std::vector<int32_t> prompt(tokens);
  for (int i = 0; i < tokens; ++i) prompt[i] = (i * 37 + 11) % 2048;
  auto prefill = [&](worker::SequenceCache& seq, std::vector<float>& logits) {
    EXPECT_TRUE(model->StartSequence(seq).ok());
    std::vector<worker::SequenceStep> step = {{std::span<const int32_t>(prompt), &seq}};
    return model->Forward(step, worker::ForwardOptions{}, logits);
  };
  worker::SequenceCache first, starved, again;
  std::vector<float> expected, logits;
  ASSERT_TRUE(prefill(first, expected).ok());
  ASSERT_FALSE(expected.empty());
  model->ReleaseSequence(first);
  (*backend)->ReleaseCachedMemory();
  {
    std::vector<kernels::Tensor> held;
    for (int64_t elems = int64_t{1} << 27; elems >= (int64_t{1} << 18); elems /= 8) {
      for (;;) {
        auto block = (*backend)->AllocateUninitialized(kernels::DType::kF32, {elems});
        if (!block.ok()) break;
        held.push_back(*std::move(block));
      }
    }
    const absl::Status status = prefill(starved, logits);
    std::printf("[cuda] the starved prefill: %s\n", status.ToString().c_str());
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    EXPECT_EQ(starved.num_tokens, 0) << "a failed step advanced its sequence";
    model->ReleaseSequence(starved);
  }  // the held tensors go to the block cache, which gives them back on the next miss
  ASSERT_TRUE(prefill(again, logits).ok());
  EXPECT_EQ(logits, expected);
  model->ReleaseSequence(again);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaFixtureTest, ::testing::ValuesIn(kFixtureModels),
                         FixtureParamName);

}  // namespace
}  // namespace mobius::testing
