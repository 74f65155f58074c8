// `mobius bench engine`: decode-step time and prefill throughput of the engine at release
// shapes (dummy weights work), each beside its bounds from the performance model
// (docs/performance-model.md): bytes per step over the memory bandwidth, and FLOPs per step over
// the matrix rate, both measured in the same run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/bench_speculation.h"
#include "cli/commands.h"
#include "cli/matrix_rate_probe.h"
#include "cli/model_flags.h"
#include "cli/replica_flags.h"
#include "common/parallel_ranges.h"
#include "common/status_macros.h"
#include "kernels/token_sampling.h"
#include "nlohmann/json.hpp"
#include "worker/model/decode_cost.h"
#include "worker/model/hybrid_model.h"

ABSL_FLAG(std::string, batches, "1,8,64,256", "Decode batch sizes to time (comma-separated).");
ABSL_FLAG(std::string, contexts, "1024,8192",
          "Context lengths (tokens already cached per sequence) for the decode timings.");
ABSL_FLAG(std::string, prefill_lengths, "1024,8192",
          "Prompt lengths (comma-separated) for prefill throughput.");
ABSL_FLAG(int, steps, 10, "Timed decode steps per configuration (after 3 warm-up steps).");
ABSL_FLAG(double, hbm_bandwidth_override, 0,
          "Bytes/s to use for the bytes bound instead of measuring it (0: measure with a 2 GiB "
          "device copy; the CPU backend has no device memory to measure, so there 4.27e12, the "
          "H200 figure, is assumed, and with it the H200's matrix rate).");
ABSL_FLAG(double, matrix_rate_override, 0,
          "FLOP/s to use for the FLOP bound instead of measuring it (0: measure with an "
          "[8192, 8192] x [8192, 8192]^T bf16 product through the backend's Linear, best of "
          "three rounds of ten; where the bandwidth is assumed or the product cannot run, "
          "7.99e14, the H200 figure, is assumed).");
ABSL_FLAG(std::string, json_out, "", "Also write the results as JSON to this file.");
ABSL_FLAG(std::string, draw, "",
          "Also time each decode step with its next tokens drawn and on the host, one line per "
          "mode (comma-separated): \"greedy\" (argmax on the device), \"device\" "
          "(Backend::SampleRows at temperature 0.8, top-k 50, top-p 0.95), \"host\" (the "
          "[batch, vocab] fp32 logits copied to the host and drawn there by the same rule, rows "
          "spread over up to 16 threads as the engine does), \"penalized\" (\"device\" with "
          "each row's repetition 1.1, frequency 0.5 and presence 0.3 penalties over 1000 seen "
          "tokens applied first by Backend::PenalizeRows), \"penalized-host\" (the same on the "
          "host, after the logits' copy), \"logprobs\" (\"device\" with each row's 5 best "
          "tokens and logits for top-n logprobs, Backend::TopLogitsRows), \"masked\" (greedy under "
          "a structured-output mask, Backend::PenalizeRows then SampleRows: each row allows "
          "146,930 of the first 151,669 ids (every 32nd out), a JSON string's set with the Qwen3 "
          "tokenizer, and none past them). Empty: the model step alone.");

namespace mobius::cli {
namespace {

absl::StatusOr<std::vector<int>> ParseList(const std::string& flag, const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int v;
    if (!absl::SimpleAtoi(part, &v) || v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": \"", part, "\" is not a positive integer"));
    }
    out.push_back(v);
  }
  return out;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// What the run's bounds divide by. A replica of W ranks streams its bytes from W GPUs and
// multiplies on W GPUs: its bounds assume a perfect split (the replicated router, norms,
// embedding and lm_head make the real one a little higher).
struct Ceilings {
  double bandwidth = 0;    // bytes/s of one device
  double matrix_rate = 0;  // FLOP/s of one device
  int world = 1;
};

// A row's bytes and FLOPs from the performance model, and its bounds on this run's ceilings.
struct RowCost {
  double bytes = 0;
  double flops = 0;
  worker::StepBound bound;
};

RowCost CostOf(const worker::ModelConfig& config, const worker::DecodeCostOptions& cost,
               const Ceilings& ceilings) {
  const worker::DecodeStepBytes bytes = worker::EstimateDecodeStepBytes(config, cost);
  const worker::DecodeStepFlops flops = worker::EstimateDecodeStepFlops(config, cost);
  return {bytes.total(), flops.total(),
          worker::BoundStep(bytes, flops, ceilings.bandwidth * ceilings.world,
                            ceilings.matrix_rate * ceilings.world)};
}

