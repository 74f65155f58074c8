#include "worker/model/decode_cost.h"

#include <algorithm>
#include <cmath>

namespace mobius::worker {

DecodeStepBytes EstimateDecodeStepBytes(const ModelConfig& c, const DecodeCostOptions& o) {
  DecodeStepBytes bytes;
  const double H = c.hidden_size, wb = o.weight_bytes, B = o.batch;
  double dense_params = 0;
  int moe_layers = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    dense_params += 2 * H;  // input and post-mixer norms
    if (c.layer_types[i] == LayerType::kLinearAttention) {
      const double Hv = c.linear_num_value_heads;
      dense_params += c.conv_dim() * H + c.value_dim() * H + 2 * Hv * H;  // in projections
      dense_params += c.conv_dim() * c.linear_conv_kernel_dim + 2 * Hv +
                      c.linear_value_head_dim;  // conv, A, dt, norm
      dense_params += H * c.value_dim();        // out_proj
    } else {
      const double nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
      dense_params += (2 * nh * hd + 2 * nkv * hd) * H + H * nh * hd + 2 * hd;
    }
    if (c.mlp_types[i] == MlpType::kMoe) {
      ++moe_layers;
      dense_params += 3.0 * c.shared_expert_intermediate_size * H + H;  // shared expert + gate
      dense_params += double(c.num_experts) * H;                        // router
    } else {
      dense_params += 3.0 * c.intermediate_size * H;
    }
  }
  dense_params += H;  // final norm
  bytes.dense_weights = dense_params * wb;
  bytes.lm_head = double(c.vocab_size) * H * wb;
  bytes.embedding_rows = B * H * wb;

  if (moe_layers > 0) {
    const double E = c.num_experts, k = c.num_experts_per_tok;
    bytes.distinct_experts_per_layer = o.distinct_experts > 0
                                           ? std::min(o.distinct_experts, E)
                                           : E * (1.0 - std::pow(1.0 - k / E, B));
    const double expert_bytes = 3.0 * c.moe_intermediate_size * H * wb;
    bytes.routed_experts = moe_layers * bytes.distinct_experts_per_layer * expert_bytes;
  }

  const int attention_layers = c.num_layers_of(LayerType::kFullAttention);
  const double kv_per_token =
      2.0 * c.num_key_value_heads * c.head_dim * o.kv_bytes * attention_layers;
  bytes.kv_cache = B * (o.context + 1) * kv_per_token;

  const int linear_layers = c.num_layers_of(LayerType::kLinearAttention);
  const double state =
      double(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim +
      double(c.conv_dim()) * (c.linear_conv_kernel_dim - 1);
  const double sequences = o.sequences > 0 ? o.sequences : B;
  bytes.recurrent_state = sequences * linear_layers * state * o.state_bytes * 2;  // read + write
  return bytes;
}

double MeanDistinctExperts(const std::vector<std::vector<int64_t>>& expert_tokens) {
  double touched = 0;
  int moe_layers = 0;
  for (const auto& layer : expert_tokens) {
    if (layer.empty()) continue;
    ++moe_layers;
    for (int64_t n : layer) touched += n > 0;
  }
  return moe_layers > 0 ? touched / moe_layers : 0;
}

}  // namespace mobius::worker
