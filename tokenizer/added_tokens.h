// Added tokens (tokenizer.json "added_tokens"): strings such as "<|im_start|>" that are cut out of
// the text before normalisation and pre-tokenisation and map straight to one id. Matching
// follows Hugging Face: leftmost-longest, then the lstrip/rstrip/single_word rules.
#ifndef MOBIUS_TOKENIZER_ADDED_TOKENS_H_
#define MOBIUS_TOKENIZER_ADDED_TOKENS_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace mobius::tokenizer {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;  // Only match when not inside a word.
  bool lstrip = false;       // Swallow whitespace to the left of the match.
  bool rstrip = false;       // Swallow whitespace to the right of the match.
  bool normalized = false;   // Match in normalised text instead of the raw input.
  bool special = false;      // A control token (skippable when decoding).
};

// Parses one entry of tokenizer.json "added_tokens".
absl::StatusOr<AddedToken> ParseAddedToken(const nlohmann::json& entry);

// A piece of text after added tokens were cut out: plain text (token_id < 0) or one token.
struct TextSegment {
  std::string_view text;
  int32_t token_id = -1;
};

class AddedTokenMatcher {
 public:
  // `tokens` are the ones this matcher looks for; their `content` is matched byte for byte.
  explicit AddedTokenMatcher(std::vector<AddedToken> tokens);

  // Splits `text` into plain runs and tokens, in order. When `match_special` is false, tokens
  // marked special are not recognised (they are encoded as ordinary text).
  void Split(std::string_view text, bool match_special, std::vector<TextSegment>& out) const;

  [[nodiscard]] bool empty() const { return tokens_.empty(); }

 private:
  struct Match {
    size_t start;
    size_t end;
    const AddedToken* token;
  };
  // Leftmost-longest match starting at or after `from`; token is null when there is none.
  [[nodiscard]] Match FindNext(std::string_view text, size_t from) const;

  std::vector<AddedToken> tokens_;
  // Candidate tokens for each first byte, longest first.
  std::array<std::vector<const AddedToken*>, 256> by_first_byte_;
};

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_ADDED_TOKENS_H_
