// Fuzzes the two checks a generate request's sampling parameters pass: the router's
// (ValidateSamplingParams, against the model's info) and the worker's (FromProto, then
// SamplingParams::Validate against the vocabulary) of what the router forwards
// (WorkerSamplingParams with the EffectiveMaxTokens budget). A request the router accepts must
// not be refused by the worker (the client would get a worker's error after the router had taken
// the request), and the budget must fit the context.
//
// Input: a serialized mobius.v1.SamplingParams (protobuf wire format; most byte strings are not,
// and those are skipped).
#include <string>

#include "absl/status/status.h"
#include "router/core/request_validation.h"
#include "sampling.pb.h"
#include "tests/fuzz/fuzz_check.h"
#include "worker.pb.h"
#include "worker/runtime/sampling_params.h"
#include "worker/server/proto_convert.h"

namespace v1 = mobius::v1;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::SamplingParams proto;
  if (!proto.ParseFromArray(data, static_cast<int>(size))) return 0;
  v1::ModelInfo model;
  model.set_model_name("mobius-fuzz");
  model.set_vocab_size(1000);
  model.set_max_context_length(4096);
  model.add_eos_token_ids(2);

  const absl::Status router = mobius::router::ValidateSamplingParams(proto, model);
  if (!router.ok()) {
    FUZZ_CHECK(router.code() == absl::StatusCode::kInvalidArgument, router.ToString());
    return 0;
  }
  for (const int prompt : {1, 100, 4095}) {
    const int budget = mobius::router::EffectiveMaxTokens(proto, prompt, model);
    FUZZ_CHECK(
        budget >= 0 && budget <= model.max_context_length() - prompt,
        "token budget " + std::to_string(budget) + " for a prompt of " + std::to_string(prompt));
    const mobius::worker::SamplingParams params =
        mobius::worker::FromProto(mobius::router::WorkerSamplingParams(proto, budget));
    const absl::Status worker = params.Validate(model.vocab_size());
    FUZZ_CHECK(worker.ok(), "the router accepted what the worker refuses: " + worker.ToString() +
                                "\n" + proto.DebugString());
  }
  return 0;
}
