// vLLM's bad_words: texts that must not be generated, turned into the token sequences the worker
// bans (SamplingParams.bad_words_token_ids).
#ifndef MOBIUS_ROUTER_CORE_BAD_WORDS_H_
#define MOBIUS_ROUTER_CORE_BAD_WORDS_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"

namespace mobius::router {

// The token sequences of one bad word, as vLLM makes them: the word without its leading
// whitespace, and the same after one space when that spells it with as many tokens and a
// different first token (the word as it appears mid-text). InvalidArgument when the word is
// only (ASCII) whitespace or encodes to no token.
absl::StatusOr<std::vector<std::vector<int32_t>>> BadWordSequences(
    const tokenizer::Tokenizer& tokenizer, std::string_view word);

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_BAD_WORDS_H_
