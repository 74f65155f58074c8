// mobius-router: the client-facing front of a Mobius deployment. Serves mobius.v1.Inference and
// grpc.health.v1.Health over gRPC (and the OpenAI-compatible HTTP API with --http-port), and
// spreads requests over the worker replicas given by --worker.
// SIGTERM/SIGINT drain: health turns NOT_SERVING, new requests get UNAVAILABLE, requests in flight
// finish (up to --drain-timeout-s), the servers stop, and the process exits 0.
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/flag_spelling.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "router/core/grpc_inference_service.h"
#include "router/core/replica_set.h"
#include "router/core/router_metrics.h"
#include "router/core/router_service.h"
#include "tokenizer/tokenizer.h"
#ifdef MOBIUS_ROUTER_WITH_HTTP
#include "router/http/openai_http_server.h"
#endif

ABSL_FLAG(std::vector<std::string>, worker, {},
          "Worker replica to send requests to, as HOST:PORT of its mobius.v1.Worker endpoint (the "
          "replica's leader rank). Repeat the flag or separate addresses with commas; at least "
          "one is required.");
ABSL_FLAG(std::string, host, "0.0.0.0", "Address the gRPC and HTTP servers listen on.");
ABSL_FLAG(int, grpc_port, 50050,
          "Port of the gRPC server (mobius.v1.Inference and grpc.health.v1.Health); 0 picks a "
          "free port.");
ABSL_FLAG(int, http_port, 0,
          "Port of the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
          "/v1/models, /health, /metrics); 0 turns it off.");
ABSL_FLAG(std::string, tokenizer, "",
          "Directory holding the served model's tokenizer.json (usually the model directory). "
          "Required for text prompts, text output, stop strings, Tokenize and the HTTP API; "
          "without it, requests must carry input_ids and get token ids back with empty text.");
ABSL_FLAG(std::string, served_model_name, "",
          "Model name reported by GetModelInfo and /v1/models, and the only `model` the HTTP API "
          "accepts (default: the name the workers report).");
ABSL_FLAG(int, max_queued_requests, 1024,
          "Requests in flight at once (streaming or waiting at a worker); more get "
          "RESOURCE_EXHAUSTED (HTTP 429) with a retry hint.");
ABSL_FLAG(int, health_check_interval_ms, 200,
          "How often each worker gets a health check and a load query; a worker that fails one "
          "gets no new requests until it passes again.");
ABSL_FLAG(int, request_timeout_s, 0,
          "Longest time one request may take, in seconds; 0 leaves only the client's deadline.");
ABSL_FLAG(int, drain_timeout_s, 600,
          "On SIGTERM, how long requests in flight may take to finish before the router exits.");

ABSL_FLAG(std::string, reasoning_parser, "",
          "Reasoning output of chat answers: \"qwen3\" returns an answer's <think>...</think> "
          "block as the message's reasoning_content (vLLM's field), the rest as its content; \"\" "
          "(default) returns the text as the model wrote it.");