// One row of the table: time, the three bounds, then `experts` (touched per layer, or blank),
// tokens/s and the roofline as a share of the time.
void PrintRow(const std::string& phase, int batch, int context, double step_s,
              const worker::StepBound& bound, const std::string& experts, double tokens) {
  std::printf("%-15s %6d %8d %9.3f ms %9.3f ms %9.3f ms %9.3f ms %14s %10.0f %9.0f%%\n",
              phase.c_str(), batch, context, step_s * 1e3, bound.bytes * 1e3, bound.flops * 1e3,
              bound.serial * 1e3, experts.c_str(), tokens / step_s,
              100 * bound.roofline() / step_s);
}

// The bytes, FLOPs and bounds as JSON fields of a result.
void AddCost(nlohmann::json& result, const RowCost& row) {
  const worker::StepBound& bound = row.bound;
  result["bytes"] = row.bytes;
  result["flops"] = row.flops;
  result["bound_ms"] = bound.roofline() * 1e3;
  result["bytes_bound_ms"] = bound.bytes * 1e3;
  result["flops_bound_ms"] = bound.flops * 1e3;
  result["serial_bound_ms"] = bound.serial * 1e3;
}

// After a row (stderr): which of its shapes did not record and why, and what the recorded
// steps' memory pool holds (the largest recording sizes it; the memory plan leaves room for it;
// the CPU backend has none).
void ReportRecordings(const worker::HybridModel& model, kernels::Backend& backend,
                      const std::string& after) {
  for (const auto& [sequences, tokens] : model.unrecordable_shapes()) {
    std::fprintf(stderr,
                 "bench: %s: steps of %d sequences x %d tokens ran op by op: their recording ran "
                 "out of device memory\n",
                 after.c_str(), sequences, tokens);
  }
  if (model.decode_capture_max_batch() == 0 && !model.capture_error().ok()) {
    std::fprintf(stderr, "bench: %s: recording stopped: %s\n", after.c_str(),
                 std::string(model.capture_error().message()).c_str());
  }
  absl::StatusOr<kernels::DeviceMemoryInfo> info = backend.MemoryInfo();
  if (!info.ok() || info->recorded_step_bytes == 0) return;
  std::fprintf(stderr,
               "bench: after %s, recorded steps hold %.1f MiB (largest recording %.1f MiB)\n",
               after.c_str(), info->recorded_step_bytes / 1048576.0,
               info->recorded_step_peak_bytes / 1048576.0);
}

absl::StatusOr<std::vector<std::string>> ParseDrawModes(const std::string& text) {
  std::vector<std::string> modes;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    if (part != "greedy" && part != "device" && part != "host" && part != "penalized" &&
        part != "penalized-host" && part != "logprobs" && part != "masked") {
      return absl::InvalidArgumentError(
          absl::StrCat("--draw: \"", part,
                       "\" is not a draw mode (greedy, device, host, penalized, penalized-host, "
                       "logprobs or masked)"));
    }
    modes.emplace_back(part);
  }
  return modes;
}

// `mobius bench engine --draw host`: every row of `logits` drawn on the host under its rule, rows
// spread over up to 16 threads, two or more each (as Engine::SampleRows spreads a step's rows).
// With `penalties` (one per row), each row is penalised first, in place.
void DrawOnHost(std::vector<float>& logits, std::span<const kernels::SamplingRule> rules,
                std::span<const kernels::LogitPenalties> penalties,
                std::span<const double> uniforms, std::vector<kernels::DrawnToken>& out) {
  const size_t rows = rules.size();
  const size_t vocab = rows > 0 ? logits.size() / rows : 0;
  out.resize(rows);
  auto draw = [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      const std::span<float> row = std::span<float>(logits).subspan(r * vocab, vocab);
      if (!penalties.empty()) kernels::ApplyLogitPenalties(row, penalties[r]);
      out[r] = kernels::DrawToken(row, rules[r], uniforms[r]);
    }
  };
  ForEachRangeInParallel(rows, 16, 2, draw);
}

