// mobius-worker: one engine process serving mobius.v1.Worker and grpc.health.v1.Health.
// SIGTERM drains: health turns NOT_SERVING, no new requests are accepted, in-flight ones finish,
// and the process exits 0.
#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cli/model_flags.h"
#include "cli/replica_flags.h"
#include "common/flag_spelling.h"
#include "common/logging.h"
#include "common/metrics_http_server.h"
#include "common/status_macros.h"
#include "grammar/tokenizer_vocabulary.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "tokenizer/tokenizer.h"
#include "worker/distributed/replica_plan.h"
#include "worker/model/generation_defaults.h"
#include "worker/model/memory_plan.h"
#include "worker/runtime/engine.h"
#include "worker/runtime/scheduler.h"
#include "worker/server/worker_service.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on.");
ABSL_FLAG(int, port, 50051, "gRPC port of mobius.v1.Worker and grpc.health.v1.Health.");
ABSL_FLAG(std::string, served_model_name, "",
          "Model name reported by GetModelInfo (default: the model directory's name).");
ABSL_FLAG(int, max_num_seqs, 64, "Sequences running at once (each holds a DeltaNet state slot).");
ABSL_FLAG(int, max_tokens_per_step, mobius::worker::kDefaultMaxTokensPerStep,
          "Token budget of one engine step: decode tokens plus prefill chunks. A prompt longer "
          "than the budget is prefilled over several steps. At release scale every prefill step "
          "reads every expert of every bank (~150 ms on one H200 from ~2K tokens up), so a "
          "budget that holds a whole prompt gives the shortest time to first token (8000-token "
          "prompts: 264 ms at 8192 against 691 ms at 2048); a smaller one shortens how long "
          "running sequences wait for their next token while a long prompt prefills. The "
          "activation reserve in the memory plan grows with it.");
ABSL_FLAG(int, max_prompt_score_rows, mobius::worker::kDefaultMaxPromptScoreRowsPerStep,
          "Prompt tokens of one engine step, over all its requests, whose logits rows are copied "
          "to the host to score the prompt (prompt_logprobs, echo with logprobs). Each row is a "
          "vocabulary of float32 (~1 MB at 248K; the memory plan reserves twice the rows), and a "
          "scored prompt prefills at most this many tokens a step: at release scale each such "
          "step reads every expert, so a larger value scores long prompts in fewer steps.");
ABSL_FLAG(std::string, tokenizer, "",
          "Directory of the model's tokenizer.json, for structured output (response_format, "
          "guided_json, guided_choice): the grammar needs each token's bytes. Default: the "
          "--model directory when it holds a tokenizer.json; without one, requests that ask for "
          "structured output fail and everything else is served.");
ABSL_FLAG(int, max_model_len, 8192, "Longest sequence, prompt plus output, in tokens.");
ABSL_FLAG(int, kv_block_size, 16, "Positions per paged KV-cache block.");
ABSL_FLAG(int, num_kv_blocks, 0,
          "KV-cache blocks; 0 sizes the cache for max_num_seqs sequences of max_model_len.");
ABSL_FLAG(uint64_t, sampling_seed, 0, "Seed for requests that bring no seed of their own.");
ABSL_FLAG(int, metrics_port, 0,
          "Port serving Prometheus metrics at /metrics (0: off). vLLM-compatible names "
          "(vllm:num_requests_running, vllm:kv_cache_usage_perc, TTFT/ITL histograms, ...) "
          "plus mobius_* series.");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "Share of the GPU's memory this worker may use (weights, KV cache, state slots, "
          "activations). With --num-kv-blocks 0 the KV cache gets what the weights leave, after "
          "a reserve for activations; the plan is logged at start. Ignored on the CPU.");
ABSL_FLAG(int, drain_timeout_s, 600,
          "On SIGTERM, how long in-flight requests may take to finish before the process exits.");

namespace mobius::worker {
namespace {

// grpc.health.v1.Health of a follower rank, which serves nothing else (a gRPC server needs one
// registered service; the default health service does not count).
class FollowerHealth final : public grpc::health::v1::Health::Service {
 public:
  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest*,
                     grpc::health::v1::HealthCheckResponse* response) override {
    response->set_status(serving_.load() ? grpc::health::v1::HealthCheckResponse::SERVING
                                         : grpc::health::v1::HealthCheckResponse::NOT_SERVING);
    return grpc::Status::OK;
  }
  void set_serving(bool on) { serving_.store(on); }

