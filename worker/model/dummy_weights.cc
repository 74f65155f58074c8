// Seeded random weights for any config, so that release-scale benchmarks run without a
// checkpoint. Values are rounded to bf16 on the host before upload, so the CPU and CUDA backends
// see exactly the same weights for the same seed.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

// One chunk of one parameter: local elements [begin, begin + count) of specs[param].
struct ChunkJob {
  size_t param;
  int64_t begin, count;
};

// Runs generate(job, buffer) for every job on worker threads and upload(job, buffer) for each on
// the calling thread, in job order, as soon as the job's values are ready: a ring of 2 x workers
// buffers of kChunk values, a buffer reused once its previous job is uploaded.
absl::Status GenerateAndUpload(
    std::span<const ChunkJob> jobs, kernels::Backend& backend,
    const std::function<void(const ChunkJob&, uint16_t*)>& generate,
    const std::function<void(const ChunkJob&, const uint16_t*)>& upload) {
  const int64_t total = static_cast<int64_t>(jobs.size());
  if (total == 0) return absl::OkStatus();
  // One core is left to the uploads (on CUDA a copy's wait; on the CPU backend the conversion).
  const int workers = static_cast<int>(
      std::clamp<int64_t>(static_cast<int64_t>(std::thread::hardware_concurrency()) - 1, 1,
                          std::min<int64_t>(32, total)));
  const int slots = 2 * workers;
  std::vector<kernels::Backend::HostBuffer> buffers;
  for (int i = 0; i < slots; ++i) {
    buffers.push_back(backend.AllocateHostBuffer(sizeof(uint16_t) * kChunk));
    if (buffers.back() == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ",
                                                       sizeof(uint16_t) * kChunk,
                                                       " bytes of host memory for dummy weights"));
    }
  }
  auto buffer = [&](int64_t job) { return static_cast<uint16_t*>(buffers[job % slots].get()); };

  absl::Mutex mu;
  absl::CondVar changed;
  int64_t uploaded = 0;                   // jobs [0, uploaded) are on the device
  std::vector<int64_t> ready(slots, -1);  // the job whose values each buffer holds
  std::atomic<int64_t> next{0};           // the next job a worker takes
  auto work = [&] {
    for (int64_t j = next.fetch_add(1); j < total; j = next.fetch_add(1)) {
      {
        absl::MutexLock lock(&mu);
        while (uploaded < j - slots + 1) changed.Wait(&mu);  // the buffer's previous job
      }
      generate(jobs[j], buffer(j));
      absl::MutexLock lock(&mu);
      ready[j % slots] = j;
      changed.SignalAll();
    }
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) threads.emplace_back(work);
  for (int64_t j = 0; j < total; ++j) {
    {
      absl::MutexLock lock(&mu);
      while (ready[j % slots] != j) changed.Wait(&mu);
    }
    upload(jobs[j], buffer(j));
    absl::MutexLock lock(&mu);
    uploaded = j + 1;
    changed.SignalAll();
  }
  for (std::thread& t : threads) t.join();
  return absl::OkStatus();
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

  // Every selected parameter is allocated first; then its chunks are generated in parallel by
  // worker threads (each chunk's generator is seeded from its position, so the values depend on
  // neither the thread count nor the order) into a ring of host buffers, while this thread
  // uploads the finished chunks in order. A release-scale model (35 B parameters) took minutes
  // single-threaded; with generation and uploads from pageable memory taking turns, `mobius bench
  // engine` reported the model ready after 31.8-36.6 s on an H100 host (session 48). The buffers
  // come from the backend (page-locked on CUDA). On a 2-core CPU host, loading a 4-layer,
  // 96-expert release-shaped config with `mobius generate --device cpu` went from 22.2-22.9 to
  // 15.5-17.0 s.
  std::vector<kernels::Tensor> flat(specs.size());
  std::vector<ChunkJob> jobs;
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
    flat[p] = spec.target->Reshape({spec.numel()});
    for (int64_t begin = 0; begin < spec.numel(); begin += kChunk) {
      jobs.push_back({p, begin, std::min(kChunk, spec.numel() - begin)});
    }
  }
  RETURN_IF_ERROR(GenerateAndUpload(
      jobs, backend,
      [&](const ChunkJob& job, uint16_t* out) {
        FillLocal(seed, job.param, specs[job.param], job.begin, job.count, out);
      },
      [&](const ChunkJob& job, const uint16_t* values) {
        kernels::Tensor dst = flat[job.param].Rows(job.begin, job.count);
        backend.CopyFromHost(values, kernels::DType::kBF16, dst);
      }));
  if (config.tie_word_embeddings && selection == WeightSelection::kAll) {
    weights.lm_head = weights.embed;
  }
  return weights;
}

}  // namespace mobius::worker
