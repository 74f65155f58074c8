#include "worker/model/model_factory.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/weight_loader.h"

namespace mobius::worker {

absl::StatusOr<LoadFormat> ParseLoadFormat(const std::string& name) {
  if (name == "safetensors" || name == "auto") return LoadFormat::kSafetensors;
  if (name == "dummy") return LoadFormat::kDummy;
  return absl::InvalidArgumentError(absl::StrCat(
      "--load-format \"", name, "\" is not supported (use \"safetensors\" or \"dummy\")"));
}

absl::StatusOr<std::unique_ptr<HybridModel>> LoadHybridModel(const ModelSource& source,
                                                             kernels::Backend& backend) {
  const std::string config_path =
      source.config_path.empty() ? source.model_dir : source.config_path;
  if (config_path.empty()) {
    return absl::InvalidArgumentError(
        "no model given: pass --model DIR (or --config FILE with "
        "--load-format dummy)");
  }
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(config_path));
  // Shapes the backend's kernels do not take fail here, before any weight is read.
  const kernels::ModelOpShapes shapes{
      .head_dim = config.head_dim,
      .linear_key_head_dim = config.linear_key_head_dim,
      .linear_value_head_dim = config.linear_value_head_dim,
      .linear_conv_kernel_dim = config.linear_conv_kernel_dim,
  };
  if (absl::Status s = backend.CheckModelOpShapes(shapes); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model config ", config_path, " on the ",
                                                   backend.name(), " backend: ", s.message()));
  }
  ModelWeights weights;
  if (source.load_format == LoadFormat::kDummy) {
    ASSIGN_OR_RETURN(
        weights, CreateDummyWeights(config, backend, source.seed, source.load_mtp, source.shard));
  } else {
    if (source.model_dir.empty()) {
      return absl::InvalidArgumentError(
          "--load-format safetensors needs --model DIR holding the checkpoint");
    }
    ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(source.model_dir));
    ASSIGN_OR_RETURN(weights, LoadCheckpointWeights(config, *checkpoint, backend, source.shard));
  }
  auto model =
      std::make_unique<HybridModel>(config, std::move(weights), backend, source.shard, source.comm);
  // A new expert placement reloads this rank's banks from the same source.
  model->SetBankLoader([source, config, &backend](const ShardSpec& shard)
                           -> absl::StatusOr<std::vector<ExpertBankWeights>> {
    ModelWeights banks;
    if (source.load_format == LoadFormat::kDummy) {
      ASSIGN_OR_RETURN(banks, CreateDummyWeights(config, backend, source.seed, source.load_mtp,
                                                 shard, WeightSelection::kRoutedExperts));
    } else {
      ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(source.model_dir));
      ASSIGN_OR_RETURN(banks, LoadCheckpointWeights(config, *checkpoint, backend, shard,
                                                    WeightSelection::kRoutedExperts));
    }
    return std::move(banks.banks);
  });
  return model;
}

}  // namespace mobius::worker
