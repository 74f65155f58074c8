// Conversions between the mobius.v1 protos and the runtime's types. Unset optional fields take
// the server defaults documented in proto/sampling.proto.
#ifndef MOBIUS_WORKER_SERVER_PROTO_CONVERT_H_
#define MOBIUS_WORKER_SERVER_PROTO_CONVERT_H_

#include "sampling.pb.h"
#include "worker/runtime/engine.h"
#include "worker/runtime/sampling_params.h"

namespace mobius::worker {

SamplingParams FromProto(const v1::SamplingParams& proto);
v1::FinishReason ToProto(FinishReason reason);
void ToProto(const SampledToken& token, v1::OutputLogprobs* out);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_SERVER_PROTO_CONVERT_H_
