// The choices of one OpenAI request (its prompts times `n`) as concurrent service calls whose
// stream messages reach one thread, the request's own, which alone writes to the client.
#ifndef MOBIUS_ROUTER_HTTP_CHOICE_FAN_OUT_H_
#define MOBIUS_ROUTER_HTTP_CHOICE_FAN_OUT_H_

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "inference.pb.h"
#include "router/inference_service.h"

namespace mobius::router::openai {

// Receives one choice's stream message on the calling thread; false ends every call (the client
// can no longer be written to).
using ChoiceConsumer = std::function<bool(int choice, const v1::GenerateResponse& response)>;

// Runs `InferenceService::Generate` for every request of `choices` at once, each on a thread of
// its own (Generate blocks for the request's life), and calls `consume` on this thread with their
// messages in the order they arrive (each call's own in its order). Returns when every call has
// returned.
//
// The first call to fail ends the others (they are cancelled, as for a client that went away) and
// its status is returned, with its index in `failed_choice` when given: the response has failed as
// a whole. The messages queued before the failure are still consumed, so a stream shows what came
// before its error. The calls are also cancelled when `call.cancelled` becomes true (polled while
// waiting) or `consume` returns false; the status is then CANCELLED and nothing more is consumed.
// The queue holds 4 messages per call, shared: a call that finds it full waits, so a slow client
// slows its stream as a single call's does. `call.deadline` is every call's deadline. OK when every
// call returned OK. A single request is made on this thread, with `call` as it is, and its status
// returned.
absl::Status RunChoices(InferenceService& service, const std::vector<v1::GenerateRequest>& choices,
                        const CallContext& call, const ChoiceConsumer& consume,
                        int* failed_choice = nullptr);

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_CHOICE_FAN_OUT_H_
