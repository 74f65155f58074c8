#include "cli/model_flags.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/model_config.h"
#ifdef MOBIUS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

ABSL_FLAG(std::string, model, "",
          "Model directory: config.json plus model.safetensors or sharded "
          "model.safetensors.index.json. With --load-format=dummy only config.json is read.");
ABSL_FLAG(std::string, config, "",
          "Path of a config.json to use instead of <model>/config.json (for --load-format=dummy "
          "without a model directory).");
ABSL_FLAG(std::string, load_format, "safetensors",
          "Where weights come from: \"safetensors\" (the checkpoint in --model) or \"dummy\" "
          "(seeded random weights for any config, for benchmarks).");
ABSL_FLAG(uint64_t, seed, 0, "Seed of dummy weights (--load-format=dummy).");
ABSL_FLAG(std::string, device, "cpu",
          "Compute backend: \"cpu\" (fp32 reference, OpenBLAS) or \"cuda\" (bf16 on an sm_90a "
          "GPU; \"cuda:N\" picks device N).");
ABSL_FLAG(int, threads, 1,
          "CPU backend threads (OpenMP + OpenBLAS); 0 uses every core. More than one only pays on "
          "an otherwise idle machine: OpenMP threads spin while they wait, and on busy cores "
          "that made a tiny-model decode step 100x slower here.");

ABSL_FLAG(int, cuda_graph_max_batch, 256,
          "Decode steps of up to this many sequences are recorded as CUDA graphs the first time "
          "each batch size runs and replayed afterwards (one launch per step instead of "
          "hundreds); 0 runs every op separately. Only the cuda device records.");

ABSL_FLAG(
    int, spec_tokens, 0,
    "Speculative decoding with the checkpoint's MTP draft head (mtp.*): up to this many "
    "draft tokens per decoding sequence and step, verified together in one target forward "
    "and rolled back exactly when rejected, so outputs do not change (greedy: identical; "
    "sampling: the same distribution). 0 turns it off; at most 32. Needs the mtp.* tensors (dummy "
    "weights have them). On a replica of several ranks the leader runs the head and every "
    "rank rolls back its shard of the state. Requests that ask for logprobs decode "
    "without drafts.");

ABSL_FLAG(std::string, spec_token_map, "",
          "With --spec-tokens: a file of the token ids the MTP head may draft (a \"hot\" "
          "vocabulary, like SGLang's --speculative-token-map): decimal ids separated by "
          "whitespace or commas (a JSON array of ints works too; '#' starts a comment), each in "
          "the model's vocabulary and listed once. The head then reads only those rows of the "
          "lm_head per draft step (at release scale the whole lm_head is 1.02 GB, most of a "
          "batch-1 head step). Outputs never change: the target verifies every draft over the "
          "whole vocabulary, so a map that lacks the tokens a request needs only lowers the "
          "acceptance rate. Empty (the default): the head drafts over the whole vocabulary.");

namespace mobius::cli {

void ApplyModelRuntimeFlags(worker::HybridModel& model) {
  model.SetDecodeCapture(std::max(0, absl::GetFlag(FLAGS_cuda_graph_max_batch)));
}

absl::StatusOr<int> SpecTokensFromFlags() {
  const int k = absl::GetFlag(FLAGS_spec_tokens);
  if (k < 0 || k > kMaxSpecTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--spec-tokens is ", k, "; it must be in [0, ", kMaxSpecTokens,
        "] (0 turns speculation off; a verify step carries k + 1 tokens a sequence, and an MTP "
        "head's acceptance falls with every position: 1-4 are typical)"));
  }
  if (k == 0 && !absl::GetFlag(FLAGS_spec_token_map).empty()) {
    return absl::InvalidArgumentError(
        "--spec-token-map is set but --spec-tokens is 0: the map only applies to speculative "
        "decoding");
  }
  return k;
}

absl::StatusOr<worker::DraftVocabulary> DraftVocabularyFromFlags(
    const worker::ModelSource& source) {
  const std::string path = absl::GetFlag(FLAGS_spec_token_map);
  if (path.empty()) return worker::DraftVocabulary();
  // Read before the weights load, so that a bad map fails in a second, not after the load; the
  // config alone gives the vocabulary size.
  // A bad config is the model flags' error, not the map's: it goes out without the map's prefix.
  ASSIGN_OR_RETURN(
      const worker::ModelConfig config,
      worker::LoadModelConfig(source.config_path.empty() ? source.model_dir : source.config_path));
  absl::StatusOr<worker::DraftVocabulary> vocabulary =
      worker::DraftVocabulary::Load(path, config.vocab_size);
  if (!vocabulary.ok()) {
    return absl::Status(vocabulary.status().code(),
                        absl::StrCat("--spec-token-map: ", vocabulary.status().message()));
  }
  return vocabulary;
}

absl::StatusOr<std::unique_ptr<worker::MtpDrafter>> MtpDrafterFromFlags(
    const worker::HybridModel& model, int max_sequences, int max_tokens,
    worker::DraftVocabulary vocabulary) {
  ASSIGN_OR_RETURN(const int k, SpecTokensFromFlags());
  if (k == 0) return std::unique_ptr<worker::MtpDrafter>();
  // The head's positions: a sequence's (capped as the engine caps --max-model-len) plus the
  // drafts of one step.
  const int64_t positions =
      std::min<int64_t>(max_tokens, model.config().max_position_embeddings) + k;
  if (positions > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("--spec-tokens ", k, ": ", max_tokens,
                                                   " positions and ", k,
                                                   " drafts exceed what a sequence can address"));
  }
  absl::StatusOr<std::unique_ptr<worker::MtpDrafter>> drafter = worker::MtpDrafter::Create(
      model, max_sequences, static_cast<int>(positions), std::move(vocabulary));
  if (!drafter.ok()) {
    return absl::Status(drafter.status().code(),
                        absl::StrCat("--spec-tokens ", k, ": ", drafter.status().message()));
  }
  return drafter;
}

absl::StatusOr<worker::ModelSource> ModelSourceFromFlags() {
  worker::ModelSource source;
  source.model_dir = absl::GetFlag(FLAGS_model);
  source.config_path = absl::GetFlag(FLAGS_config);
  ASSIGN_OR_RETURN(source.load_format, worker::ParseLoadFormat(absl::GetFlag(FLAGS_load_format)));
  source.seed = absl::GetFlag(FLAGS_seed);
  if (source.model_dir.empty() && source.config_path.empty()) {
    return absl::InvalidArgumentError("--model is required (or --config with --load-format=dummy)");
  }
  return source;
}

absl::StatusOr<std::unique_ptr<kernels::Backend>> BackendFromFlags() {
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device == "cpu") return kernels::CreateCpuBackend(absl::GetFlag(FLAGS_threads));
  if (device == "cuda" || absl::StartsWith(device, "cuda:")) {
#ifdef MOBIUS_HAVE_CUDA
    int ordinal = 0;
    if (device.size() > 5 && !absl::SimpleAtoi(device.substr(5), &ordinal)) {
      return absl::InvalidArgumentError(absl::StrCat("--device \"", device, "\": bad ordinal"));
    }
    return kernels::CreateCudaBackend(ordinal);
#else
    return absl::UnimplementedError(
        "--device=cuda: this build has no CUDA backend (configure where nvcc is available)");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device \"", device, "\" is not supported (use \"cpu\" or \"cuda\")"));
}

}  // namespace mobius::cli
