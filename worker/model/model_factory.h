// Builds a ready-to-run HybridModel from a model directory (config.json + safetensors) or from
// a config alone with dummy weights. Shared by the CLI and the worker.
#ifndef MOBIUS_WORKER_MODEL_MODEL_FACTORY_H_
#define MOBIUS_WORKER_MODEL_MODEL_FACTORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "worker/model/hybrid_model.h"

namespace mobius::worker {

enum class LoadFormat { kSafetensors, kDummy };

// Parses "safetensors" / "dummy" ("auto" is safetensors).
absl::StatusOr<LoadFormat> ParseLoadFormat(const std::string& name);

struct ModelSource {
  std::string model_dir;    // config.json (+ weights unless dummy)
  std::string config_path;  // overrides model_dir/config.json when set
  LoadFormat load_format = LoadFormat::kSafetensors;
  uint64_t seed = 0;     // dummy weights
  bool load_mtp = true;  // dummy weights: create the MTP head too
  // A rank of a sharded replica: its shard (only its slices are read) and the replica's
  // communicator (see HybridModel).
  ShardSpec shard;
  Communicator* comm = nullptr;
};

absl::StatusOr<std::unique_ptr<HybridModel>> LoadHybridModel(const ModelSource& source,
                                                             kernels::Backend& backend);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_MODEL_FACTORY_H_
