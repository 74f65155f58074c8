// A compiled PCRE2 pattern (UTF + Unicode properties + JIT) used by the Split pre-tokenizers.
// Hugging Face tokenizers runs these patterns with Oniguruma; the differences that matter for
// tokenizer patterns are bridged here (see TranslateOnigurumaPattern).
#ifndef MOBIUS_TOKENIZER_REGEX_H_
#define MOBIUS_TOKENIZER_REGEX_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mobius::tokenizer {

// Rewrites `\s` and `\S` into explicit classes of the Unicode White_Space property, which is what
// Oniguruma matches. PCRE2's Unicode `\s` additionally matches U+180E MONGOLIAN VOWEL SEPARATOR,
// which would change how text containing it is split. `\S` inside a character class has no
// PCRE2 spelling without set subtraction and is left as is.
std::string TranslateOnigurumaPattern(std::string_view pattern);

// Escapes `literal` so that it matches itself as a PCRE2 pattern.
std::string EscapeRegexLiteral(std::string_view literal);

class Regex {
 public:
  // `pattern` is in Oniguruma/Hugging Face syntax; compile errors are InvalidArgument with
  // PCRE2's message and the offset.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern);

  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the byte ranges [start, end) of successive non-overlapping leftmost matches in
  // `subject`, which must be valid UTF-8. Safe to call from several threads at once.
  absl::Status FindAll(std::string_view subject,
                       std::vector<std::pair<size_t, size_t>>& matches) const;

 private:
  struct Impl;
  explicit Regex(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_REGEX_H_
