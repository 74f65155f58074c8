#include "router/core/bad_words.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace mobius::router {

absl::StatusOr<std::vector<std::vector<int32_t>>> BadWordSequences(
    const tokenizer::Tokenizer& tokenizer, std::string_view word) {
  const size_t start = word.find_first_not_of(" \t\n\r\f\v");
  if (start == std::string_view::npos) {
    return absl::InvalidArgumentError("a bad word is empty or only whitespace");
  }
  const std::string stripped(word.substr(start));
  absl::StatusOr<std::vector<int32_t>> bare = tokenizer.Encode(stripped);
  if (!bare.ok()) return bare.status();
  absl::StatusOr<std::vector<int32_t>> spaced = tokenizer.Encode(absl::StrCat(" ", stripped));
  if (!spaced.ok()) return spaced.status();
  std::vector<std::vector<int32_t>> sequences;
  if (!bare->empty()) sequences.push_back(*bare);
  if (!spaced->empty() &&
      (bare->empty() || (spaced->size() == bare->size() && spaced->front() != bare->front()))) {
    sequences.push_back(*std::move(spaced));
  }
  if (sequences.empty()) return absl::InvalidArgumentError("a bad word encodes to no token");
  return sequences;
}

}  // namespace mobius::router