namespace mobius::router {
namespace {

absl::Status Run() {
  std::vector<std::string> workers = absl::GetFlag(FLAGS_worker);
  std::erase(workers, std::string());
  if (workers.empty()) {
    return absl::InvalidArgumentError("--worker is required: pass the HOST:PORT of each replica");
  }
  std::unique_ptr<const tokenizer::Tokenizer> tok;
  const std::string tokenizer_dir = absl::GetFlag(FLAGS_tokenizer);
  if (!tokenizer_dir.empty()) {
    ASSIGN_OR_RETURN(tok, tokenizer::Tokenizer::FromDirectory(tokenizer_dir));
  } else {
    MOBIUS_LOG(WARNING, "router", "")
        << "no --tokenizer: only input_ids requests are served, and output has no text";
  }

  ReplicaSetOptions replica_options;
  replica_options.health_check_interval =
      absl::Milliseconds(absl::GetFlag(FLAGS_health_check_interval_ms));
  replica_options.health_check_timeout =
      std::max(absl::Milliseconds(500), replica_options.health_check_interval);
  ASSIGN_OR_RETURN(std::unique_ptr<ReplicaSet> replicas,
                   ReplicaSet::Create(workers, replica_options));
  // Declared before the service, which owns the replicas it reads: scrapes stop (the HTTP server
  // is shut down) before either goes away.
  RouterMetrics metrics(replicas.get());

  const std::string reasoning_parser = absl::GetFlag(FLAGS_reasoning_parser);
  if (!reasoning_parser.empty() && reasoning_parser != "qwen3") {
    return absl::InvalidArgumentError(absl::StrCat("--reasoning-parser=", reasoning_parser,
                                                   " is not known: use qwen3, or leave it empty"));
  }

  RouterOptions options;
  options.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  options.request_timeout = absl::Seconds(absl::GetFlag(FLAGS_request_timeout_s));
  options.served_model_name = absl::GetFlag(FLAGS_served_model_name);
  options.metrics = &metrics;
  if (options.max_queued_requests <= 0) {
    return absl::InvalidArgumentError("--max-queued-requests must be positive");
  }
  RouterService service(std::move(replicas), std::move(tok), options);

  // Block the termination signals in every thread; main waits for them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  GrpcServerOptions grpc_options;
  grpc_options.host = absl::GetFlag(FLAGS_host);
  grpc_options.port = absl::GetFlag(FLAGS_grpc_port);
  grpc_options.on_generate_done = [&metrics](absl::StatusCode code) {
    metrics.RequestFinished("grpc", code);
  };
  ASSIGN_OR_RETURN(std::unique_ptr<GrpcFrontEnd> grpc_server,
                   GrpcFrontEnd::Start(service, grpc_options));
  MOBIUS_LOG(INFO, "router", "") << "gRPC on port " << grpc_server->port() << ", workers "
                                 << absl::StrJoin(workers, ",");

#ifdef MOBIUS_ROUTER_WITH_HTTP
  std::unique_ptr<OpenAiHttpServer> http_server;
  if (absl::GetFlag(FLAGS_http_port) > 0) {
    HttpServerOptions http_options;
    http_options.host = absl::GetFlag(FLAGS_host);
    http_options.port = absl::GetFlag(FLAGS_http_port);
    http_options.served_model_name = options.served_model_name;
    http_options.metrics = &metrics;
    http_options.parse_reasoning = reasoning_parser == "qwen3";
    http_options.on_generate_done = [&metrics](absl::StatusCode code) {
      metrics.RequestFinished("http", code);
    };
    ASSIGN_OR_RETURN(http_server, OpenAiHttpServer::Start(service, http_options));
    MOBIUS_LOG(INFO, "router", "") << "HTTP on port " << http_server->port();
  }
#else
  if (absl::GetFlag(FLAGS_http_port) > 0) {
    return absl::UnimplementedError("this mobius-router was built without the HTTP front end");
  }
#endif

  int signal = 0;
  sigwait(&signals, &signal);
  MOBIUS_LOG(INFO, "router", "") << "signal " << signal << ": draining " << service.in_flight()
                                 << " requests";
  service.StartDrain();
  grpc_server->SetDraining();
  const absl::Time deadline = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  if (!service.WaitUntilIdle(deadline)) {
    MOBIUS_LOG(WARNING, "router", "")
        << "drain timeout: cancelling " << service.in_flight() << " requests";
  }
#ifdef MOBIUS_ROUTER_WITH_HTTP
  if (http_server) http_server->Shutdown(absl::Seconds(1));
#endif
  grpc_server->Shutdown(absl::Now() + absl::Seconds(1));
  MOBIUS_LOG(INFO, "router", "") << "drained; exiting";
  return absl::OkStatus();
}

// absl keeps only the last value of a repeated flag: fold every --worker into one list.
std::vector<std::string> MergeWorkerFlags(std::vector<std::string> args) {
  std::vector<std::string> out;
  std::vector<std::string> workers;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      out.insert(out.end(), args.begin() + i, args.end());
      break;
    }
    if (a == "--worker" || a == "-worker") {
      if (i + 1 < args.size()) workers.push_back(args[++i]);
      continue;
    }
    if (absl::StartsWith(a, "--worker=") || absl::StartsWith(a, "-worker=")) {
      workers.push_back(a.substr(a.find('=') + 1));
      continue;
    }
    out.push_back(a);
  }
  if (!workers.empty()) out.insert(out.begin(), "--worker=" + absl::StrJoin(workers, ","));
  return out;
}

}  // namespace
}  // namespace mobius::router

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "mobius-router: the client API of a Mobius deployment (gRPC mobius.v1.Inference, optional "
      "OpenAI-compatible HTTP); routes requests to worker replicas by least outstanding tokens.\n"
      "\nusage: mobius-router --worker HOST:PORT [--worker HOST:PORT ...] --tokenizer DIR "
      "[flags]");
  mobius::ListFlagsOfFilesInHelp({"router_main.cc"});
  const std::vector<std::string> positional = mobius::ParseFlags(
      argv[0], mobius::router::MergeWorkerFlags(mobius::NormalizeFlagSpelling(argc, argv, 1)));
  if (!positional.empty()) {
    std::fprintf(stderr, "mobius-router: unexpected argument \"%s\"\n", positional[0].c_str());
    return 2;
  }
  absl::Status status = mobius::router::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "mobius-router: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
