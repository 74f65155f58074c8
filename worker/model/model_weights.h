// The engine's parameters of one model, in the engine's own layout (independent of how a
// checkpoint names or packs them), as backend tensors.
#ifndef MOBIUS_WORKER_MODEL_MODEL_WEIGHTS_H_
#define MOBIUS_WORKER_MODEL_MODEL_WEIGHTS_H_

#include <optional>
#include <vector>

#include "kernels/tensor.h"
#include "worker/model/model_config.h"

namespace mobius::worker {

using kernels::Tensor;

// Gated DeltaNet mixer. The Qwen3-Next interleaved projections are de-interleaved on load.
struct DeltaNetWeights {
  Tensor in_proj_qkv;  // [conv_dim, H]: q heads, then k heads, then v heads
  Tensor in_proj_z;    // [value_dim, H]
  Tensor in_proj_b;    // [Hv, H]
  Tensor in_proj_a;    // [Hv, H]
  Tensor conv1d;       // [conv_dim, K]
  Tensor a_log;        // [Hv]
  Tensor dt_bias;      // [Hv]
  Tensor norm;         // [Dv], plain weight
  Tensor out_proj;     // [H, value_dim]
};

// Gated full attention mixer.
struct AttentionWeights {
  Tensor q_proj;  // [nh * 2 * hd, H], per head: query rows then gate rows
  Tensor k_proj;  // [nkv * hd, H]
  Tensor v_proj;  // [nkv * hd, H]
  Tensor o_proj;  // [H, nh * hd]
  Tensor q_norm;  // [hd]
  Tensor k_norm;  // [hd]
};

// SwiGLU MLP with gate and up fused: the shared expert of a layer, or a dense MLP layer.
struct SwiGluWeights {
  Tensor gate_up;  // [2I, H], gate rows first
  Tensor down;     // [H, I]
};

// One bank of routed experts (Mobius: shared by every layer i with i % num_blocks == bank).
struct ExpertBankWeights {
  Tensor router;   // [E, H]
  Tensor gate_up;  // [E, 2I, H]
  Tensor down;     // [E, H, I]
};

struct LayerWeights {
  Tensor input_norm;  // [H]
  Tensor post_norm;   // [H]
  std::optional<DeltaNetWeights> linear;
  std::optional<AttentionWeights> attention;
  SwiGluWeights shared_expert;  // or the dense MLP of a kDense layer
  Tensor shared_expert_gate;    // [1, H]; empty for a dense layer
};

// Multi-token-prediction draft head (loaded when the checkpoint has it; used by speculative
// decoding).
struct MtpWeights {
  Tensor fc;                     // [H, 2H]
  Tensor pre_fc_norm_embedding;  // [H]
  Tensor pre_fc_norm_hidden;     // [H]
  Tensor norm;                   // [H]
  LayerWeights layer;            // full attention + its own MoE
  ExpertBankWeights experts;
};

struct ModelWeights {
  Tensor embed;       // [V, H]
  Tensor final_norm;  // [H]
  Tensor lm_head;     // [V, H]; the embedding itself when tied
  std::vector<LayerWeights> layers;
  std::vector<ExpertBankWeights> banks;  // indexed by ModelConfig::BankOfLayer
  std::optional<MtpWeights> mtp;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_MODEL_WEIGHTS_H_
