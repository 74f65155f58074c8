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
#include "worker/runtime/draft_vocabulary.h"
#include "worker/runtime/mtp_drafter.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, config);
ABSL_DECLARE_FLAG(int, spec_tokens);
ABSL_DECLARE_FLAG(std::string, spec_token_map);

namespace mobius::cli {

absl::StatusOr<worker::ModelSource> ModelSourceFromFlags();
absl::StatusOr<std::unique_ptr<kernels::Backend>> BackendFromFlags();
// Applies the flags that tune a loaded model's execution (--cuda-graph-max-batch).
void ApplyModelRuntimeFlags(worker::HybridModel& model);
// The most drafts --spec-tokens takes.
inline constexpr int kMaxSpecTokens = 32;
// --spec-tokens: the validated draft count (0: off). InvalidArgument when outside
// [0, kMaxSpecTokens], or when 0 with --spec-token-map set.
absl::StatusOr<int> SpecTokensFromFlags();
// --spec-token-map: the MTP head's draft vocabulary (whole when the flag is empty), checked
// against the vocabulary size in `source`'s config; call it before loading the weights. Errors
// name the flag, the file, the entry and the reason.
absl::StatusOr<worker::DraftVocabulary> DraftVocabularyFromFlags(const worker::ModelSource& source);
// With --spec-tokens > 0, the MTP drafter of `model` with caches for `max_sequences` sequences
// of `max_tokens` positions, drafting over `vocabulary`; null when off. Errors name the flag (no
// MTP head, sharded model).
absl::StatusOr<std::unique_ptr<worker::MtpDrafter>> MtpDrafterFromFlags(
    const worker::HybridModel& model, int max_sequences, int max_tokens,
    worker::DraftVocabulary vocabulary);

}  // namespace mobius::cli

#endif  // MOBIUS_CLI_MODEL_FLAGS_H_
