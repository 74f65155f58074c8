// `mobius bench serve`: load a running server through the OpenAI streaming API (or one worker
// directly over gRPC) and report vLLM's serving-benchmark metrics. The load generator itself is
// bench/serve/; this file turns flags into its options and prints the results.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/serve/arrival_schedule.h"
#include "bench/serve/load_runner.h"
#include "bench/serve/openai_backend.h"
#include "bench/serve/router_grpc_backend.h"
#include "bench/serve/serve_metrics.h"
#include "bench/serve/serve_report.h"
#include "bench/serve/worker_grpc_backend.h"
#include "bench/serve/workload.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

// Shared with the model commands (cli/model_flags.cc), since absl flags are global to the binary;
// here --model is the served model's name and --seed the seed of prompts and arrival times.
ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(uint64_t, seed);

ABSL_FLAG(std::string, backend, "openai",
          "\"openai\": the OpenAI HTTP API at --base-url --endpoint (through the router); "
          "\"worker-grpc\": mobius.v1.Worker Generate at --worker, bypassing the router; "
          "\"router-grpc\": the router's mobius.v1.Inference Generate at --router (its routing "
          "without the HTTP front end).");
ABSL_FLAG(std::string, base_url, "http://127.0.0.1:8000", "http://HOST:PORT of the OpenAI API.");
ABSL_FLAG(std::string, endpoint, "/v1/completions",
          "\"/v1/completions\" (token-id or text prompts) or \"/v1/chat/completions\" (text "
          "prompts, sent as one user message).");
ABSL_FLAG(std::string, worker, "",
          "HOST:PORT of a worker's gRPC endpoint (--backend worker-grpc).");
ABSL_FLAG(std::string, router, "",
          "HOST:PORT of a router's gRPC endpoint (--backend router-grpc).");
ABSL_FLAG(int, num_prompts, 100, "Requests to time.");
ABSL_FLAG(int, random_input_len, 1024, "Prompt tokens of each random request.");
ABSL_FLAG(int, random_output_len, 128,
          "Output tokens of each random request (max_tokens; ignore_eos makes it exact).");
ABSL_FLAG(double, random_range_ratio, 0,
          "Draw each length uniformly from [len * (1 - r), len * (1 + r)], r in [0, 1).");
ABSL_FLAG(int, vocab_size, 2048,
          "Random token ids are drawn from [0, N). 2048 is the tiny test models' vocabulary and, "
          "with Qwen-family tokenizers, ordinary BPE tokens, so it suits any model of that "
          "family; it must not exceed the served model's vocabulary.");
ABSL_FLAG(std::string, prompt_format, "auto",
          "Random prompts as \"ids\" (token-id arrays: any tokenizer, exact lengths) or \"text\" "
          "(common English words, about one token each; needs the router's --tokenizer). "
          "\"auto\": text for /v1/chat/completions, ids otherwise.");
ABSL_FLAG(std::string, dataset, "",
          "JSONL file instead of random prompts: one object per line with \"prompt\" (a string "
          "or an array of token ids) and optionally \"max_tokens\" or \"output_len\". Cycled "
          "when it has fewer than --num-prompts lines.");
ABSL_FLAG(int, dataset_output_len, 128, "Output tokens of dataset lines that do not give one.");
ABSL_FLAG(double, request_rate, std::numeric_limits<double>::infinity(),
          "Requests per second, sent as a Poisson process (see --burstiness); inf sends them "
          "all at once (then --max-concurrency paces them).");
ABSL_FLAG(double, burstiness, 1,
          "Shape of the gamma-distributed gaps between requests: 1 is Poisson, < 1 burstier, "
          "> 1 more regular; the mean rate stays --request-rate.");
ABSL_FLAG(int, max_concurrency, 0, "Most requests in flight at once (0: no limit).");
ABSL_FLAG(int, warmup, 1,
          "Requests sent (with other prompts of the same shape) before the timed run and left "
          "out of every statistic.");