 private:
  std::atomic<bool> serving_{true};
};

// The token bytes structured output needs: from --tokenizer, else from the model directory when
// it holds a tokenizer.json; null (structured output refused per request) without either.
absl::StatusOr<std::shared_ptr<const grammar::TokenVocabulary>> LoadVocabulary(
    const std::string& model_dir, int vocab_size) {
  std::string dir = absl::GetFlag(FLAGS_tokenizer);
  const bool given = !dir.empty();
  if (!given) {
    std::error_code ec;
    if (model_dir.empty() ||
        !std::filesystem::exists(std::filesystem::path(model_dir) / "tokenizer.json", ec)) {
      MOBIUS_LOG(INFO, "worker", "")
          << "no tokenizer (--tokenizer): requests for structured output will be refused";
      return std::shared_ptr<const grammar::TokenVocabulary>();
    }
    dir = model_dir;
  }
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok =
      tokenizer::Tokenizer::FromDirectory(dir);
  if (!tok.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(given ? "--tokenizer " : "the model directory's tokenizer ", dir, ": ",
                     tok.status().message()));
  }
  std::shared_ptr<const grammar::TokenVocabulary> vocab =
      grammar::VocabularyFromTokenizer(**tok, static_cast<size_t>(vocab_size));
  MOBIUS_LOG(INFO, "worker", "") << "structured output: " << (*tok)->vocab_size()
                                 << " tokenizer tokens from " << dir << " (" << vocab->trie_nodes()
                                 << " prefix-tree nodes)";
  return vocab;
}

// A follower rank: serves health only and repeats the leader's steps until the leader stops
// (exit 0) or the group fails (exit non-zero, so that the orchestrator restarts the group).
absl::Status RunFollower(HybridModel& model, Communicator& comm) {
  FollowerHealth health;
  grpc::ServerBuilder builder;
  const std::string address =
      absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port));
  int bound_port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &bound_port);
  builder.RegisterService(&health);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  MOBIUS_LOG(INFO, "worker", "") << "rank " << comm.rank() << " of " << comm.world_size()
                                 << " following the leader; health on port " << bound_port;
  absl::Status status = FollowLeader(model, comm);
  health.set_serving(false);
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  if (status.ok()) {
    MOBIUS_LOG(INFO, "worker", "") << "the leader stopped the replica; exiting";
  }
  return status;
}

