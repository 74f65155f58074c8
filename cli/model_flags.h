// Flags shared by the commands that load a model (--model, --config, --load-format, --seed,
// --device, --threads) and the helpers that turn them into a backend and a model.
#ifndef MOBIUS_CLI_MODEL_FLAGS_H_
#define MOBIUS_CLI_MODEL_FLAGS_H_

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "worker/model/hybrid_model.h"
#include "worker/model/model_factory.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, config);

namespace mobius::cli {

absl::StatusOr<worker::ModelSource> ModelSourceFromFlags();
absl::StatusOr<std::unique_ptr<kernels::Backend>> BackendFromFlags();
// Applies the flags that tune a loaded model's execution (--cuda-graph-max-batch).
void ApplyModelRuntimeFlags(worker::HybridModel& model);

}  // namespace mobius::cli

#endif  // MOBIUS_CLI_MODEL_FLAGS_H_