ABSL_FLAG(std::string, output_json, "", "Also write the results as JSON to this file.");
ABSL_FLAG(std::string, metric_percentiles, "99",
          "Comma-separated percentiles to report for TTFT, TPOT, ITL and E2E latency.");
ABSL_FLAG(double, progress_interval_s, 1, "Seconds between progress lines on stderr (0: none).");
ABSL_FLAG(double, request_timeout_s, 600, "A request still running after this many seconds fails.");
ABSL_FLAG(std::string, json_schema, "",
          "A file holding a JSON Schema that every request's output must follow (structured "
          "output: response_format json_schema over HTTP, SamplingParams.structured_output over "
          "gRPC; the server needs the model's tokenizer). Such an output may end before its "
          "max tokens: once it is a complete value only the end token can follow. Empty: plain "
          "requests.");

namespace mobius::cli {
namespace {

using bench::BenchRequest;

absl::StatusOr<std::vector<double>> ParsePercentiles(const std::string& text) {
  std::vector<double> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    double p;
    if (!absl::SimpleAtod(part, &p) || !(p >= 0 && p <= 100)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metric-percentiles: \"", part, "\" is not a number in [0, 100]"));
    }
    out.push_back(p);
  }
  return out;
}

absl::Status CheckPositive(const char* flag, double value, bool zero_ok = false) {
  if (value > 0 || (zero_ok && value == 0)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be ", zero_ok ? ">= 0" : "> 0", ", got ", value));
}

// The prompts to time and the warm-up prompts (the same shape, other draws).
absl::Status MakeWorkloads(bool worker_grpc, bool chat, std::vector<BenchRequest>& timed,
                           std::vector<BenchRequest>& warmup) {
  const int num_prompts = absl::GetFlag(FLAGS_num_prompts);
  const int num_warmup = absl::GetFlag(FLAGS_warmup);
  const std::string dataset = absl::GetFlag(FLAGS_dataset);
  if (!dataset.empty()) {
    RETURN_IF_ERROR(CheckPositive("dataset-output-len", absl::GetFlag(FLAGS_dataset_output_len)));
    ASSIGN_OR_RETURN(timed, bench::LoadJsonlWorkload(dataset, num_prompts,
                                                     absl::GetFlag(FLAGS_dataset_output_len)));
    ASSIGN_OR_RETURN(std::vector<BenchRequest> lines,
                     bench::LoadJsonlWorkload(dataset, std::max(num_warmup, 1),
                                              absl::GetFlag(FLAGS_dataset_output_len)));
    warmup.assign(lines.begin(), lines.begin() + num_warmup);
  } else {
    const std::string format = absl::GetFlag(FLAGS_prompt_format);
    if (format != "auto" && format != "ids" && format != "text") {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompt-format \"", format, "\" is not one of auto, ids, text"));
    }
    bench::RandomWorkloadOptions options;
    options.num_prompts = num_prompts;
    options.input_len = absl::GetFlag(FLAGS_random_input_len);
    options.output_len = absl::GetFlag(FLAGS_random_output_len);
    options.range_ratio = absl::GetFlag(FLAGS_random_range_ratio);
    options.vocab_size = absl::GetFlag(FLAGS_vocab_size);
    options.text = format == "text" || (format == "auto" && chat);
    options.seed = absl::GetFlag(FLAGS_seed);
    ASSIGN_OR_RETURN(timed, bench::MakeRandomWorkload(options));
    options.num_prompts = num_warmup;
    options.seed = ~options.seed;
    ASSIGN_OR_RETURN(warmup, bench::MakeRandomWorkload(options));
  }
  const std::string schema_path = absl::GetFlag(FLAGS_json_schema);
  if (!schema_path.empty()) {
    std::ifstream in(schema_path);
    if (!in) {
      return absl::InvalidArgumentError(
          absl::StrCat("--json-schema: cannot read \"", schema_path, "\""));
    }
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const nlohmann::json schema = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (schema.is_discarded() || !(schema.is_object() || schema.is_boolean())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--json-schema: \"", schema_path, "\" is not a JSON Schema (a JSON object or boolean)"));
    }
    const std::string compact = schema.dump();
    for (BenchRequest& r : timed) r.json_schema = compact;
    for (BenchRequest& r : warmup) r.json_schema = compact;
  }
  for (const BenchRequest& r : timed) {
    if (worker_grpc && r.is_text) {
      return absl::InvalidArgumentError(
          "--backend worker-grpc takes token-id prompts only (the worker has no tokenizer); use "
          "--prompt-format ids or a dataset of token ids");
    }
    if (chat && !r.is_text) {
      return absl::InvalidArgumentError(
          "--endpoint /v1/chat/completions takes text prompts only; use --prompt-format text or "
          "a dataset of strings");
    }
  }
  return absl::OkStatus();
}