absl::Status Run() {
  ASSIGN_OR_RETURN(ModelSource source, cli::ModelSourceFromFlags());
  ASSIGN_OR_RETURN(source.shard, cli::ShardFromFlags());
  RETURN_IF_ERROR(cli::SpecTokensFromFlags().status());
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, cli::BackendFromFlags());

  // The health service of whichever role this process takes, once it exists: a failed group
  // turns it NOT_SERVING before the process exits non-zero.
  std::atomic<grpc::Server*> health_server{nullptr};
  ASSIGN_OR_RETURN(
      cli::ReplicaRank replica,
      cli::JoinReplicaFromFlags(source.shard, *backend, [&health_server](const absl::Status& why) {
        MOBIUS_LOG(ERROR, "worker", "") << "replica failed: " << why << "; exiting";
        if (grpc::Server* s = health_server.load(); s != nullptr) {
          s->GetHealthCheckService()->SetServingStatus(false);
        }
        std::fflush(nullptr);
        std::_Exit(3);
      }));
  source.comm = replica.comm.get();
  // Only the leader drafts, so only it reads --spec-token-map (on a replica of several hosts the
  // file need only be beside the leader); before the weights load, so that a bad map fails fast.
  DraftVocabulary draft_vocabulary;
  if (replica.leader()) {
    ASSIGN_OR_RETURN(draft_vocabulary, cli::DraftVocabularyFromFlags(source));
  }
  MOBIUS_LOG(INFO, "worker", "") << "loading model " << source.model_dir << source.config_path;
  ASSIGN_OR_RETURN(std::unique_ptr<HybridModel> model, LoadHybridModel(source, *backend));
  cli::ApplyModelRuntimeFlags(*model);
  RETURN_IF_ERROR(cli::AttachReplica(*model, replica));
  if (!replica.leader()) return RunFollower(*model, *replica.comm);

  EngineOptions options;
  options.scheduler.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  options.scheduler.max_tokens_per_step = absl::GetFlag(FLAGS_max_tokens_per_step);
  options.scheduler.max_prompt_score_rows_per_step = absl::GetFlag(FLAGS_max_prompt_score_rows);
  options.max_model_len = absl::GetFlag(FLAGS_max_model_len);
  options.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  options.num_kv_blocks = absl::GetFlag(FLAGS_num_kv_blocks);
  options.seed = absl::GetFlag(FLAGS_sampling_seed);
  options.eos_token_ids = ReadEosTokenIds(source.model_dir);
  ASSIGN_OR_RETURN(options.vocabulary,
                   LoadVocabulary(source.model_dir, model->config().vocab_size));
  // The MTP head's caches come first, so that the memory plan sees what they take.
  ASSIGN_OR_RETURN(std::unique_ptr<MtpDrafter> drafter,
                   cli::MtpDrafterFromFlags(*model, options.scheduler.max_num_seqs,
                                            options.max_model_len, std::move(draft_vocabulary)));
  if (drafter != nullptr) {
    options.spec_tokens = absl::GetFlag(FLAGS_spec_tokens);
    options.drafter = drafter.get();
    const DraftVocabulary& vocabulary = drafter->vocabulary();
    MOBIUS_LOG(INFO, "worker", "")
        << "speculative decoding: up to " << options.spec_tokens
        << " MTP draft tokens per sequence and step, drafted over "
        << (vocabulary.whole()
                ? std::string("the whole vocabulary")
                : absl::StrCat(vocabulary.ids().size(), " tokens (--spec-token-map)"));
  }
  // On a GPU, size the KV cache from the memory the weights left (unless --num-kv-blocks says).
  if (options.num_kv_blocks == 0) {
    MemoryPlanOptions plan_options;
    plan_options.max_num_seqs = options.scheduler.max_num_seqs;
    plan_options.extra_state_slots = options.spec_tokens > 0 ? options.scheduler.max_num_seqs : 0;
    plan_options.max_model_len = static_cast<int>(
        std::min<int64_t>(options.max_model_len, model->config().max_position_embeddings));
    plan_options.kv_block_size = options.kv_block_size;
    plan_options.max_tokens_per_step = options.scheduler.max_tokens_per_step;
    plan_options.spec_tokens = options.spec_tokens;
    plan_options.prompt_score_rows = options.scheduler.max_prompt_score_rows_per_step;
    plan_options.memory_utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
    // A rank of a sharded replica holds only its heads' KV and state: plan with its local config.
    absl::StatusOr<MemoryPlan> plan =
        PlanDeviceMemory(model->local_config(), *backend, plan_options);
    if (plan.ok()) {
      options.num_kv_blocks = static_cast<int>(plan->num_kv_blocks);
      MOBIUS_LOG(INFO, "worker", "") << "memory plan: " << plan->Summary();
    } else if (!absl::IsUnimplemented(plan.status())) {
      return plan.status();
    }
  }
  // A debug hook for process tests (as Triton's delay variables): every step takes at least this
  // long, so that cancellation-versus-step races can be asserted deterministically.
  if (const char* delay = std::getenv("MOBIUS_DEBUG_STEP_DELAY_MS"); delay != nullptr) {
    int ms = 0;
    if (!absl::SimpleAtoi(delay, &ms) || ms < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MOBIUS_DEBUG_STEP_DELAY_MS must be a non-negative integer, got \"", delay, "\""));
    }
    options.debug_step_delay = absl::Milliseconds(ms);
    MOBIUS_LOG(WARNING, "worker", "") << "debug: every engine step takes at least " << ms << " ms";
  }

  std::string name = absl::GetFlag(FLAGS_served_model_name);
  if (name.empty()) {
    std::string dir = source.model_dir.empty() ? source.config_path : source.model_dir;
    while (!dir.empty() && dir.back() == '/') dir.pop_back();
    name = dir.substr(dir.find_last_of('/') + 1);
  }
  auto registry = std::make_shared<prometheus::Registry>();
  EngineMetrics metrics(registry, name, model->num_banks());
  options.metrics = &metrics;
  // /expert_load: the engine's sampled per-expert loads in the --expert-load file format, so a
  // replica can be restarted with --expert-placement load-aware from what it measured.
  std::atomic<Engine*> engine_for_routes{nullptr};
  MetricsHttpServer::JsonRoutes routes;
  routes["/expert_load"] = [&engine_for_routes] {
    Engine* e = engine_for_routes.load();
    if (e == nullptr) return std::string(R"({"error": "the engine is not running"})");
    const Engine::ExpertLoads loads = e->GetExpertLoads();
    return nlohmann::json({{"banks", loads.banks}, {"sampled_steps", loads.sampled_steps}}).dump();
  };
  // POST /expert_placement: a load-aware placement from those loads, applied on every rank of
  // the replica without a restart (Engine::RebalanceExperts). An optional JSON body
  // {"replicas_per_rank": N} overrides --expert-replicas.
  MetricsHttpServer::PostRoutes post_routes;
  post_routes["/expert_placement"] = [&engine_for_routes](const std::string& body) {
    MetricsHttpServer::JsonResponse response;
    Engine* e = engine_for_routes.load();
    if (e == nullptr)
      return MetricsHttpServer::JsonResponse{503, R"({"error": "the engine is not running"})"};
    int replicas = cli::ExpertReplicasFromFlags();
    if (!body.empty()) {
      const nlohmann::json request = nlohmann::json::parse(body, nullptr, false);
      if (request.is_discarded() || !request.is_object() ||
          (request.contains("replicas_per_rank") &&
           (!request["replicas_per_rank"].is_number_integer() ||
            request["replicas_per_rank"].get<int64_t>() < 0 ||
            request["replicas_per_rank"].get<int64_t>() > 1 << 20))) {
        return MetricsHttpServer::JsonResponse{
            400, R"({"error": "body: expected {\"replicas_per_rank\": N} with N >= 0"})"};
      }
      if (request.contains("replicas_per_rank")) {
        replicas = request["replicas_per_rank"].get<int>();
      }
    }
    absl::StatusOr<Engine::PlacementReport> report = e->RebalanceExperts(replicas);
    if (!report.ok()) {
      response.status = absl::IsFailedPrecondition(report.status()) ? 409
                        : absl::IsInvalidArgument(report.status())  ? 400
                        : absl::IsUnavailable(report.status())      ? 503
                                                                    : 500;
      response.body = nlohmann::json({{"error", std::string(report.status().message())}}).dump();
      return response;
    }
    MOBIUS_LOG(INFO, "worker", "")
        << "expert placement applied: imbalance " << report->imbalance_before << " -> "
        << report->imbalance_after << ", " << report->experts_moved << " experts moved";
    response.body = nlohmann::json({{"ranks", report->ranks},
                                    {"sampled_steps", report->sampled_steps},
                                    {"imbalance_before", report->imbalance_before},
                                    {"imbalance_after", report->imbalance_after},
                                    {"experts_moved", report->experts_moved},
                                    {"replicas_per_rank", report->replicas_per_rank}})
                        .dump();
    return response;
  };
  std::unique_ptr<MetricsHttpServer> metrics_server;
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    ASSIGN_OR_RETURN(
        metrics_server,
        MetricsHttpServer::Start(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_metrics_port),
                                 registry, std::move(routes), std::move(post_routes)));
    MOBIUS_LOG(INFO, "worker", "") << "metrics on port " << metrics_server->port()
                                   << " /metrics, /expert_load, POST /expert_placement";
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(*model, options));
  engine_for_routes.store(engine.get());
  WorkerService service(
      *engine, model->config(), name, options.eos_token_ids,
      std::min<int64_t>(options.max_model_len, model->config().max_position_embeddings));

  // Block the termination signals in every thread; main waits for them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  const std::string address =
      absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port));
  int bound_port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &bound_port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  health_server.store(server.get());
  MOBIUS_LOG(INFO, "worker", "") << "serving " << name << " on port " << bound_port;

  int signal = 0;
  sigwait(&signals, &signal);
  MOBIUS_LOG(INFO, "worker", "") << "signal " << signal << ": draining";
  server->GetHealthCheckService()->SetServingStatus(false);
  engine->Shutdown(/*drain=*/true);
  server->Shutdown(
      absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s))));
  health_server.store(nullptr);
  metrics_server.reset();  // before the engine it reads goes
  engine_for_routes.store(nullptr);
  // The engine thread has stopped: nothing else broadcasts now.
  cli::StopReplica(*model, replica);
  MOBIUS_LOG(INFO, "worker", "") << "drained; exiting";
  return absl::OkStatus();
}

}  // namespace
}  // namespace mobius::worker

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "mobius-worker: serves one model replica over gRPC (mobius.v1.Worker, "
      "grpc.health.v1.Health).\n\nusage: mobius-worker --model DIR [flags]");
  mobius::ListFlagsOfFilesInHelp({"worker_main.cc", "model_flags.cc", "replica_flags.cc"});
  const std::vector<std::string> positional =
      mobius::ParseFlags(argv[0], mobius::NormalizeFlagSpelling(argc, argv, 1));
  if (!positional.empty()) {
    std::fprintf(stderr, "mobius-worker: unexpected argument \"%s\"\n", positional[0].c_str());
    return 2;
  }
  absl::Status status = mobius::worker::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "mobius-worker: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
