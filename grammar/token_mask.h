// Which vocabulary tokens can come next under a grammar: every token whose bytes the matcher
// accepts from its current state. The vocabulary is a prefix tree in depth-first order, so one
// pass checks each shared prefix once and skips a whole subtree at its first rejected byte.
#ifndef MOBIUS_GRAMMAR_TOKEN_MASK_H_
#define MOBIUS_GRAMMAR_TOKEN_MASK_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "grammar/grammar_matcher.h"

namespace mobius::grammar {

// A bit per token id (bit i of word i / 64).
using TokenBitmask = std::vector<uint64_t>;

inline bool TestToken(const TokenBitmask& mask, int32_t id) {
  return id >= 0 && static_cast<size_t>(id / 64) < mask.size() && (mask[id / 64] >> (id % 64)) & 1;
}

class TokenVocabulary {
 public:
  // token_bytes[id]: the bytes token `id` decodes to. Empty entries (special tokens, ids past the
  // tokenizer's) are never allowed by a grammar; the caller allows end-of-sequence tokens itself.
  explicit TokenVocabulary(std::vector<std::string> token_bytes);

  [[nodiscard]] size_t size() const { return token_bytes_.size(); }
  [[nodiscard]] std::string_view bytes(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < token_bytes_.size() ? token_bytes_[id]
                                                                    : std::string_view();
  }
  [[nodiscard]] size_t trie_nodes() const { return byte_.size(); }
  // Bytes of the longest token (no mask looks further ahead than this from a state).
  [[nodiscard]] size_t max_token_bytes() const { return max_depth_; }

  // The tokens that can follow `state`'s text, into `mask` (resized to the vocabulary).
  void ComputeMask(const GrammarMatcher& state, TokenBitmask& mask) const;

 private:
  std::vector<std::string> token_bytes_;
  // The prefix tree in depth-first order: node i adds byte_[i] at depth_[i] (1 = first byte),
  // its subtree ends before end_[i], and the tokens whose bytes end there are
  // tokens_[token_begin_[i], token_begin_[i + 1]).
  std::vector<uint8_t> byte_;
  std::vector<uint16_t> depth_;
  std::vector<uint32_t> end_;
  std::vector<uint32_t> token_begin_;
  std::vector<int32_t> tokens_;
  size_t max_depth_ = 0;
  // Tokens that are plain string content (printable ASCII but '"' and '\\', and whole UTF-8
  // characters): inside a string with room for any token, all of them are allowed and the walk
  // visits only subtrees that hold another token (has_other_[i]). Most of a vocabulary is plain,
  // and a state inside a string is the commonest miss of the mask cache.
  TokenBitmask plain_string_;
  std::vector<uint8_t> has_other_;
};

}  // namespace mobius::grammar

#endif  // MOBIUS_GRAMMAR_TOKEN_MASK_H_
