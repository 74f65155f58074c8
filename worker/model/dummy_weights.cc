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

// splitmix64: tiny, fast and good enough for weights; seeded per (seed, parameter, chunk of the
// unsharded parameter) so that results depend neither on chunking order nor on sharding.
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
  // Moves the stream `n` values ahead (splitmix64's state is a counter).
  void Skip(uint64_t n) { state_ += n * 0x9e3779b97f4a7c15ull; }

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

constexpr int64_t kChunk = int64_t{1} << 20;

// Values [full, full + count) of parameter `p` of the unsharded model: element f comes from the
// stream of its chunk (f / kChunk), seeded from the chunk's position, at index f % kChunk, so
// any slice of the parameter gets exactly the unsharded values.
void FillFull(uint64_t seed, size_t p, ParameterRole role, int64_t full, int64_t count,
              uint16_t* out) {
  while (count > 0) {
    const int64_t begin = full / kChunk * kChunk;
    SplitMix64 rng(seed ^ (0x100000001b3ull * (p + 1)) ^ (static_cast<uint64_t>(begin) << 1));
    rng.Skip(static_cast<uint64_t>(full - begin));
    const int64_t n = std::min(count, begin + kChunk - full);
    for (int64_t i = 0; i < n; ++i) *out++ = kernels::FloatToBF16(SampleFor(role, rng));
    full += n;
    count -= n;
  }
}

// Local elements [local, local + count) of `spec` (a rank's slice, or the whole parameter).
void FillLocal(uint64_t seed, size_t p, const ParameterSpec& spec, int64_t local, int64_t count,
               uint16_t* out) {
  if (spec.slice.empty()) {
    FillFull(seed, p, spec.role, local, count, out);
    return;
  }
  int64_t run_begin = 0;  // local offset of the current run
  for (const SliceRun& run : spec.slice) {
    const int64_t run_size = run.count * run.repeat;
    if (local >= run_begin + run_size) {
      run_begin += run_size;
      continue;
    }
    while (count > 0 && local < run_begin + run_size) {
      const int64_t j = (local - run_begin) / run.count, within = (local - run_begin) % run.count;
      const int64_t n = std::min(count, run.count - within);
      FillFull(seed, p, spec.role, run.full_offset + j * run.full_stride + within, n, out);
      out += n;
      local += n;
      count -= n;
    }
    if (count == 0) return;
    run_begin += run_size;
  }
}

}  // namespace

absl::StatusOr<ModelWeights> CreateDummyWeights(const ModelConfig& config,
                                                kernels::Backend& backend, uint64_t seed,
                                                bool include_mtp, const ShardSpec& shard,
                                                WeightSelection selection) {
  RETURN_IF_ERROR(ComputeShardDims(config, shard).status());
  LayoutOptions options;
  options.prefix = DefaultTensorPrefix(config);
  options.include_mtp = include_mtp && config.mtp_num_hidden_layers > 0;
  options.shard = shard;
  ModelWeights weights;
  std::vector<ParameterSpec> specs = ListParameters(config, options, &weights);

  // Chunks are generated in parallel (each chunk's generator is seeded from its position, so the
  // values do not depend on the thread count) and uploaded in order by this thread: a release-scale
  // model (35 B parameters) took minutes single-threaded.
  const int workers = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 32u));
  std::vector<std::vector<uint16_t>> host(workers, std::vector<uint16_t>(kChunk));
  for (size_t p = 0; p < specs.size(); ++p) {
    ParameterSpec& spec = specs[p];
    // (Values are seeded by the parameter's index in the full list, so a selection gets the
    // same values as a full load.)
    if (selection == WeightSelection::kRoutedExperts &&
        spec.group != ParameterGroup::kRoutedExperts) {
      continue;
    }
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
        FillLocal(seed, p, spec, begin, std::min(kChunk, spec.numel() - begin), host[w].data());
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
  if (config.tie_word_embeddings && selection == WeightSelection::kAll) {
    weights.lm_head = weights.embed;
  }
  return weights;
}

}  // namespace mobius::worker
