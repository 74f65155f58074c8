#include "worker/model/decode_cost.h"

#include <algorithm>
#include <cmath>

namespace mobius::worker {

namespace {

// The weights every token of a step uses (all but the routed experts' and the embedding's):
// those of matrix products, and the rest (norms, conv, gate parameters).
struct DenseParams {
  double matmul = 0;
  double other = 0;
  int moe_layers = 0;
};

DenseParams CountDenseParams(const ModelConfig& c) {
  DenseParams p;
  const double H = c.hidden_size;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    p.other += 2 * H;  // input and post-mixer norms
    if (c.layer_types[i] == LayerType::kLinearAttention) {
      const double Hv = c.linear_num_value_heads;
      p.matmul += c.conv_dim() * H + c.value_dim() * H + 2 * Hv * H;  // in projections
      p.other += c.conv_dim() * c.linear_conv_kernel_dim + 2 * Hv +
                 c.linear_value_head_dim;  // conv, A, dt, norm
      p.matmul += H * c.value_dim();       // out_proj
    } else {
      const double nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
      p.matmul += (2 * nh * hd + 2 * nkv * hd) * H + H * nh * hd;
      p.other += 2 * hd;  // q and k norms
    }
    if (c.mlp_types[i] == MlpType::kMoe) {
      ++p.moe_layers;
      p.matmul += 3.0 * c.shared_expert_intermediate_size * H + H;  // shared expert + gate
      p.matmul += double(c.num_experts) * H;                        // router
    } else {
      p.matmul += 3.0 * c.intermediate_size * H;
    }
  }
  p.other += H;  // final norm
  return p;
}

}  // namespace

DecodeStepBytes EstimateDecodeStepBytes(const ModelConfig& c, const DecodeCostOptions& o) {
  DecodeStepBytes bytes;
  const double H = c.hidden_size, wb = o.weight_bytes, B = o.batch;
  const DenseParams dense = CountDenseParams(c);
  const double dense_params = dense.matmul + dense.other;
  const int moe_layers = dense.moe_layers;
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

DecodeStepFlops EstimateDecodeStepFlops(const ModelConfig& c, const DecodeCostOptions& o) {
  DecodeStepFlops flops;
  const double H = c.hidden_size, B = o.batch;
  const DenseParams dense = CountDenseParams(c);
  flops.dense_projections = 2 * B * dense.matmul;
  const double sequences = o.sequences > 0 ? o.sequences : B;
  const double rows = o.logits_rows > 0 ? o.logits_rows : sequences;
  flops.lm_head = 2 * rows * double(c.vocab_size) * H;
  flops.routed_experts =
      2 * B * dense.moe_layers * double(c.num_experts_per_tok) * 3.0 * c.moe_intermediate_size * H;
  // Each sequence's n = B / S new tokens see its context and the step's tokens up to their own:
  // n C + n (n + 1) / 2 (query, position) pairs.
  const double n = B / sequences;
  const double seen = sequences * (n * o.context + n * (n + 1) / 2);
  flops.attention =
      4.0 * c.num_layers_of(LayerType::kFullAttention) * c.num_attention_heads * c.head_dim * seen;
  flops.delta_rule = 7.0 * B * c.num_layers_of(LayerType::kLinearAttention) *
                     c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
  return flops;
}

StepBound BoundStep(const DecodeStepBytes& bytes, const DecodeStepFlops& flops, double bandwidth,
                    double matrix_rate) {
  StepBound bound;
  if (bandwidth <= 0 || matrix_rate <= 0) return bound;
  bound.bytes = bytes.total() / bandwidth;
  bound.flops = flops.total() / matrix_rate;
  auto part = [&](double b, double f) { return std::max(b / bandwidth, f / matrix_rate); };
  bound.serial =
      part(bytes.dense_weights + bytes.embedding_rows, flops.dense_projections) +
      part(bytes.lm_head, flops.lm_head) + part(bytes.routed_experts, flops.routed_experts) +
      part(bytes.kv_cache, flops.attention) + part(bytes.recurrent_state, flops.delta_rule);
  return bound;
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
