// Tensor-, expert- and sequence-parallel sharding of the model on CPU: ranks are threads joined by
// a LocalCommunicator, each holding only its shard. Sharded replicas must give the fixtures'
// reference logits and the one-process greedy tokens, and sharded weights (dummy or loaded) must
// be exactly the slices of the unsharded ones.
#include <algorithm>
#include <memory>
#include <span>
#include <thread>

#include "gtest/gtest.h"
#include "tests/model/fixture_util.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/distributed/local_communicator.h"
#include "worker/model/expert_placement.h"
#include "worker/model/model_config.h"
#include "worker/model/model_factory.h"
#include "worker/model/parameter_layout.h"
#include "worker/model/weight_loader.h"

namespace mobius::testing {
namespace {

using worker::ForwardOptions;
using worker::LogitsMode;
using worker::ModelConfig;
using worker::ModelWeights;
using worker::ParameterSpec;
using worker::SequenceCache;
using worker::SequenceStep;
using worker::ShardSpec;

constexpr double kTolerance = 1e-3;

int32_t Argmax(const float* row, int n) { return std::max_element(row, row + n) - row; }

struct Layout {
  std::string name;
  int world, tp, ep;
  bool sequence_parallel;
  bool load_aware = false;  // experts placed by SkewedPlacement instead of contiguously
  // Start contiguous and move to SkewedPlacement on every rank without reloading the model
  // (HybridModel::ApplyExpertPlacement), in the middle of a sequence's chunked prefill.
  bool live_placement = false;
  // Load-aware placements replicate this many hot experts per rank and bank (expert_placement.h).
  int replicas = 0;
};

void PrintTo(const Layout& layout, std::ostream* os) { *os << layout.name; }

// TP and EP run over the same ranks (shard_spec.h): tp, ep in {1, world}.
// "one" is the unsharded model through the same harness, as a baseline.
const std::vector<Layout> kLayouts = {
    {"one", 1, 1, 1, false},
    {"tp2", 2, 2, 1, false},
    {"tp4", 4, 4, 1, false},
    {"ep2", 2, 1, 2, false},
    {"ep4", 4, 1, 4, false},
    {"tp2_ep2", 2, 2, 2, false},
    {"tp4_ep4", 4, 4, 4, false},
    {"tp2_sp", 2, 2, 1, true},
    {"tp4_sp", 4, 4, 1, true},
    {"tp4_ep4_sp", 4, 4, 4, true},
    {"tp8", 8, 8, 1, false},
    // Load-aware expert placement (expert_placement.h): other experts on each rank, same model.
    {"ep2_loadaware", 2, 1, 2, false, true},
    {"ep4_loadaware", 4, 1, 4, false, true},
    {"tp2_ep2_loadaware", 2, 2, 2, false, true},
    {"ep2_live_placement", 2, 1, 2, false, false, true},
    {"ep4_live_placement", 4, 1, 4, false, false, true},
    // Hot experts replicated: their tokens split over the holders (MapExpertIds), same model.
    {"ep2_replicated", 2, 1, 2, false, true, false, 2},
    {"ep4_replicated", 4, 1, 4, false, true, false, 3},
    {"tp2_ep2_replicated", 2, 2, 2, false, true, false, 1},
    {"ep2_live_replicated", 2, 1, 2, false, false, true, 2},
};

// A placement balancing a load that the contiguous placement puts all on rank 0 (its experts
// are the hot ones), so that the balanced one must move experts between ranks.
absl::StatusOr<std::shared_ptr<const worker::ExpertPlacement>> SkewedPlacement(
    const std::string& dir, int world, int replicas) {
  absl::StatusOr<worker::ModelConfig> config = worker::LoadModelConfig(dir + "/config.json");
  if (!config.ok()) return config.status();
  const int E = config->num_experts;
  std::vector<std::vector<double>> loads(config->num_blocks, std::vector<double>(E));
  for (auto& bank : loads) {
    for (int e = 0; e < E; ++e) bank[e] = e < E / world ? 100.0 + e : 1.0;
    // With replicas: one expert carries most of the load, which only copies can spread.
    if (replicas > 0) bank[1] = 1000.0 * E;
  }
  absl::StatusOr<worker::ExpertPlacement> p =
      worker::ExpertPlacement::BalanceLoads(loads, world, replicas);
  if (!p.ok()) return p.status();
  if ((p->replicas_per_rank() > 0) != (replicas > 0) || p->replicas_per_rank() > replicas) {
    return absl::InternalError("the placement does not hold the replicas asked for");
  }
  // The contiguous placement leaves all the load on rank 0; the balanced one spreads it.
  const worker::ExpertPlacement contiguous =
      worker::ExpertPlacement::Contiguous(config->num_blocks, E);
  if (p->identity() || p->Imbalance(loads, world) >= contiguous.Imbalance(loads, world)) {
    return absl::InternalError("the load-aware placement did not move or balance any expert");
  }
  return std::make_shared<const worker::ExpertPlacement>(*std::move(p));
}

// What one rank computed.
struct RankResult {
  absl::Status status;
  std::vector<std::vector<float>> prompt_logits;  // one forward per prompt, every position
  std::vector<float> ragged_prefill_logits;       // the greedy prompts in one ragged step
  std::vector<std::vector<int32_t>> ragged_tokens;
  std::vector<int32_t> chunked_tokens;  // prompt 3 prefilled 5 tokens at a time, then decoded
};

// The work of one rank. Every rank runs the same steps; the first error aborts the group so that
// the other ranks do not wait for it.
RankResult RunRank(const std::string& dir, const ModelReference& ref, const Layout& layout,
                   int rank, worker::Communicator& comm) {
  RankResult r;
  auto fail = [&](absl::Status s) {
    r.status = s;
    comm.Abort(s);
    return r;
  };
  std::unique_ptr<kernels::Backend> backend = kernels::CreateCpuBackend(1);
  worker::ModelSource source;
  source.model_dir = dir;
  source.shard = ShardSpec::ForRank(rank, layout.tp, layout.ep);
  if (layout.load_aware) {
    auto placement = SkewedPlacement(dir, layout.ep, layout.replicas);
    if (!placement.ok()) return fail(placement.status());
    source.shard.placement = *placement;
  }
  source.comm = &comm;
  auto loaded = worker::LoadHybridModel(source, *backend);
  if (!loaded.ok()) return fail(loaded.status());
  worker::HybridModel& model = **loaded;
  if (layout.load_aware && layout.replicas > 0 &&
      model.weights().banks[0].gate_up.dim(0) !=
          model.config().num_experts / layout.ep +
              static_cast<int64_t>(
                  source.shard.placement->replicas(0, source.shard.ep_rank).size())) {
    return fail(absl::InternalError("the rank's bank does not hold its replicas"));
  }
  if (absl::Status s = model.SetSequenceParallel(layout.sequence_parallel); !s.ok()) return fail(s);
  if (absl::Status s = model.CreateCaches(4, 256); !s.ok()) return fail(s);
  const int vocab = model.config().vocab_size;
  ForwardOptions all;
  all.logits = LogitsMode::kAllTokens;
  std::vector<float> logits;

  for (const auto& prompt : ref.prompts) {
    SequenceCache seq;
    if (absl::Status s = model.StartSequence(seq); !s.ok()) return fail(s);
    SequenceStep step{prompt, &seq};
    if (absl::Status s = model.Forward(std::span(&step, 1), all, logits); !s.ok()) return fail(s);
    r.prompt_logits.push_back(logits);
    model.ReleaseSequence(seq);
  }

  // The greedy prompts prefilled together, then decoded together one token per step.
  const size_t n = ref.greedy.size();
  std::vector<SequenceCache> seqs(n);
  std::vector<SequenceStep> steps;
  for (size_t i = 0; i < n; ++i) {
    if (absl::Status s = model.StartSequence(seqs[i]); !s.ok()) return fail(s);
    steps.push_back({ref.prompts[ref.greedy[i].first], &seqs[i]});
  }
  if (absl::Status s = model.Forward(steps, all, logits); !s.ok()) return fail(s);
  r.ragged_prefill_logits = logits;
  r.ragged_tokens.resize(n);
  size_t row = 0;
  for (size_t i = 0; i < n; ++i) {
    row += ref.prompts[ref.greedy[i].first].size();
    r.ragged_tokens[i].push_back(Argmax(logits.data() + (row - 1) * vocab, vocab));
  }
  for (size_t t = 1; t < ref.greedy[0].second.size(); ++t) {
    steps.clear();
    for (size_t i = 0; i < n; ++i)
      steps.push_back({std::span(&r.ragged_tokens[i].back(), 1), &seqs[i]});
    if (absl::Status s = model.Forward(steps, {}, logits); !s.ok()) return fail(s);
    for (size_t i = 0; i < n; ++i) {
      r.ragged_tokens[i].push_back(Argmax(logits.data() + i * vocab, vocab));
    }
  }
  for (SequenceCache& seq : seqs) model.ReleaseSequence(seq);

  // Chunked prefill (chunks of 5: not a multiple of any world size) and decode of one sequence.
  const auto& [p3, expected3] = ref.greedy.back();
  const auto& prompt = ref.prompts[p3];
  SequenceCache seq;
  if (absl::Status s = model.StartSequence(seq); !s.ok()) return fail(s);
  for (size_t b = 0; b < prompt.size(); b += 5) {
    SequenceStep step{std::span(prompt).subspan(b, std::min<size_t>(5, prompt.size() - b)), &seq};
    if (absl::Status s = model.Forward(std::span(&step, 1), {}, logits); !s.ok()) return fail(s);
    if (layout.live_placement && b == 0) {
      // Every rank moves between the same two steps (the leader's plan does this in a worker).
      auto placement = SkewedPlacement(dir, layout.ep, layout.replicas);
      if (!placement.ok()) return fail(placement.status());
      const kernels::Tensor router_before = model.weights().banks[0].router;
      if (absl::Status s = model.ApplyExpertPlacement(*placement); !s.ok()) return fail(s);
      if (model.shard().placement != *placement ||
          model.weights().banks[0].router.raw() == router_before.raw()) {
        return fail(absl::InternalError("the placement was not applied"));
      }
    }
  }
  while (r.chunked_tokens.size() < expected3.size()) {
    r.chunked_tokens.push_back(Argmax(logits.data(), vocab));
    SequenceStep step{std::span(&r.chunked_tokens.back(), 1), &seq};
    if (absl::Status s = model.Forward(std::span(&step, 1), {}, logits); !s.ok()) return fail(s);
  }
  return r;
}

class ShardedModelTest : public ::testing::TestWithParam<std::tuple<std::string, Layout>> {};

TEST_P(ShardedModelTest, MatchesReferenceAndOneProcess) {
  const auto& [model_name, layout] = GetParam();
  const std::string dir = FixtureModelDir(model_name);
  absl::StatusOr<ModelConfig> config = worker::LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::Status fits =
      worker::ComputeShardDims(*config, ShardSpec::ForRank(0, layout.tp, layout.ep)).status();
  if (!fits.ok()) GTEST_SKIP() << model_name << " cannot be split this way: " << fits.message();

  const ModelReference ref = LoadReference(dir);
  ASSERT_EQ(ref.prompts.size(), 4u);
  auto comms = worker::CreateLocalCommunicators(layout.world);
  std::vector<RankResult> results(layout.world);
  {
    std::vector<std::thread> threads;
    for (int rank = 0; rank < layout.world; ++rank) {
      // `layout` passed by value: Clang before 16 cannot capture a structured binding.
      threads.emplace_back([&, rank, layout = layout] {
        results[rank] = RunRank(dir, ref, layout, rank, *comms[rank]);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (int rank = 0; rank < layout.world; ++rank) {
    ASSERT_TRUE(results[rank].status.ok()) << "rank " << rank << ": " << results[rank].status;
  }
  const RankResult& r = results[0];
  // Every rank ends each step with the same logits (replicated lm_head over identical inputs).
  for (int rank = 1; rank < layout.world; ++rank) {
    EXPECT_EQ(results[rank].prompt_logits, r.prompt_logits) << "rank " << rank;
    EXPECT_EQ(results[rank].ragged_tokens, r.ragged_tokens) << "rank " << rank;
  }

  double worst = 0;
  for (size_t p = 0; p < ref.prompts.size(); ++p) {
    ASSERT_EQ(r.prompt_logits[p].size(), ref.logits[p].size());
    const double err =
        RelativeError(r.prompt_logits[p].data(), ref.logits[p].data(), ref.logits[p].size());
    worst = std::max(worst, err);
    EXPECT_LT(err, kTolerance) << "prompt " << p;
  }
  const int vocab = config->vocab_size;
  size_t row = 0;
  for (const auto& [p, expected] : ref.greedy) {
    const size_t len = ref.prompts[p].size();
    EXPECT_LT(RelativeError(r.ragged_prefill_logits.data() + row * vocab, ref.logits[p].data(),
                            len * vocab),
              kTolerance)
        << "prompt " << p << " in a ragged batch";
    row += len;
  }
  RecordProperty("max_relative_error", std::to_string(worst));
  std::cout << model_name << " " << layout.name << ": max relative error " << worst << "\n";

  // The one-process engine's tokens are the fixtures' greedy tokens (fixture_model_test).
  for (size_t i = 0; i < ref.greedy.size(); ++i) {
    EXPECT_EQ(r.ragged_tokens[i], ref.greedy[i].second) << "prompt " << ref.greedy[i].first;
  }
  EXPECT_EQ(r.chunked_tokens, ref.greedy.back().second);
}

std::string LayoutTestName(const ::testing::TestParamInfo<std::tuple<std::string, Layout>>& info) {
  std::string name = std::get<0>(info.param) + "_" + std::get<1>(info.param).name;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ShardedModelTest,
                         ::testing::Combine(::testing::ValuesIn(kFixtureModels),
                                            ::testing::ValuesIn(kLayouts)),
                         LayoutTestName);

// ---- sharded weights are slices of the unsharded ones ----

// The specs of `shard` with targets in `holder`, filled from `weights` (made for that shard).
// ListParameters sizes holder's vectors; element-wise assignment keeps the targets valid.
std::vector<ParameterSpec> SpecsOf(const ModelConfig& config, const ShardSpec& shard,
                                   const ModelWeights& weights, ModelWeights& holder) {
  worker::LayoutOptions options;
  options.prefix = worker::DefaultTensorPrefix(config);
  options.shard = shard;
  std::vector<ParameterSpec> specs = worker::ListParameters(config, options, &holder);
  holder.embed = weights.embed;
  holder.final_norm = weights.final_norm;
  holder.lm_head = weights.lm_head;
  for (size_t i = 0; i < holder.layers.size(); ++i) holder.layers[i] = weights.layers[i];
  for (size_t b = 0; b < holder.banks.size(); ++b) holder.banks[b] = weights.banks[b];
  return specs;
}

std::vector<float> Host(kernels::Backend& backend, const kernels::Tensor& t) {
  std::vector<float> v(t.numel());
  backend.CopyToHostF32(t, v.data());
  return v;
}

// Checks every parameter of `sharded` (weights of rank `shard`) against the slice of `full`.
void ExpectSlicesOf(const ModelConfig& config, kernels::Backend& backend, const ModelWeights& full,
                    const ModelWeights& sharded, const ShardSpec& shard) {
  ModelWeights full_holder, shard_holder;
  std::vector<ParameterSpec> full_specs = SpecsOf(config, {}, full, full_holder);
  std::vector<ParameterSpec> shard_specs = SpecsOf(config, shard, sharded, shard_holder);
  ASSERT_EQ(full_specs.size(), shard_specs.size());
  int sliced = 0;
  for (size_t i = 0; i < full_specs.size(); ++i) {
    const ParameterSpec& spec = shard_specs[i];
    ASSERT_EQ(spec.name, full_specs[i].name);
    ASSERT_EQ(spec.full_shape, full_specs[i].shape) << spec.name;
    ASSERT_EQ(spec.target->shape(), spec.shape) << spec.name;
    const std::vector<float> whole = Host(backend, *full_specs[i].target);
    std::vector<float> expected;
    if (spec.slice.empty()) {
      expected = whole;
    } else {
      ++sliced;
      for (const worker::SliceRun& run : spec.slice) {
        for (int64_t j = 0; j < run.repeat; ++j) {
          const auto begin = whole.begin() + run.full_offset + j * run.full_stride;
          expected.insert(expected.end(), begin, begin + run.count);
        }
      }
    }
    ASSERT_EQ(Host(backend, *spec.target), expected) << spec.name << " of rank " << shard.rank();
  }
  EXPECT_GT(sliced, 0);
}

class ShardedWeightsTest : public ::testing::TestWithParam<std::string> {};

const std::vector<std::pair<int, int>> kWeightLayouts = {{2, 1}, {4, 1}, {1, 2}, {1, 4}, {2, 2}};

TEST_P(ShardedWeightsTest, DummyWeightsOfAShardAreSlicesOfTheUnshardedOnes) {
  absl::StatusOr<ModelConfig> config = worker::LoadModelConfig(FixtureModelDir(GetParam()));
  ASSERT_TRUE(config.ok()) << config.status();
  auto backend = kernels::CreateCpuBackend(1);
  auto full = worker::CreateDummyWeights(*config, *backend, 11, /*include_mtp=*/false);
  ASSERT_TRUE(full.ok()) << full.status();
  for (const auto& [tp, ep] : kWeightLayouts) {
    const int world = std::max(tp, ep);
    for (int rank = 0; rank < world; ++rank) {
      const ShardSpec shard = ShardSpec::ForRank(rank, tp, ep);
      auto part = worker::CreateDummyWeights(*config, *backend, 11, false, shard);
      ASSERT_TRUE(part.ok()) << part.status();
      SCOPED_TRACE(::testing::Message() << "tp=" << tp << " ep=" << ep << " rank " << rank);
      ExpectSlicesOf(*config, *backend, *full, *part, shard);
    }
  }
}

TEST_P(ShardedWeightsTest, LoadedWeightsOfAShardAreSlicesOfTheUnshardedOnes) {
  const std::string dir = FixtureModelDir(GetParam());
  absl::StatusOr<ModelConfig> config = worker::LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto checkpoint = worker::Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto backend = kernels::CreateCpuBackend(1);
  auto full = worker::LoadCheckpointWeights(*config, **checkpoint, *backend);
  ASSERT_TRUE(full.ok()) << full.status();
  for (const auto& [tp, ep] : kWeightLayouts) {
    const int world = std::max(tp, ep);
    for (int rank = 0; rank < world; ++rank) {
      const ShardSpec shard = ShardSpec::ForRank(rank, tp, ep);
      auto part = worker::LoadCheckpointWeights(*config, **checkpoint, *backend, shard);
      ASSERT_TRUE(part.ok()) << part.status();
      SCOPED_TRACE(::testing::Message() << "tp=" << tp << " ep=" << ep << " rank " << rank);
      ExpectSlicesOf(*config, *backend, *full, *part, shard);
    }
  }
}

TEST_P(ShardedWeightsTest, ShardsThatDoNotFitAreRejectedNamingTheField) {
  const std::string dir = FixtureModelDir(GetParam());
  absl::StatusOr<ModelConfig> config = worker::LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto backend = kernels::CreateCpuBackend(1);
  auto three = worker::CreateDummyWeights(*config, *backend, 1, false, ShardSpec::ForRank(0, 3, 1));
  EXPECT_EQ(three.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(three.status().message().find("num_attention_heads"), std::string_view::npos)
      << three.status();
  // TP and EP over different numbers of ranks is not a layout (shard_spec.h).
  ShardSpec mixed = ShardSpec::ForRank(0, 2, 4);
  EXPECT_EQ(worker::ComputeShardDims(*config, mixed).status().code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ShardedWeightsTest, ::testing::ValuesIn(kFixtureModels),
                         FixtureParamName);

}  // namespace
}  // namespace mobius::testing
