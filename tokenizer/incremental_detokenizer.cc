#include "tokenizer/incremental_detokenizer.h"

#include <utility>

#include "common/status_macros.h"
#include "tokenizer/utf8.h"

namespace mobius::tokenizer {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, DecodeOptions options)
    : tokenizer_(tokenizer), options_(options) {}

absl::StatusOr<std::string> IncrementalDetokenizer::Push(int32_t id) {
  ASSIGN_OR_RETURN(const std::string_view bytes, tokenizer_.TokenBytes(id, options_));
  pending_.append(bytes);
  // Bytes before the stable prefix decode the same whatever comes next, so replacing invalid
  // sequences there now gives exactly what the full decode will give.
  const size_t stable = StableUtf8PrefixLength(pending_);
  std::string text = ReplaceInvalidUtf8(std::string_view(pending_).substr(0, stable));
  pending_.erase(0, stable);
  return text;
}

std::string IncrementalDetokenizer::Finish() {
  std::string text = ReplaceInvalidUtf8(pending_);
  pending_.clear();
  return text;
}

}  // namespace mobius::tokenizer
