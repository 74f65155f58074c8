#include "worker/model/mtp_draft_model.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace mobius::worker {

ModelConfig MtpDraftConfig(const ModelConfig& target) {
  ModelConfig c = target;
  c.num_hidden_layers = 1;
  c.layer_types = {LayerType::kFullAttention};
  c.mlp_types = {MlpType::kMoe};
  c.num_experts = target.mtp_num_experts;
  c.num_experts_per_tok = target.mtp_num_experts_per_tok;
  c.num_blocks = 1;  // BankOfLayer(0) == 0: the head's own MoE
  c.mtp_num_hidden_layers = 0;
  return c;
}

absl::StatusOr<std::unique_ptr<HybridModel>> MakeMtpDraftModel(
    const HybridModel& target, std::span<const int32_t> draft_vocabulary) {
  const ModelWeights& tw = target.weights();
  if (!tw.mtp.has_value()) {
    return absl::FailedPreconditionError(
        "the model has no MTP draft head (no mtp.* tensors were loaded; Qwen3-Next fixtures and "
        "checkpoints without mtp.fc.weight have none)");
  }
  if (target.config().mtp_num_hidden_layers != 1) {
    return absl::UnimplementedError(
        absl::StrFormat("mtp_num_hidden_layers is %d; the draft head supports exactly 1",
                        target.config().mtp_num_hidden_layers));
  }
  // On a rank of a sharded replica the head is still whole: the MTP tensors, the embedding and
  // lm_head are replicated on every rank (MODEL.md section 7), so the leader runs it alone.
  ModelWeights w;
  w.embed = tw.embed;
  w.lm_head = tw.lm_head;
  const int vocab = target.config().vocab_size;
  // Every id listed: the whole lm_head, shared, rather than a second copy of it.
  if (!draft_vocabulary.empty() && static_cast<int64_t>(draft_vocabulary.size()) < vocab) {
    // The gather takes vocabulary ids as rows: right for the whole lm_head every rank holds
    // today, wrong for a vocabulary-parallel shard of it.
    if (tw.lm_head.rank() != 2 || tw.lm_head.dim(0) != vocab) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "a draft vocabulary needs the whole lm_head (%d rows); this model holds %d", vocab,
          tw.lm_head.rank() >= 1 ? tw.lm_head.dim(0) : 0));
    }
    for (size_t i = 0; i < draft_vocabulary.size(); ++i) {
      const int32_t id = draft_vocabulary[i];
      if (id < 0 || id >= vocab || (i > 0 && id <= draft_vocabulary[i - 1])) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "draft vocabulary entry %d is token %d: ids must be ascending, distinct and in "
            "[0, %d)",
            i, id, vocab));
      }
    }
    kernels::Backend& backend = target.backend();
    const int64_t rows = static_cast<int64_t>(draft_vocabulary.size());
    absl::StatusOr<kernels::Tensor> kept =
        backend.Allocate(tw.lm_head.dtype(), {rows, tw.lm_head.dim(1)});
    if (!kept.ok()) {
      return absl::Status(kept.status().code(),
                          absl::StrFormat("draft vocabulary of %d tokens: lm_head rows: %s", rows,
                                          kept.status().message()));
    }
    backend.GatherRows(tw.lm_head, draft_vocabulary, *kept);
    w.lm_head = *std::move(kept);
  }
  w.final_norm = tw.mtp->norm;
  w.layers = {tw.mtp->layer};
  w.banks = {tw.mtp->experts};
  w.mtp = tw.mtp;
  return std::make_unique<HybridModel>(MtpDraftConfig(target.config()), std::move(w),
                                       target.backend());
}

}  // namespace mobius::worker