absl::Status BenchEngine() {
  ASSIGN_OR_RETURN(std::vector<int> batches, ParseList("batches", absl::GetFlag(FLAGS_batches)));
  ASSIGN_OR_RETURN(std::vector<int> contexts, ParseList("contexts", absl::GetFlag(FLAGS_contexts)));
  ASSIGN_OR_RETURN(std::vector<int> prefills,
                   ParseList("prefill_lengths", absl::GetFlag(FLAGS_prefill_lengths)));
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  ASSIGN_OR_RETURN(const std::vector<std::string> draw_modes,
                   ParseDrawModes(absl::GetFlag(FLAGS_draw)));
  ASSIGN_OR_RETURN(const int spec_tokens, SpecTokensFromFlags());
  ASSIGN_OR_RETURN(worker::ModelSource source, ModelSourceFromFlags());
  ASSIGN_OR_RETURN(const worker::DraftVocabulary draft_vocabulary,
                   DraftVocabularyFromFlags(source));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, BackendFromFlags());
  // With --world-size > 1 this process is one rank of a replica: rank 0 runs the command, the
  // others follow its steps until it stops them.
  ASSIGN_OR_RETURN(ReplicaRank replica, JoinReplicaForCommand(source, *backend));

  double bandwidth = absl::GetFlag(FLAGS_hbm_bandwidth_override);
  double matrix_rate = absl::GetFlag(FLAGS_matrix_rate_override);
  if (bandwidth < 0 || matrix_rate < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--hbm-bandwidth-override is %g and --matrix-rate-override is %g; each must be positive "
        "(or 0: measure)",
        bandwidth, matrix_rate));
  }
  std::string bandwidth_source = "given";
  bool bandwidth_assumed = false;
  if (bandwidth <= 0) {
    auto measured = backend->MeasureCopyBandwidth(size_t{2} << 30);
    if (measured.ok()) {
      bandwidth = *measured;
      bandwidth_source = "measured (2 GiB device copy)";
    } else {
      bandwidth = 4.27e12;
      bandwidth_source = "assumed (H200)";
      bandwidth_assumed = true;
    }
  }
  std::fprintf(stderr, "bench: backend %s, memory bandwidth %.2f TB/s %s\n",
               backend->name().c_str(), bandwidth / 1e12, bandwidth_source.c_str());
  std::string matrix_rate_source = "given";
  if (matrix_rate <= 0 && bandwidth_assumed) {
    // Both ceilings of one machine: a CPU's FLOP rate beside an H200's bandwidth would bound
    // nothing real.
    matrix_rate = 7.99e14;
    matrix_rate_source = "assumed (H200 bf16, as the bandwidth)";
  } else if (matrix_rate <= 0) {
    // Before the model loads, while its memory is free.
    absl::StatusOr<MatrixRate> probe = MeasureMatrixRate(*backend, 8192, 10);
    if (probe.ok()) {
      matrix_rate = probe->flops_per_second;
      matrix_rate_source = absl::StrFormat(
          "measured ([%d, %d] x [%d, %d]^T %s Linear, %.3f ms)", probe->dim, probe->dim, probe->dim,
          probe->dim, std::string(kernels::DTypeName(backend->activation_dtype())).c_str(),
          probe->per_call_s * 1e3);
    } else {
      // As for the bandwidth: the H200's figure, with the reason the probe could not run.
      matrix_rate = 7.99e14;
      matrix_rate_source =
          absl::StrCat("assumed (H200 bf16; the probe failed: ", probe.status().message(), ")");
    }
  }
  std::fprintf(stderr, "bench: matrix rate %.1f TFLOP/s %s\n", matrix_rate / 1e12,
               matrix_rate_source.c_str());
  std::fprintf(stderr, "bench: loading the model...\n");
  const auto t_load = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(std::unique_ptr<worker::HybridModel> model,
                   worker::LoadHybridModel(source, *backend));
  ApplyModelRuntimeFlags(*model);
  RETURN_IF_ERROR(AttachReplica(*model, replica));
  if (!replica.leader()) return worker::FollowLeader(*model, *replica.comm);
  absl::Cleanup stop_replica = [&] { StopReplica(*model, replica); };
  std::fprintf(stderr, "bench: model ready in %.1f s\n",
               Seconds(t_load, std::chrono::steady_clock::now()));
  const worker::ModelConfig& config = model->config();
  const int world = source.shard.world_size();
  if (world > 1) {
    std::fprintf(stderr,
                 "bench: rank 0 of a replica of %d ranks; bounds are the replica's bytes and "
                 "FLOPs over %d GPUs' bandwidth and matrix rate\n",
                 world, world);
  }
  const Ceilings ceilings{bandwidth, matrix_rate, world};

  nlohmann::json results = nlohmann::json::array();
  std::map<std::pair<int, int>, double> plain_ms;  // (batch, context) -> decode step
  std::printf("%-15s %6s %8s %12s %12s %12s %12s %14s %10s %10s\n", "phase", "batch", "context",
              "time/step", "bytes bound", "FLOP bound", "serial bound", "experts/layer", "tokens/s",
              "of bound");
  for (int context : contexts) {
    for (int batch : batches) {
      // Positions past the model's range are an error of the step; say so per configuration and
      // time the others.
      // Each timed configuration (the step alone, then each --draw mode) advances the sequences
      // by its 3 warm-up and `steps` timed tokens.
      const int64_t extra = int64_t{steps + 3} * (1 + static_cast<int64_t>(draw_modes.size())) + 5;
      const int64_t positions = int64_t{context} + extra;
      if (positions > config.max_position_embeddings) {
        std::printf(
            "%-15s %6d %8d   skipped: context + %d positions of the warm-up and timed steps "
            "exceeds max_position_embeddings (%lld)\n",
            "decode", batch, context, static_cast<int>(extra),
            static_cast<long long>(config.max_position_embeddings));
        continue;
      }
      model->DropCaches();
      absl::Status caches = model->CreateCaches(batch, static_cast<int>(positions));
      if (!caches.ok()) {
        std::printf("%-15s %6d %8d   skipped: %s\n", "decode", batch, context,
                    std::string(caches.message()).c_str());
        continue;
      }
      // Sequences start as if `context` tokens were already cached: the KV blocks are reserved
      // (their contents do not change the time), the DeltaNet state is a fresh slot.
      std::vector<worker::SequenceCache> seqs(batch);
      bool ok = true;
      for (auto& s : seqs) {
        ok = ok && model->StartSequence(s).ok() && model->kv_cache()->Reserve(s, context).ok();
        s.num_tokens = context;
      }
      if (!ok) {
        std::printf("%-15s %6d %8d   skipped: caches too small\n", "decode", batch, context);
        continue;
      }
      std::vector<int32_t> tokens(batch);
      for (int i = 0; i < batch; ++i) {
        tokens[i] = static_cast<int32_t>((int64_t{i} * 7919 + 13) % config.vocab_size);
      }
      std::vector<worker::SequenceStep> step;
      for (int i = 0; i < batch; ++i) step.push_back({std::span(&tokens[i], 1), &seqs[i]});
      std::vector<float> logits;
      // Count the experts this batch actually touches (one counted step), then time.
      std::vector<std::vector<int64_t>> expert_tokens(config.num_hidden_layers);
      worker::ForwardOptions counted;
      counted.expert_tokens = &expert_tokens;
      RETURN_IF_ERROR(model->Forward(step, counted, logits));
      // (Under expert parallelism the counts are summed over the ranks by the model.)
      const double touched_per_layer = worker::MeanDistinctExperts(expert_tokens);
      // The logits stay on the device: the step is the model's forward pass (what the bound
      // counts), not the host copy of [batch, vocab] floats.
      worker::ForwardOptions timed;
      timed.copy_logits = false;
      for (int w = 0; w < 3; ++w) RETURN_IF_ERROR(model->Forward(step, timed, logits));
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < steps; ++s) RETURN_IF_ERROR(model->Forward(step, timed, logits));
      const double per_step = Seconds(t0, std::chrono::steady_clock::now()) / steps;
      worker::DecodeCostOptions cost;
      cost.batch = batch;
      cost.context = context;
      cost.weight_bytes = backend->activation_dtype() == kernels::DType::kF32 ? 4 : 2;
      cost.kv_bytes = cost.weight_bytes;
      cost.distinct_experts = touched_per_layer;
      const RowCost row = CostOf(config, cost, ceilings);
      PrintRow("decode", batch, context, per_step, row.bound,
               absl::StrFormat("%.1f", touched_per_layer), batch);
      plain_ms[{batch, context}] = per_step * 1e3;
      // The same step with its next tokens drawn and copied to the host (--draw).
      const std::vector<kernels::SamplingRule> rules(batch, kernels::SamplingRule{0.8f, 50, 0.95f});
      std::vector<double> uniforms(batch);
      for (int i = 0; i < batch; ++i) uniforms[i] = (i + 0.5) / batch;
      // --draw penalized: each row has seen 1000 distinct tokens, a third of them in its output.
      constexpr int kSeen = 1000;
      std::vector<int32_t> seen_tokens, seen_counts;
      std::vector<kernels::LogitPenalties> penalties;
      if (std::find_if(draw_modes.begin(), draw_modes.end(), [](const std::string& m) {
            return m.starts_with("penalized");
          }) != draw_modes.end()) {
        seen_tokens.resize(static_cast<size_t>(batch) * kSeen);
        seen_counts.resize(seen_tokens.size());
        for (int i = 0; i < batch; ++i) {
          for (int j = 0; j < kSeen; ++j) {
            seen_tokens[i * kSeen + j] =
                static_cast<int32_t>((int64_t{i} * 31 + int64_t{j} * 97) % config.vocab_size);
            seen_counts[i * kSeen + j] = j % 3 == 0 ? 1 + j % 4 : 0;
          }
          penalties.push_back({1.1f,
                               0.5f,
                               0.3f,
                               std::span<const int32_t>(seen_tokens).subspan(i * kSeen, kSeen),
                               std::span<const int32_t>(seen_counts).subspan(i * kSeen, kSeen),
                               {},
                               {}});
        }
      }
      // --draw masked: a JSON string's mask with the Qwen3 tokenizer (151,669 ids, ~4.7K of
      // them not allowed there: every 32nd here), the model's padded ids past them banned.
      constexpr int kMaskedVocab = 151669;
      std::vector<uint64_t> string_mask(static_cast<size_t>((config.vocab_size + 63) / 64), 0);
      for (int t = 0; t < std::min(kMaskedVocab, config.vocab_size); ++t) {
        if (t % 32 != 31) string_mask[static_cast<size_t>(t) / 64] |= uint64_t{1} << (t % 64);
      }
      const std::vector<kernels::SamplingRule> greedy_rules(batch, kernels::SamplingRule{0.0f});
      std::vector<kernels::LogitPenalties> masks(batch);
      for (kernels::LogitPenalties& m : masks) m.allowed_mask = string_mask;
      const std::vector<int32_t> top_counts(batch, 5);
      std::vector<kernels::TokenLogit> top_logits;
      std::vector<float> drawn_logits;
      for (const std::string& mode : draw_modes) {
        worker::ForwardOptions drawn;
        std::vector<int32_t> greedy;
        std::vector<kernels::DrawnToken> sampled;
        if (mode == "greedy") {
          drawn.greedy_tokens = &greedy;
        } else if (mode == "device" || mode == "penalized" || mode == "logprobs" ||
                   mode == "masked") {
          drawn.sampled_tokens = &sampled;
          drawn.sampling_rules = mode == "masked" ? greedy_rules : rules;
          drawn.sampling_uniforms = uniforms;
          if (mode == "penalized") drawn.sampling_penalties = penalties;
          if (mode == "masked") drawn.sampling_penalties = masks;
          if (mode == "logprobs") {
            drawn.top_logits_counts = top_counts;
            drawn.top_logits = &top_logits;
            drawn.drawn_logits = &drawn_logits;
          }
        }
        auto draw_step = [&]() -> absl::Status {
          RETURN_IF_ERROR(model->Forward(step, drawn, logits));
          if (mode == "host") DrawOnHost(logits, rules, {}, uniforms, sampled);
          if (mode == "penalized-host") DrawOnHost(logits, rules, penalties, uniforms, sampled);
          return absl::OkStatus();
        };
        for (int w = 0; w < 3; ++w) RETURN_IF_ERROR(draw_step());
        const auto d0 = std::chrono::steady_clock::now();
        for (int s = 0; s < steps; ++s) RETURN_IF_ERROR(draw_step());
        const double with_draw = Seconds(d0, std::chrono::steady_clock::now()) / steps;
        PrintRow("+" + mode, batch, context, with_draw, row.bound, "", batch);
        nlohmann::json drawn_result = {{"phase", "decode_draw"},
                                       {"draw", mode},
                                       {"batch", batch},
                                       {"context", context},
                                       {"step_ms", with_draw * 1e3}};
        AddCost(drawn_result, row);
        results.push_back(std::move(drawn_result));
      }
      const bool graphs = model->HasRecording(batch, 1);
      ReportRecordings(*model, *backend, absl::StrFormat("decode batch %d", batch));
      nlohmann::json result = {{"phase", "decode"},
                               {"cuda_graph", graphs},
                               {"batch", batch},
                               {"context", context},
                               {"step_ms", per_step * 1e3},
                               {"experts_touched_per_layer", touched_per_layer}};
      AddCost(result, row);
      results.push_back(std::move(result));
      for (auto& s : seqs) model->ReleaseSequence(s);
    }
  }
  if (spec_tokens > 0) {
    for (int context : contexts) {
      for (int batch : batches) {
        SpeculationBenchOptions spec;
        spec.max_spec_tokens = spec_tokens;
        spec.batch = batch;
        spec.context = context;
        spec.steps = steps;
        spec.bandwidth = bandwidth;
        spec.world = world;
        spec.draft_vocabulary = draft_vocabulary.ids();
        auto it = plain_ms.find({batch, context});
        if (it != plain_ms.end()) spec.plain_step_ms = it->second;
        absl::Status benched = BenchSpeculation(*model, spec, results);
        ReportRecordings(*model, *backend, absl::StrFormat("speculative batch %d", batch));
        if (!benched.ok()) {
          std::printf("speculative batch %d context %d skipped: %s\n", batch, context,
                      std::string(benched.message()).c_str());
        }
      }
    }
  }
  for (int length : prefills) {
    if (int64_t{length} > config.max_position_embeddings) {
      std::printf("%-15s %6d %8d   skipped: exceeds max_position_embeddings (%lld)\n", "prefill", 1,
                  length, static_cast<long long>(config.max_position_embeddings));
      continue;
    }
    model->DropCaches();
    absl::Status caches = model->CreateCaches(1, length + 1);
    if (!caches.ok()) {
      std::printf("%-15s %6d %8d   skipped: %s\n", "prefill", 1, length,
                  std::string(caches.message()).c_str());
      continue;
    }
    std::vector<int32_t> prompt(length);
    for (int i = 0; i < length; ++i) {
      prompt[i] = static_cast<int32_t>((int64_t{i} * 104729 + 7) % config.vocab_size);
    }
    double best = 1e30;
    for (int r = 0; r < 3; ++r) {
      worker::SequenceCache seq;
      RETURN_IF_ERROR(model->StartSequence(seq));
      worker::SequenceStep step{prompt, &seq};
      std::vector<float> logits;
      worker::ForwardOptions timed;
      timed.copy_logits = false;
      const auto t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(model->Forward(std::span(&step, 1), timed, logits));
      if (r > 0) best = std::min(best, Seconds(t0, std::chrono::steady_clock::now()));
      model->ReleaseSequence(seq);
    }
    // A long prefill touches (nearly) every expert of every bank in every MoE layer.
    worker::DecodeCostOptions cost;
    cost.batch = length;
    cost.sequences = 1;
    cost.weight_bytes = backend->activation_dtype() == kernels::DType::kF32 ? 4 : 2;
    const RowCost row = CostOf(config, cost, ceilings);
    PrintRow("prefill", 1, length, best, row.bound, "-", length);
    nlohmann::json result = {{"phase", "prefill"},
                             {"tokens", length},
                             {"time_ms", best * 1e3},
                             {"tokens_per_s", length / best}};
    AddCost(result, row);
    results.push_back(std::move(result));
  }
  const std::string json_path = absl::GetFlag(FLAGS_json_out);
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", json_path));
    const std::string text = nlohmann::json({{"bandwidth", bandwidth},
                                             {"bandwidth_source", bandwidth_source},
                                             {"matrix_rate", matrix_rate},
                                             {"matrix_rate_source", matrix_rate_source},
                                             {"backend", backend->name()},
                                             {"world_size", world},
                                             {"tp", source.shard.tp_size},
                                             {"ep", source.shard.ep_size},
                                             {"results", results}})
                                 .dump(1);
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchCommand(const std::vector<std::string>& args) {
  if (args.size() != 1 || args[0] != "engine") {
    std::fprintf(stderr, "usage: mobius bench engine [flags]  (see mobius bench --help)\n");
    return 2;
  }
  absl::Status status = BenchEngine();
  if (!status.ok()) {
    std::fprintf(stderr, "mobius bench engine: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace mobius::cli
