// Host sampling of one logits row (RequestSampler::Sample) at the release vocabulary (248,320
// tokens): what a decode step that does not sample greedily pays per sequence after its logits
// reach the host (docs/performance.md, "Sampling on the host").
//
//   build/bin/sampler_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "worker/runtime/sampler.h"
#include "worker/runtime/speculative_sampling.h"

namespace mobius::worker {
namespace {

constexpr int kVocab = 248320;

// A language model's row: a wide tail and a few large logits.
std::vector<float> Row() {
  std::mt19937 rng(5);
  std::normal_distribution<float> tail(0.0f, 2.5f);
  std::vector<float> logits(kVocab);
  for (float& x : logits) x = tail(rng);
  for (int i = 0; i < 40; ++i) logits[rng() % kVocab] = 12.0f + i % 7;
  return logits;
}

// Arguments: temperature x 10, top_k, top_p x 100.
void BM_SampleRow(benchmark::State& state) {
  SamplingParams params;
  params.temperature = static_cast<float>(state.range(0)) / 10;
  params.top_k = static_cast<int>(state.range(1));
  params.top_p = static_cast<float>(state.range(2)) / 100;
  RequestSampler sampler(params, 1);
  const std::vector<float> row = Row();
  std::vector<float> logits(kVocab);
  const TokenHistory history;
  for (auto _ : state) {
    logits = row;  // Sample modifies the row in place (penalties)
    benchmark::DoNotOptimize(sampler.Sample(logits, history));
  }
}
BENCHMARK(BM_SampleRow)
    ->ArgNames({"t10", "top_k", "top_p100"})
    ->Args({10, 0, 100})  // temperature only: the OpenAI defaults
    ->Args({8, 0, 95})
    ->Args({8, 50, 100})
    ->Args({7, 20, 80})
    ->Unit(benchmark::kMillisecond);

// Speculative verification of k = 4 drafts of one sequence on the host (VerifyDraftsWithSampler:
// k + 1 rows' distributions, the acceptance rule), what a sampled request pays per verify step.
// The drafts are the row's most likely token: a greedy request accepts them all (k + 1 rows'
// distributions), a sampled one each with that token's probability.
struct VerifyCase {
  static constexpr int kDrafts = 4;
  explicit VerifyCase(const SamplingParams& params) : sampler(params, 1) {
    const std::vector<float> row = Row();
    for (int j = 0; j <= kDrafts; ++j) rows.insert(rows.end(), row.begin(), row.end());
    drafts.assign(kDrafts,
                  static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
    scratch.resize(rows.size());
  }
  // One verify on fresh copies of the rows (the call modifies them).
  DraftVerdict Run() {
    scratch = rows;
    return VerifyDraftsWithSampler(drafts, scratch, sampler, history);
  }
  RequestSampler sampler;
  std::vector<float> rows, scratch;
  std::vector<int32_t> drafts;
  const TokenHistory history;
};

// Arguments: temperature x 10 (0: greedy), top_p x 100.
void BM_VerifyDrafts(benchmark::State& state) {
  SamplingParams params;
  params.temperature = static_cast<float>(state.range(0)) / 10;
  params.top_p = static_cast<float>(state.range(1)) / 100;
  VerifyCase v(params);
  for (auto _ : state) benchmark::DoNotOptimize(v.Run());
}
BENCHMARK(BM_VerifyDrafts)
    ->ArgNames({"t10", "top_p100"})
    ->Args({0, 100})
    ->Args({8, 95})
    ->Unit(benchmark::kMillisecond);

// The same verify on a thread started for it, as Engine::VerifySampledDrafts runs all but the
// first range of a step's sequences: its thread-local distribution buffer is new each time.
void BM_VerifyDraftsOnNewThread(benchmark::State& state) {
  SamplingParams params;
  params.temperature = 0.8f;
  params.top_p = 0.95f;
  VerifyCase v(params);
  for (auto _ : state) {
    std::thread worker([&] { benchmark::DoNotOptimize(v.Run()); });
    worker.join();
  }
}
BENCHMARK(BM_VerifyDraftsOnNewThread)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace mobius::worker

BENCHMARK_MAIN();
