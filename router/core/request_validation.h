// Checks a client's GenerateRequest against the served model before it reaches a worker, so that
// errors name the client's field (`sampling_params.top_p`, `input_ids`, `text`) and no replica
// spends time on a request it would refuse.
#ifndef MOBIUS_ROUTER_CORE_REQUEST_VALIDATION_H_
#define MOBIUS_ROUTER_CORE_REQUEST_VALIDATION_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "inference.pb.h"

namespace mobius::router {

// Output tokens when the request leaves sampling_params.max_tokens unset (as the worker).
inline constexpr int kDefaultMaxTokens = 16;

// The errors below carry the field they are about as a RequestFieldOf payload
// (router/inference_service.h).

// INVALID_ARGUMENT naming the field for: temperature NaN, infinite or negative; top_k < -1; top_p
// outside (0, 1]; min_p outside [0, 1]; repetition_penalty <= 0; presence/frequency penalty
// outside [-2, 2]; max_tokens negative or above the context length; logprobs outside [0, 20];
// stop_token_ids outside the vocabulary; empty stop strings.
absl::Status ValidateSamplingParams(const v1::SamplingParams& params, const v1::ModelInfo& model);

// INVALID_ARGUMENT when `ids` (the prompt, from the client field `field`) is empty, holds an id
// outside the model's vocabulary, or leaves no room in the context for one generated token.
absl::Status ValidatePrompt(absl::Span<const int32_t> ids, std::string_view field,
                            const v1::ModelInfo& model);

// max_tokens (or the default) capped to the context left after the prompt: a request whose prompt
// plus max_tokens exceeds the context is served and ends with FINISH_REASON_LENGTH at the
// context's end rather than being refused. (vLLM's OpenAI server refuses such a request with a
// 400 instead; serving it gives a prefix of what a longer context would, and a client that
// wants the refusal can check prompt + max_tokens against /v1/models' max_model_len.)
int EffectiveMaxTokens(const v1::SamplingParams& params, int prompt_tokens,
                       const v1::ModelInfo& model);

// The sampling parameters a worker receives for a client's validated `params` and the token
// budget `max_tokens` (EffectiveMaxTokens): stop strings, bad words as text and the
// detokenization options are the router's and are left out, max_tokens is the budget, and
// min_tokens is capped at it (the context or the default budget may leave fewer tokens than
// min_tokens asks for: then all of them). The caller adds bad words as token sequences.
v1::SamplingParams WorkerSamplingParams(const v1::SamplingParams& params, int max_tokens);

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_REQUEST_VALIDATION_H_
