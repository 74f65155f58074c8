// The list of every engine parameter of a model (name, shape, role) and, for each, where its
// values come from in a checkpoint. One description drives loading, dummy initialisation and
// `mobius inspect`, so they cannot disagree.
#ifndef MOBIUS_WORKER_MODEL_PARAMETER_LAYOUT_H_
#define MOBIUS_WORKER_MODEL_PARAMETER_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/tensor.h"
#include "worker/model/model_config.h"
#include "worker/model/model_weights.h"
#include "worker/model/shard_spec.h"

namespace mobius::worker {

// How dummy weights initialise a parameter (see dummy_weights.cc).
enum class ParameterRole {
  kLinear,     // projection matrix: small zero-mean values
  kEmbedding,  // embedding table
  kNorm1p,     // zero-centred RMSNorm1p weight: near 0
  kPlainNorm,  // plain norm weight (DeltaNet gated norm): near 1
  kConv,       // depthwise conv taps
  kALog,       // DeltaNet A_log
  kDtBias,     // DeltaNet dt_bias
  kRouter,     // expert router
};

// What a parameter's bytes are part of; decode-step byte accounting uses it.
enum class ParameterGroup { kDense, kEmbedding, kLmHead, kRoutedExperts, kMtp };

// A run of elements copied from a checkpoint tensor into the parameter: `repeat` runs of
// `count` elements, the j-th from source_offset + j * source_stride to target_offset +
// j * target_stride (strided runs express a rank's columns of a row-parallel matrix).
struct CheckpointPiece {
  std::string tensor;                 // checkpoint tensor name
  std::vector<int64_t> tensor_shape;  // the shape that tensor must have
  int64_t source_offset = 0;          // in elements
  int64_t count = 0;                  // elements
  int64_t target_offset = 0;          // in elements of the parameter
  int64_t repeat = 1;
  int64_t source_stride = 0;
  int64_t target_stride = 0;
};

// Part of the unsharded parameter: `repeat` runs of `count` elements, the j-th starting at
// full_offset + j * full_stride (flat element offsets of the unsharded parameter).
struct SliceRun {
  int64_t full_offset = 0;
  int64_t count = 0;
  int64_t repeat = 1;
  int64_t full_stride = 0;
};

// One way to assemble the parameter from checkpoint tensors; a parameter may have several
// (e.g. fused vs per-expert experts, Mobius vs Qwen3-Next DeltaNet projections).
struct CheckpointLayout {
  std::vector<CheckpointPiece> pieces;
};

struct ParameterSpec {
  std::string name;                 // engine name, e.g. "layers.3.attention.q_proj"
  std::vector<int64_t> shape;       // what this rank holds
  std::vector<int64_t> full_shape;  // the unsharded parameter (== shape when not sharded)
  // The elements of the unsharded parameter this rank holds, back to back in this order;
  // empty when it holds all of them. Checkpoint layouts already describe only these elements.
  std::vector<SliceRun> slice;
  ParameterRole role = ParameterRole::kLinear;
  ParameterGroup group = ParameterGroup::kDense;
  int bank = -1;                          // for routed experts: the bank
  Tensor* target = nullptr;               // where it lives in ModelWeights (null when listing only)
  std::vector<CheckpointLayout> layouts;  // preferred first

  [[nodiscard]] int64_t numel() const;
};

struct LayoutOptions {
  bool include_mtp = false;
  // Prefix of language-model tensors: "model.language_model." (Mobius) or "model.".
  std::string prefix;
  // The rank's shard (shard_spec.h): each spec then describes only this rank's slice. It must be
  // valid for the config (ComputeShardDims). The MTP head is not sharded.
  ShardSpec shard;
};

// Every parameter of `config`. When `weights` is non-null, its layer/bank vectors are sized and
// each spec's `target` points at the tensor to fill (lm_head is omitted when tied). The list has
// the same parameters in the same order for every shard.
std::vector<ParameterSpec> ListParameters(const ModelConfig& config, const LayoutOptions& options,
                                          ModelWeights* weights);

// The default tensor prefix of a family ("model.language_model." or "model.").
std::string DefaultTensorPrefix(const ModelConfig& config);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_PARAMETER_LAYOUT_H_
