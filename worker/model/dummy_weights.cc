// Seeded random weights for any config, so that release-scale benchmarks run without a
// checkpoint. Values are rounded to bf16 on the host before upload, so the CPU and CUDA backends
// see exactly the same weights for the same seed.
#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/parameter_layout.h"
#include "worker/model/weight_loader.h"

namespace mobius::worker {
namespace {

// splitmix64: tiny, fast and good enough for weights; seeded per (seed, parameter, chunk) so
// that results do not depend on chunking order.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  float Uniform() { return static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f); }

 private:
  uint64_t state_;
};

float SampleFor(ParameterRole role, SplitMix64& rng) {
  const float u = rng.Uniform();
  // Zero-mean uniform with standard deviation 0.02 (the HF initializer range).
  const float kLinearHalfWidth = 0.02f * std::sqrt(3.0f);
  switch (role) {
    case ParameterRole::kLinear:
    case ParameterRole::kEmbedding:
    case ParameterRole::kRouter:
      return (2 * u - 1) * kLinearHalfWidth;
    case ParameterRole::kNorm1p:
      return (2 * u - 1) * 0.05f;
    case ParameterRole::kPlainNorm:
      return 1.0f + (2 * u - 1) * 0.05f;
    case ParameterRole::kConv:
      return (2 * u - 1) * 0.5f;
    case ParameterRole::kALog:
      return std::log(1.0f + 15.0f * u);  // A in [1, 16]
    case ParameterRole::kDtBias: {
      // dt log-uniform in [1e-3, 1e-1]; dt_bias = softplus^-1(dt).
      const float dt = std::exp(std::log(1e-3f) + u * (std::log(1e-1f) - std::log(1e-3f)));
      return dt + std::log(-std::expm1(-dt));
    }
  }
  return 0.0f;
}

}  // namespace

absl::StatusOr<ModelWeights> CreateDummyWeights(const ModelConfig& config,
                                                kernels::Backend& backend, uint64_t seed,
                                                bool include_mtp) {
  LayoutOptions options;
  options.prefix = DefaultTensorPrefix(config);
  options.include_mtp = include_mtp && config.mtp_num_hidden_layers > 0;
  ModelWeights weights;
  std::vector<ParameterSpec> specs = ListParameters(config, options, &weights);

  // Chunks are generated in parallel (each chunk's generator is seeded from its position, so the
  // values do not depend on the thread count) and uploaded in order by this thread: a release-scale
  // model (35 B parameters) took minutes single-threaded.
  constexpr int64_t kChunk = int64_t{1} << 20;
  const int workers = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 32u));
  std::vector<std::vector<uint16_t>> host(workers, std::vector<uint16_t>(kChunk));
  for (size_t p = 0; p < specs.size(); ++p) {
    ParameterSpec& spec = specs[p];
    auto tensor = backend.Allocate(backend.activation_dtype(), spec.shape);
    if (!tensor.ok()) {
      return absl::Status(
          tensor.status().code(),
          absl::StrCat("allocating dummy parameter ", spec.name, ": ", tensor.status().message()));
    }
    *spec.target = *std::move(tensor);
    kernels::Tensor flat = spec.target->Reshape({spec.numel()});
    const int64_t num_chunks = (spec.numel() + kChunk - 1) / kChunk;
    for (int64_t first = 0; first < num_chunks; first += workers) {
      const int batch = static_cast<int>(std::min<int64_t>(workers, num_chunks - first));
      auto fill = [&](int w) {
        const int64_t begin = (first + w) * kChunk;
        const int64_t count = std::min(kChunk, spec.numel() - begin);
        SplitMix64 rng(seed ^ (0x100000001b3ull * (p + 1)) ^ (static_cast<uint64_t>(begin) << 1));
        for (int64_t i = 0; i < count; ++i) {
          host[w][i] = kernels::FloatToBF16(SampleFor(spec.role, rng));
        }
      };
      if (batch == 1) {
        fill(0);
      } else {
        std::vector<std::thread> threads;
        for (int w = 0; w < batch; ++w) threads.emplace_back(fill, w);
        for (std::thread& t : threads) t.join();
      }
      for (int w = 0; w < batch; ++w) {
        const int64_t begin = (first + w) * kChunk;
        kernels::Tensor dst = flat.Rows(begin, std::min(kChunk, spec.numel() - begin));
        backend.CopyFromHost(host[w].data(), kernels::DType::kBF16, dst);
      }
    }
  }
  if (config.tie_word_embeddings) weights.lm_head = weights.embed;
  return weights;
}

}  // namespace mobius::worker
