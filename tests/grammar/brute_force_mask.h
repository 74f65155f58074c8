// The token mask by brute force, the reference the trie walk (TokenVocabulary::ComputeMask) is
// checked against: each token's bytes fed to a copy of the state.
#ifndef MOBIUS_TESTS_GRAMMAR_BRUTE_FORCE_MASK_H_
#define MOBIUS_TESTS_GRAMMAR_BRUTE_FORCE_MASK_H_

#include <cstdint>
#include <string_view>

#include "grammar/grammar_matcher.h"
#include "grammar/token_mask.h"

namespace mobius::grammar::testing {

inline TokenBitmask BruteForceMask(const GrammarMatcher& state, const TokenVocabulary& vocab) {
  TokenBitmask mask((vocab.size() + 63) / 64, 0);
  GrammarMatcher probe = state;
  for (size_t id = 0; id < vocab.size(); ++id) {
    const std::string_view bytes = vocab.bytes(static_cast<int32_t>(id));
    if (bytes.empty()) continue;
    probe.CopyFrom(state);
    if (probe.FeedBytes(bytes)) mask[id / 64] |= uint64_t{1} << (id % 64);
  }
  return mask;
}

}  // namespace mobius::grammar::testing

#endif  // MOBIUS_TESTS_GRAMMAR_BRUTE_FORCE_MASK_H_
