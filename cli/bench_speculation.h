// `mobius bench engine --spec-tokens K`: what speculative decoding costs and buys on this device.
// For each k = 1..K it times the verify forward of k + 1 tokens per sequence against a plain
// decode step (writing the states to each sequence's spare slot, as the engine does), the MTP
// head's k draft steps and, on a rejection, the rollback (replaying the accepted tokens' state
// updates onto the slot the verify step only read), and prints the time
// per output token at every acceptance length a = 1..k + 1 (a tokens emitted per step), for
// greedy requests (the rows' argmax on the device), and the verify step of sampled requests
// (rows copied to the host and verified there).
#ifndef MOBIUS_CLI_BENCH_SPECULATION_H_
#define MOBIUS_CLI_BENCH_SPECULATION_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "worker/model/hybrid_model.h"

namespace mobius::cli {

struct SpeculationBenchOptions {
  int max_spec_tokens = 0;  // K
  int batch = 1;
  int context = 1024;
  int steps = 10;             // timed calls per measurement (after warm-up)
  double bandwidth = 0;       // bytes/s, for the bounds
  int world = 1;              // ranks whose bandwidth the bound may use
  double plain_step_ms = -1;  // the plain decode step at this batch/context, when measured
  // The head's draft vocabulary (--spec-token-map; empty: the whole vocabulary).
  std::span<const int32_t> draft_vocabulary;
};

// Appends one JSON object per (k, acceptance length) to `results` and prints a table.
absl::Status BenchSpeculation(worker::HybridModel& model, const SpeculationBenchOptions& options,
                              nlohmann::json& results);

}  // namespace mobius::cli

#endif  // MOBIUS_CLI_BENCH_SPECULATION_H_
