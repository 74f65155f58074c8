// mobius.v1.Worker over the Engine: a thin adapter, no scheduling logic here.
#ifndef MOBIUS_WORKER_SERVER_WORKER_SERVICE_H_
#define MOBIUS_WORKER_SERVER_WORKER_SERVICE_H_

#include <atomic>
#include <string>
#include <vector>

#include "common/grpc_status.h"
#include "worker.grpc.pb.h"
#include "worker/runtime/engine.h"

namespace mobius::worker {

class WorkerService final : public v1::Worker::Service {
 public:
  WorkerService(Engine& engine, const ModelConfig& config, std::string model_name,
                std::vector<int32_t> eos_token_ids, int max_model_len);

  grpc::Status Generate(grpc::ServerContext* context, const v1::WorkerGenerateRequest* request,
                        grpc::ServerWriter<v1::WorkerGenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override;
  grpc::Status GetLoads(grpc::ServerContext* context, const v1::GetLoadsRequest* request,
                        v1::GetLoadsResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;

 private:
  Engine& engine_;
  v1::ModelInfo info_;
  std::atomic<uint64_t> next_id_{0};
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_SERVER_WORKER_SERVICE_H_
