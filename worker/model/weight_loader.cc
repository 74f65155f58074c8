#include "worker/model/weight_loader.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/model/parameter_layout.h"

namespace mobius::worker {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The first layout whose tensors are all present, or an error naming what is missing from
// the preferred one.
absl::StatusOr<const CheckpointLayout*> ChooseLayout(const ParameterSpec& spec,
                                                     const Checkpoint& checkpoint) {
  for (const CheckpointLayout& layout : spec.layouts) {
    bool complete = true;
    for (const CheckpointPiece& piece : layout.pieces) {
      if (!checkpoint.Find(piece.tensor)) {
        complete = false;
        break;
      }
    }
    if (complete) return &layout;
  }
  std::string missing;
  for (const CheckpointPiece& piece : spec.layouts.front().pieces) {
    if (!checkpoint.Find(piece.tensor)) {
      missing = piece.tensor;
      break;
    }
  }
  std::string alternatives;
  if (spec.layouts.size() > 1 && !spec.layouts[1].pieces.empty()) {
    alternatives = absl::StrCat(" (nor its alternative layout, e.g. \"",
                                spec.layouts[1].pieces.front().tensor, "\")");
  }
  return absl::NotFoundError(absl::StrCat("checkpoint ", checkpoint.dir(), ": missing tensor \"",
                                          missing, "\"", alternatives, ", needed for parameter ",
                                          spec.name));
}

absl::Status ValidatePiece(const CheckpointPiece& piece, const TensorRecord& record) {
  if (record.shape != piece.tensor_shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        record.file, ": tensor \"", piece.tensor, "\" has shape ", ShapeString(record.shape),
        " but the config implies ", ShapeString(piece.tensor_shape)));
  }
  switch (record.dtype) {
    case kernels::DType::kBF16:
    case kernels::DType::kF16:
    case kernels::DType::kF32:
      return absl::OkStatus();
    case kernels::DType::kI32:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      record.file, ": tensor \"", piece.tensor, "\" has dtype ",
      std::string(kernels::DTypeName(record.dtype)), "; weights must be BF16, F16 or F32"));
}

absl::Status AllocateTargets(std::vector<ParameterSpec>& specs, kernels::Backend& backend) {
  for (ParameterSpec& spec : specs) {
    auto tensor = backend.Allocate(backend.activation_dtype(), spec.shape);
    if (!tensor.ok()) {
      return absl::Status(tensor.status().code(),
                          absl::StrCat("allocating parameter ", spec.name, " ",
                                       ShapeString(spec.shape), ": ", tensor.status().message()));
    }
    *spec.target = *std::move(tensor);
  }
  return absl::OkStatus();
}

void FinishTiedHead(const ModelConfig& config, ModelWeights& weights) {
  if (config.tie_word_embeddings) weights.lm_head = weights.embed;
}

// Copies one (possibly strided) piece into the parameter `flat`. Strided runs are gathered on the
// host first so that each piece is one upload.
void CopyPiece(const CheckpointPiece& piece, const TensorRecord& record, kernels::Tensor& flat,
               kernels::Backend& backend) {
  const size_t elem = kernels::DTypeSize(record.dtype);
  const char* src = static_cast<const char*>(static_cast<const void*>(record.data));
  if (piece.repeat == 1) {
    kernels::Tensor dst = flat.Rows(piece.target_offset, piece.count);
    backend.CopyFromHost(src + piece.source_offset * elem, record.dtype, dst);
    return;
  }
  if (piece.target_stride != piece.count) {
    for (int64_t j = 0; j < piece.repeat; ++j) {
      kernels::Tensor dst = flat.Rows(piece.target_offset + j * piece.target_stride, piece.count);
      backend.CopyFromHost(src + (piece.source_offset + j * piece.source_stride) * elem,
                           record.dtype, dst);
    }
    return;
  }
  const size_t run_bytes = static_cast<size_t>(piece.count) * elem;
  std::vector<char> staged(run_bytes * piece.repeat);
  for (int64_t j = 0; j < piece.repeat; ++j) {
    std::memcpy(staged.data() + j * run_bytes,
                src + (piece.source_offset + j * piece.source_stride) * elem, run_bytes);
  }
  kernels::Tensor dst = flat.Rows(piece.target_offset, piece.count * piece.repeat);
  backend.CopyFromHost(staged.data(), record.dtype, dst);
}

}  // namespace

absl::StatusOr<ModelWeights> LoadCheckpointWeights(const ModelConfig& config,
                                                   const Checkpoint& checkpoint,
                                                   kernels::Backend& backend,
                                                   const ShardSpec& shard,
                                                   WeightSelection selection) {
  RETURN_IF_ERROR(ComputeShardDims(config, shard).status());
  LayoutOptions options;
  options.shard = shard;
  options.prefix = DefaultTensorPrefix(config);
  // Text-only exports of Mobius keep the language model directly under "model.".
  if (!checkpoint.Find(options.prefix + "embed_tokens.weight") &&
      checkpoint.Find("model.embed_tokens.weight")) {
    options.prefix = "model.";
  }
  options.include_mtp = config.mtp_num_hidden_layers == 1 && checkpoint.Find("mtp.fc.weight");

  ModelWeights weights;
  std::vector<ParameterSpec> specs = ListParameters(config, options, &weights);
  if (selection == WeightSelection::kRoutedExperts) {
    std::erase_if(specs, [](const ParameterSpec& spec) {
      return spec.group != ParameterGroup::kRoutedExperts;
    });
  }
  // Validate everything before allocating anything, so a bad checkpoint fails fast.
  std::vector<const CheckpointLayout*> layouts;
  layouts.reserve(specs.size());
  for (const ParameterSpec& spec : specs) {
    ASSIGN_OR_RETURN(const CheckpointLayout* layout, ChooseLayout(spec, checkpoint));
    for (const CheckpointPiece& piece : layout->pieces) {
      RETURN_IF_ERROR(ValidatePiece(piece, *checkpoint.Find(piece.tensor)));
    }
    layouts.push_back(layout);
  }
  RETURN_IF_ERROR(AllocateTargets(specs, backend));
  for (size_t i = 0; i < specs.size(); ++i) {
    kernels::Tensor flat = specs[i].target->Reshape({specs[i].numel()});
    for (const CheckpointPiece& piece : layouts[i]->pieces) {
      CopyPiece(piece, *checkpoint.Find(piece.tensor), flat, backend);
    }
  }
  if (selection == WeightSelection::kAll) FinishTiedHead(config, weights);
  return weights;
}

}  // namespace mobius::worker
