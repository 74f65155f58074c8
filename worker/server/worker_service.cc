#include "worker/server/worker_service.h"

#include "common/grpc_status.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "worker/server/output_queue.h"
#include "worker/server/proto_convert.h"

namespace mobius::worker {

WorkerService::WorkerService(Engine& engine, const ModelConfig& config, std::string model_name,
                             std::vector<int32_t> eos_token_ids, int max_model_len)
    : engine_(engine) {
  info_.set_model_name(std::move(model_name));
  info_.set_model_type(config.model_type);
  info_.set_vocab_size(config.vocab_size);
  info_.set_max_context_length(max_model_len);
  for (int32_t id : eos_token_ids) info_.add_eos_token_ids(id);
}

grpc::Status WorkerService::Generate(grpc::ServerContext* context,
                                     const v1::WorkerGenerateRequest* request,
                                     grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) {
  GenerationRequest r;
  r.request_id =
      request->request_id().empty() ? absl::StrCat("worker-", next_id_++) : request->request_id();
  r.prompt.assign(request->input_ids().begin(), request->input_ids().end());
  r.params = FromProto(request->sampling_params());
  r.priority = request->priority();
  auto queue = std::make_shared<OutputQueue>();
  const std::string id = r.request_id;
  absl::Status enqueued =
      engine_.Enqueue(std::move(r), [queue](const GenerationOutput& out) { queue->Push(out); });
  if (!enqueued.ok()) return ToGrpcStatus(enqueued);

  bool client_gone = false;
  while (true) {
    std::optional<GenerationOutput> out = queue->Pop(absl::Milliseconds(20));
    if (!out) {
      // A client that disconnects or cancels frees its slot at the next engine step.
      if (!client_gone && context->IsCancelled()) {
        client_gone = true;
        engine_.Cancel(id);
      }
      continue;
    }
    if (out->finish == FinishReason::kError) return ToGrpcStatus(out->error);
    if ((!out->tokens.empty() || !out->prompt_logprobs.empty()) && !client_gone) {
      v1::WorkerGenerateResponse chunk;
      for (int32_t t : out->tokens) chunk.mutable_chunk()->add_token_ids(t);
      for (const SampledToken& s : out->logprobs) ToProto(s, chunk.mutable_chunk()->add_logprobs());
      for (const SampledToken& s : out->prompt_logprobs) {
        ToProto(s, chunk.mutable_chunk()->add_prompt_logprobs());
      }
      if (!writer->Write(chunk)) {
        client_gone = true;
        engine_.Cancel(id);
      }
    }
    if (out->finish != FinishReason::kNone) {
      if (client_gone) return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
      v1::WorkerGenerateResponse done;
      v1::GenerateComplete* complete = done.mutable_complete();
      complete->set_finish_reason(ToProto(out->finish));
      if (out->matched_stop_token) complete->set_matched_stop_token_id(*out->matched_stop_token);
      complete->mutable_usage()->set_prompt_tokens(out->prompt_tokens);
      complete->mutable_usage()->set_completion_tokens(out->completion_tokens);
      writer->Write(done);
      return grpc::Status::OK;
    }
  }
}

grpc::Status WorkerService::Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                                  v1::AbortResponse* response) {
  response->set_found(engine_.Cancel(request->request_id()));
  return grpc::Status::OK;
}

grpc::Status WorkerService::GetLoads(grpc::ServerContext*, const v1::GetLoadsRequest*,
                                     v1::GetLoadsResponse* response) {
  const EngineStats stats = engine_.GetStats();
  response->set_num_running(stats.num_running);
  response->set_num_waiting(stats.num_waiting);
  response->set_outstanding_tokens(stats.outstanding_tokens);
  response->set_kv_cache_usage(stats.kv_cache_usage);
  response->set_state_slot_usage(stats.state_slot_usage);
  return grpc::Status::OK;
}

grpc::Status WorkerService::GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                                         v1::ModelInfo* response) {
  *response = info_;
  return grpc::Status::OK;
}

}  // namespace mobius::worker
