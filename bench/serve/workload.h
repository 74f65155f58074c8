// The prompts a benchmark sends: random ones of given input/output lengths (vLLM's "random"
// dataset), or the lines of a JSONL file.
#ifndef MOBIUS_BENCH_SERVE_WORKLOAD_H_
#define MOBIUS_BENCH_SERVE_WORKLOAD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mobius::bench {

// One request to send. Exactly one of prompt_ids / prompt_text is the prompt.
struct BenchRequest {
  std::vector<int32_t> prompt_ids;
  std::string prompt_text;
  bool is_text = false;
  int prompt_len = 0;  // tokens; for text an estimate (the server's usage count replaces it)
  int output_len = 0;  // max_tokens
  // Structured output: a JSON Schema (its JSON text) the output must follow; empty: none.
  std::string json_schema;
};

struct RandomWorkloadOptions {
  int num_prompts = 0;
  int input_len = 0;
  int output_len = 0;
  // Lengths are drawn uniformly from [len * (1 - ratio), len * (1 + ratio)], as vLLM's random
  // dataset does; 0 gives every request exactly the given lengths.
  double range_ratio = 0;
  int vocab_size = 2048;  // token ids are drawn from [0, vocab_size)
  bool text = false;      // words of a fixed English list instead of token ids
  uint64_t seed = 0;
};

// InvalidArgument (naming the flag) for lengths < 1, a ratio outside [0, 1) or a vocabulary < 1.
absl::StatusOr<std::vector<BenchRequest>> MakeRandomWorkload(const RandomWorkloadOptions& options);

// The first `num_prompts` lines of a JSONL file (cycled when it has fewer), one object per line:
// "prompt" (a string or an array of token ids) and optionally "max_tokens" or "output_len"
// (else `default_output_len`). Blank lines are skipped; errors name the file and line.
absl::StatusOr<std::vector<BenchRequest>> LoadJsonlWorkload(const std::string& path,
                                                            int num_prompts,
                                                            int default_output_len);

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_WORKLOAD_H_
