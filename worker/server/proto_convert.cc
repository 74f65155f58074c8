#include "worker/server/proto_convert.h"

#include <algorithm>

namespace mobius::worker {

SamplingParams FromProto(const v1::SamplingParams& p) {
  SamplingParams s;
  if (p.has_temperature()) s.temperature = p.temperature();
  if (p.has_top_k()) s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  if (p.has_min_p()) s.min_p = p.min_p();
  if (p.has_repetition_penalty()) s.repetition_penalty = p.repetition_penalty();
  if (p.has_presence_penalty()) s.presence_penalty = p.presence_penalty();
  if (p.has_frequency_penalty()) s.frequency_penalty = p.frequency_penalty();
  if (p.has_seed()) s.seed = p.seed();
  if (p.has_max_tokens()) s.max_tokens = p.max_tokens();
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  if (p.has_ignore_eos()) s.ignore_eos = p.ignore_eos();
  if (p.has_logprobs()) s.logprobs = p.logprobs();
  // Sorted by id: the map's order is unspecified, and the bias list's order must not depend on it.
  for (const auto& [id, bias] : p.logit_bias()) s.logit_bias.emplace_back(id, bias);
  std::sort(s.logit_bias.begin(), s.logit_bias.end());
  if (p.has_min_tokens()) s.min_tokens = p.min_tokens();
  if (p.has_prompt_logprobs()) s.prompt_logprobs = p.prompt_logprobs();
  s.allowed_token_ids.assign(p.allowed_token_ids().begin(), p.allowed_token_ids().end());
  for (const v1::TokenSequence& word : p.bad_words_token_ids()) {
    s.bad_words.emplace_back(word.ids().begin(), word.ids().end());
  }
  using Kind = grammar::StructuredOutputSpec::Kind;
  const v1::StructuredOutput& so = p.structured_output();
  switch (so.kind_case()) {
    case v1::StructuredOutput::kJsonSchema:
      s.structured_output.kind = Kind::kJsonSchema;
      s.structured_output.json_schema = so.json_schema();
      break;
    case v1::StructuredOutput::kJsonObject:
      if (so.json_object()) s.structured_output.kind = Kind::kJsonObject;
      break;
    case v1::StructuredOutput::kChoice:
      s.structured_output.kind = Kind::kChoice;
      s.structured_output.choices.assign(so.choice().choices().begin(),
                                         so.choice().choices().end());
      break;
    case v1::StructuredOutput::kRegex:
      s.structured_output.kind = Kind::kRegex;
      s.structured_output.regex = so.regex();
      break;
    case v1::StructuredOutput::kTaggedJson:
      s.structured_output.kind = Kind::kTaggedJson;
      s.structured_output.begin = so.tagged_json().begin();
      s.structured_output.json_schema = so.tagged_json().json_schema();
      s.structured_output.end = so.tagged_json().end();
      s.structured_output.max_blocks =
          so.tagged_json().max_blocks() == 0 ? 1 : so.tagged_json().max_blocks();
      s.structured_output.separator = so.tagged_json().separator();
      break;
    case v1::StructuredOutput::KIND_NOT_SET:
      break;
  }
  if (s.structured_output.kind != Kind::kNone) {
    s.structured_output.reasoning_end = so.reasoning_end();
  }
  return s;
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kAbort:
      return v1::FINISH_REASON_ABORT;
    case FinishReason::kNone:
    case FinishReason::kError:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void ToProto(const SampledToken& token, v1::OutputLogprobs* out) {
  out->set_logprob(token.logprob);
  if (token.rank > 0) out->set_rank(token.rank);
  for (const TokenLogprob& t : token.top) {
    v1::TokenLogprob* p = out->add_top();
    p->set_token_id(t.token);
    p->set_logprob(t.logprob);
  }
}

}  // namespace mobius::worker
