// `mobius inspect`: what a model is, how big it is, what one decode step must read, and what
// one sequence's prefill must read and compute.
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "cli/model_flags.h"
#include "common/status_macros.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/decode_cost.h"
#include "worker/model/model_config.h"
#include "worker/model/parameter_layout.h"

ABSL_FLAG(bool, tensors, true, "List every engine parameter with its shape and source tensor.");
ABSL_FLAG(int, context, 0,
          "Tokens already cached per sequence when estimating the bytes of a decode step.");
ABSL_FLAG(double, hbm_bandwidth, 4.27e12,
          "Memory bandwidth in bytes/s used to turn decode-step bytes into a time bound (the "
          "4.27 TB/s measured on an H200).");
ABSL_FLAG(double, matrix_rate, 7.99e14,
          "Matrix rate in FLOP/s used to turn a step's FLOPs into a time bound (the bf16 rate "
          "`mobius bench engine` measures on an H200, 799 TFLOP/s).");
ABSL_FLAG(std::string, prefill_tokens, "1024,8192",
          "Prompt lengths (comma-separated) for the table of one sequence's prefill: its bytes, "
          "FLOPs and bounds (`mobius bench engine --prefill-lengths` times the same prompts); "
          "empty: no table.");

namespace mobius::cli {
namespace {

std::string Gb(double bytes) { return absl::StrFormat("%.3f GB", bytes / 1e9); }

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

const char* FamilyName(worker::ModelFamily f) {
  return f == worker::ModelFamily::kQwen3Next ? "Qwen3-Next" : "Intern-S2-Mobius";
}

absl::Status Inspect() {
  for (const auto& [name, value] :
       {std::pair<const char*, double>{"--hbm-bandwidth", absl::GetFlag(FLAGS_hbm_bandwidth)},
        std::pair<const char*, double>{"--matrix-rate", absl::GetFlag(FLAGS_matrix_rate)}}) {
    if (!(value > 0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s is %g; it must be a positive rate", name, value));
    }
  }
  std::vector<int> prefill_tokens;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_prefill_tokens), ',', absl::SkipWhitespace())) {
    int tokens = 0;
    if (!absl::SimpleAtoi(part, &tokens) || tokens <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prefill-tokens: \"", part, "\" is not a positive integer"));
    }
    prefill_tokens.push_back(tokens);
  }
  std::string model_dir = absl::GetFlag(FLAGS_model);
  const std::string config_path = absl::GetFlag(FLAGS_config);
  if (model_dir.empty() && config_path.empty()) {
    return absl::InvalidArgumentError("--model DIR (or --config FILE) is required");
  }
  ASSIGN_OR_RETURN(worker::ModelConfig c,
                   worker::LoadModelConfig(config_path.empty() ? model_dir : config_path));

  std::printf("model: %s (%s)\n", FamilyName(c.family), c.model_type.c_str());
  std::printf("  hidden %d, layers %d (%d gated DeltaNet, %d gated attention), vocab %d\n",
              c.hidden_size, c.num_hidden_layers,
              c.num_layers_of(worker::LayerType::kLinearAttention),
              c.num_layers_of(worker::LayerType::kFullAttention), c.vocab_size);
  std::string pattern;
  for (auto t : c.layer_types) pattern += t == worker::LayerType::kFullAttention ? 'A' : 'D';
  std::printf("  layer pattern (D = DeltaNet, A = attention): %s\n", pattern.c_str());
  if (c.num_layers_of(worker::LayerType::kFullAttention) > 0) {
    std::printf("  attention: %d q heads, %d kv heads, head dim %d, rotary dim %d, theta %g\n",
                c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim(),
                c.rope_theta);
  }
  if (c.has_linear_attention()) {
    std::printf("  DeltaNet: %d key heads x %d, %d value heads x %d, conv kernel %d\n",
                c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads,
                c.linear_value_head_dim, c.linear_conv_kernel_dim);
  }
  if (c.num_experts > 0) {
    std::printf("  experts: %d banks x %d experts, top-%d, intermediate %d, shared expert %d%s\n",
                c.family == worker::ModelFamily::kQwen3Next ? c.num_hidden_layers : c.num_blocks,
                c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
                c.family == worker::ModelFamily::kInternS2Mobius ? " (bank of layer i = i % banks)"
                                                                 : " (one bank per layer)");
  }
  if (c.mtp_num_hidden_layers > 0) {
    std::printf("  MTP draft head: %d layer(s), %d experts, top-%d\n", c.mtp_num_hidden_layers,
                c.mtp_num_experts, c.mtp_num_experts_per_tok);
  }

  // Parameters, as the engine holds them (bf16 on the GPU).
  worker::LayoutOptions options;
  options.prefix = worker::DefaultTensorPrefix(c);
  options.include_mtp = true;
  std::vector<worker::ParameterSpec> specs = worker::ListParameters(c, options, nullptr);
  double total = 0, experts = 0, mtp = 0;
  for (const auto& s : specs) {
    const double n = static_cast<double>(s.numel());
    if (s.group == worker::ParameterGroup::kMtp) {
      mtp += n;
      continue;
    }
    total += n;
    if (s.group == worker::ParameterGroup::kRoutedExperts) experts += n;
  }
  std::printf(
      "\nparameters: %.3f B with the MTP head (%s in bf16); main model %.3f B, of which routed "
      "experts %.3f B; MTP head %.3f B (a vision tower is not counted)\n",
      (total + mtp) / 1e9, Gb((total + mtp) * 2).c_str(), total / 1e9, experts / 1e9, mtp / 1e9);

  if (!model_dir.empty()) {
    auto checkpoint = worker::Checkpoint::Open(model_dir);
    if (checkpoint.ok()) {
      std::set<std::string> used;
      for (const auto& s : specs) {
        for (const auto& layout : s.layouts) {
          for (const auto& piece : layout.pieces) used.insert(piece.tensor);
        }
      }
      int unused = 0;
      for (const std::string& name : (*checkpoint)->Names()) unused += !used.count(name);
      std::printf(
          "checkpoint: %zu tensors, %s on disk; %d not used by the engine (vision tower "
          "and the like)\n",
          (*checkpoint)->Names().size(), Gb((*checkpoint)->total_bytes()).c_str(), unused);
    } else {
      std::printf("checkpoint: none readable (%s)\n",
                  std::string(checkpoint.status().message()).c_str());
    }
  }

  // What one decode step reads, at a few batch sizes.
  std::printf(
      "\nbytes read per decode step (bf16 weights and KV, fp32 DeltaNet state, context "
      "%d, uniform routing; serial: each kind of work at its own limit at %.0f TFLOP/s, in "
      "sequence):\n",
      absl::GetFlag(FLAGS_context), absl::GetFlag(FLAGS_matrix_rate) / 1e12);
  std::printf("  %6s %10s %10s %10s %10s %10s %12s %10s %12s %12s\n", "batch", "dense", "lm_head",
              "experts", "exp/layer", "kv", "state", "total", "bound@HBM", "serial");
  for (int batch : {1, 8, 64, 256}) {
    worker::DecodeCostOptions o;
    o.batch = batch;
    o.context = absl::GetFlag(FLAGS_context);
    const worker::DecodeStepBytes b = worker::EstimateDecodeStepBytes(c, o);
    const worker::StepBound bound =
        worker::BoundStep(b, worker::EstimateDecodeStepFlops(c, o),
                          absl::GetFlag(FLAGS_hbm_bandwidth), absl::GetFlag(FLAGS_matrix_rate));
    std::printf("  %6d %10s %10s %10s %10.1f %10s %12s %10s %9.3f ms %9.3f ms\n", batch,
                Gb(b.dense_weights).c_str(), Gb(b.lm_head).c_str(), Gb(b.routed_experts).c_str(),
                b.distinct_experts_per_layer, Gb(b.kv_cache).c_str(), Gb(b.recurrent_state).c_str(),
                Gb(b.total()).c_str(), bound.bytes * 1e3, bound.serial * 1e3);
  }

  // What one sequence's prefill reads and computes: a long prompt touches every expert of every
  // bank (bandwidth-bound) and multiplies 2 x its tokens x the dense weights (compute-bound).
  // An empty --prefill-tokens leaves the table out.
  if (!prefill_tokens.empty()) {
    std::printf(
        "\nprefill of one sequence (one logits row; bounds at %.2f TB/s and %.0f TFLOP/s; serial: "
        "each kind of work at its own limit, in sequence):\n",
        absl::GetFlag(FLAGS_hbm_bandwidth) / 1e12, absl::GetFlag(FLAGS_matrix_rate) / 1e12);
    std::printf("  %7s %10s %10s %10s %10s %10s %12s %12s %12s\n", "tokens", "bytes", "dense",
                "experts", "attention", "all", "bytes bound", "FLOP bound", "serial bound");
    for (int tokens : prefill_tokens) {
      worker::DecodeCostOptions o;
      o.batch = tokens;
      o.sequences = 1;
      const worker::DecodeStepBytes b = worker::EstimateDecodeStepBytes(c, o);
      const worker::DecodeStepFlops f = worker::EstimateDecodeStepFlops(c, o);
      const worker::StepBound bound = worker::BoundStep(b, f, absl::GetFlag(FLAGS_hbm_bandwidth),
                                                        absl::GetFlag(FLAGS_matrix_rate));
      std::printf("  %7d %10s %7.1f TF %7.1f TF %7.1f TF %7.1f TF %9.3f ms %9.3f ms %9.3f ms\n",
                  tokens, Gb(b.total()).c_str(), f.dense_projections / 1e12,
                  f.routed_experts / 1e12, f.attention / 1e12, f.total() / 1e12, bound.bytes * 1e3,
                  bound.flops * 1e3, bound.serial * 1e3);
    }
  }

  if (absl::GetFlag(FLAGS_tensors)) {
    std::printf("\nengine parameters (%zu):\n", specs.size());
    for (const auto& s : specs) {
      const auto& first = s.layouts.front().pieces.front().tensor;
      std::printf("  %-44s %-22s <- %s%s\n", s.name.c_str(), ShapeString(s.shape).c_str(),
                  first.c_str(), s.layouts.front().pieces.size() > 1 ? " (+ more pieces)" : "");
    }
  }
  return absl::OkStatus();
}

}  // namespace

int RunInspectCommand() {
  absl::Status status = Inspect();
  if (!status.ok()) {
    std::fprintf(stderr, "mobius inspect: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace mobius::cli
