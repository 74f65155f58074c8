// Fills ModelWeights on a backend: from a checkpoint (validating every tensor against the
// config), or with seeded random values for benchmarks without a checkpoint.
#ifndef MOBIUS_WORKER_MODEL_WEIGHT_LOADER_H_
#define MOBIUS_WORKER_MODEL_WEIGHT_LOADER_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/model_config.h"
#include "worker/model/model_weights.h"
#include "worker/model/shard_spec.h"

namespace mobius::worker {

// Which parameters a load fills: all of them, or only the routed expert banks (router + experts,
// `ModelWeights::banks`; the rest stays empty). A new expert placement reloads just the banks.
enum class WeightSelection { kAll, kRoutedExperts };

// Loads every parameter of `config` from `checkpoint`. Vision tensors and anything else the
// engine does not use are ignored; `mtp.*` is loaded when the checkpoint has `mtp.fc.weight`
// and the config declares an MTP layer. Errors name the checkpoint tensor and what is wrong
// (missing, wrong shape, unsupported dtype). With a `shard`, only that rank's slices are read
// (InvalidArgument when the shard does not fit the config).
absl::StatusOr<ModelWeights> LoadCheckpointWeights(
    const ModelConfig& config, const Checkpoint& checkpoint, kernels::Backend& backend,
    const ShardSpec& shard = {}, WeightSelection selection = WeightSelection::kAll);

// Seeded random weights with magnitudes that keep activations in a sane range (see
// dummy_weights.cc). The same seed gives the same weights, and a `shard` gets exactly the
// unsharded values of its slices.
absl::StatusOr<ModelWeights> CreateDummyWeights(const ModelConfig& config,
                                                kernels::Backend& backend, uint64_t seed,
                                                bool include_mtp, const ShardSpec& shard = {},
                                                WeightSelection selection = WeightSelection::kAll);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_WEIGHT_LOADER_H_
