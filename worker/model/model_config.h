// The language-model configuration of the Intern-S2-Mobius family, read from a Hugging Face
// `config.json` in either layout: nested Mobius (`text_config`) or flat Qwen3-Next.
#ifndef MOBIUS_WORKER_MODEL_MODEL_CONFIG_H_
#define MOBIUS_WORKER_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mobius::worker {

enum class ModelFamily {
  kInternS2Mobius,  // routed experts in num_blocks banks shared across layers
  kQwen3Next,       // one MoE per layer
};

enum class LayerType { kLinearAttention, kFullAttention };

// What follows the mixer in a layer. Qwen3-Next may declare dense layers (`mlp_only_layers`,
// `decoder_sparse_step`); every Mobius layer uses a bank.
enum class MlpType { kMoe, kDense };

struct ModelConfig {
  ModelFamily family = ModelFamily::kInternS2Mobius;
  std::string model_type;

  int hidden_size = 0;
  int num_hidden_layers = 0;
  std::vector<LayerType> layer_types;
  std::vector<MlpType> mlp_types;

  // Gated full attention.
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 0.25;

  // Gated DeltaNet.
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel_dim = 0;

  // Experts.
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  int shared_expert_intermediate_size = 0;
  int intermediate_size = 0;  // dense MLP layers (Qwen3-Next only)
  int num_blocks = 0;         // expert banks; Qwen3-Next: one per layer
  bool norm_topk_prob = true;

  float rms_norm_eps = 1e-6f;
  int vocab_size = 0;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;

  // MTP draft head (0 layers: none).
  int mtp_num_hidden_layers = 0;
  int mtp_num_experts = 0;
  int mtp_num_experts_per_tok = 0;

  // The bank that serves layer `layer`: layer % num_blocks for Mobius, the layer itself for
  // Qwen3-Next. Only meaningful for MoE layers.
  [[nodiscard]] int BankOfLayer(int layer) const { return layer % num_blocks; }
  [[nodiscard]] int key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  [[nodiscard]] int value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  [[nodiscard]] int conv_dim() const { return 2 * key_dim() + value_dim(); }
  [[nodiscard]] int rotary_dim() const;
  [[nodiscard]] int num_layers_of(LayerType type) const;
  [[nodiscard]] bool has_linear_attention() const {
    return num_layers_of(LayerType::kLinearAttention) > 0;
  }
};

// Loads `<path>/config.json` when `path` is a directory, else `path` itself. Errors name the
// file and the missing or inconsistent field.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// Parses the text of a config.json; `source` names it in error messages.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_MODEL_CONFIG_H_