absl::Status BenchServe() {
  const std::string backend_name = absl::GetFlag(FLAGS_backend);
  const bool worker_grpc = backend_name == "worker-grpc";
  const bool router_grpc = backend_name == "router-grpc";
  if (!worker_grpc && !router_grpc && backend_name != "openai") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--backend \"", backend_name, "\" is not one of openai, worker-grpc, router-grpc"));
  }
  const std::string endpoint = absl::GetFlag(FLAGS_endpoint);
  const bool chat = backend_name == "openai" && endpoint.find("/chat/") != std::string::npos;
  RETURN_IF_ERROR(CheckPositive("num-prompts", absl::GetFlag(FLAGS_num_prompts)));
  RETURN_IF_ERROR(CheckPositive("warmup", absl::GetFlag(FLAGS_warmup), /*zero_ok=*/true));
  RETURN_IF_ERROR(
      CheckPositive("max-concurrency", absl::GetFlag(FLAGS_max_concurrency), /*zero_ok=*/true));
  RETURN_IF_ERROR(CheckPositive("request-timeout-s", absl::GetFlag(FLAGS_request_timeout_s)));
  const double progress_interval = absl::GetFlag(FLAGS_progress_interval_s);
  RETURN_IF_ERROR(CheckPositive("progress-interval-s", progress_interval, /*zero_ok=*/true));
  // Arrival settings are checked here so that a bad one stops the run before any request.
  RETURN_IF_ERROR(bench::ArrivalOffsets(0, absl::GetFlag(FLAGS_request_rate),
                                        absl::GetFlag(FLAGS_burstiness), 0)
                      .status());
  ASSIGN_OR_RETURN(std::vector<double> percentiles,
                   ParsePercentiles(absl::GetFlag(FLAGS_metric_percentiles)));
  std::vector<BenchRequest> timed, warmup;
  RETURN_IF_ERROR(MakeWorkloads(worker_grpc, chat, timed, warmup));
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_request_timeout_s));

  std::string model = absl::GetFlag(FLAGS_model);
  std::unique_ptr<bench::RequestBackend> backend;
  if (worker_grpc) {
    ASSIGN_OR_RETURN(backend,
                     bench::WorkerGrpcBackend::Create({absl::GetFlag(FLAGS_worker), timeout}));
  } else if (router_grpc) {
    ASSIGN_OR_RETURN(backend,
                     bench::RouterGrpcBackend::Create({absl::GetFlag(FLAGS_router), timeout}));
  } else {
    bench::OpenAiBackendOptions options;
    options.base_url = absl::GetFlag(FLAGS_base_url);
    options.endpoint = endpoint;
    options.request_timeout = timeout;
    // Checks --base-url and --endpoint before anything is contacted.
    RETURN_IF_ERROR(bench::OpenAiBackend::Create(options).status());
    if (model.empty()) {
      absl::StatusOr<std::string> first =
          bench::FetchFirstModelId(options.base_url, absl::Seconds(10));
      if (first.ok()) {
        model = *first;
      } else {
        // Not fatal: the requests will fail and say why, which is what a benchmark reports.
        std::fprintf(stderr,
                     "bench serve: cannot list the models (%s); sending requests without a "
                     "model name\n",
                     std::string(first.status().message()).c_str());
      }
    }
    options.model = model;
    ASSIGN_OR_RETURN(backend, bench::OpenAiBackend::Create(options));
  }

  bench::LoadOptions load;
  load.request_rate = absl::GetFlag(FLAGS_request_rate);
  load.burstiness = absl::GetFlag(FLAGS_burstiness);
  load.max_concurrency = absl::GetFlag(FLAGS_max_concurrency);
  load.seed = absl::GetFlag(FLAGS_seed);
  load.progress_interval_s = progress_interval;
  const std::string target = worker_grpc ? absl::StrCat("worker ", absl::GetFlag(FLAGS_worker))
                             : router_grpc
                                 ? absl::StrCat("router gRPC ", absl::GetFlag(FLAGS_router))
                                 : absl::StrCat(absl::GetFlag(FLAGS_base_url), endpoint);
  std::fprintf(stderr,
               "bench serve: %s, model \"%s\", %zu prompts, request rate %g/s, max concurrency "
               "%d, %zu warm-up\n",
               target.c_str(), model.c_str(), timed.size(), load.request_rate, load.max_concurrency,
               warmup.size());

  if (!warmup.empty()) {
    bench::LoadOptions warm = load;
    warm.request_rate = std::numeric_limits<double>::infinity();
    warm.progress = nullptr;
    ASSIGN_OR_RETURN(bench::LoadResult result, bench::RunLoad(*backend, warmup, warm));
    int failed = 0;
    std::string reason;
    for (const bench::RequestOutcome& o : result.outcomes) {
      if (!o.success && failed++ == 0) reason = o.error;
    }
    std::fprintf(stderr, "bench serve: warm-up %zu/%zu completed in %.2f s%s%s\n",
                 result.outcomes.size() - failed, result.outcomes.size(), result.duration_s,
                 failed > 0 ? "; first failure: " : "", reason.c_str());
  }
  load.label = "bench serve";
  ASSIGN_OR_RETURN(bench::LoadResult result, bench::RunLoad(*backend, timed, load));
  const bench::ServeMetrics metrics =
      bench::ComputeServeMetrics(result.outcomes, result.duration_s, percentiles);
  std::fputs(bench::FormatServeReport(metrics).c_str(), stdout);
  std::fflush(stdout);

  const std::string json_path = absl::GetFlag(FLAGS_output_json);
  if (!json_path.empty()) {
    const double rate = load.request_rate;
    nlohmann::json settings = {
        {"backend", backend_name},
        {"target", target},
        {"model", model},
        {"num_prompts", timed.size()},
        {"warmup", warmup.size()},
        {"request_rate", std::isinf(rate) ? nlohmann::json("inf") : nlohmann::json(rate)},
        {"burstiness", load.burstiness},
        {"max_concurrency", load.max_concurrency},
        {"seed", load.seed},
        {"dataset", absl::GetFlag(FLAGS_dataset)},
        {"random_input_len", absl::GetFlag(FLAGS_random_input_len)},
        {"random_output_len", absl::GetFlag(FLAGS_random_output_len)},
        {"random_range_ratio", absl::GetFlag(FLAGS_random_range_ratio)},
        {"vocab_size", absl::GetFlag(FLAGS_vocab_size)},
        {"json_schema", absl::GetFlag(FLAGS_json_schema)}};
    std::ofstream out(json_path);
    out << bench::ServeReportJson(metrics, result.outcomes, settings).dump(1) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("--output-json: cannot write ", json_path));
  }
  if (metrics.completed == 0) {
    return absl::UnavailableError("no request completed (see the failure reasons above)");
  }
  return absl::OkStatus();
}

}  // namespace

int RunBenchServeCommand() {
  absl::Status status = BenchServe();
  if (!status.ok()) {
    std::fprintf(stderr, "mobius bench serve: %s\n", std::string(status.message()).c_str());
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}

}  // namespace mobius::cli
