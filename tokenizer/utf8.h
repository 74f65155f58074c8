// UTF-8 helpers shared by the encoder (sanitising input) and the decoders (never emitting a
// partial character). One replacement policy is used everywhere: each maximal ill-formed
// subsequence becomes one U+FFFD, as in the Unicode standard's recommended practice (the same
// policy as Python's errors="replace" and Rust's from_utf8_lossy, which the reference uses).
#ifndef MOBIUS_TOKENIZER_UTF8_H_
#define MOBIUS_TOKENIZER_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mobius::tokenizer {

inline constexpr char32_t kReplacementCharacter = 0xFFFD;

// Outcome of looking at the bytes starting at one position.
struct Utf8Step {
  enum class Kind {
    kValid,       // `length` bytes form one well-formed character, `code_point`.
    kIllFormed,   // `length` bytes are a maximal ill-formed subsequence.
    kIncomplete,  // The input ends inside a character that could still become valid.
  };
  Kind kind;
  size_t length;
  char32_t code_point;
};

// Classifies the character (or ill-formed run) starting at `text[pos]`; `pos < text.size()`.
Utf8Step DecodeUtf8Step(std::string_view text, size_t pos);

// True when `text` is entirely well-formed UTF-8.
bool IsValidUtf8(std::string_view text);

// Returns `text` with every maximal ill-formed subsequence (including a truncated character at
// the end) replaced by U+FFFD. Well-formed input is returned unchanged.
std::string ReplaceInvalidUtf8(std::string_view text);

// Length of the longest prefix of `text` whose lossy decoding cannot change when more bytes are
// appended: everything except a trailing, still-completable partial character.
size_t StableUtf8PrefixLength(std::string_view text);

// Appends the UTF-8 encoding of `code_point` to `out`.
void AppendUtf8(char32_t code_point, std::string& out);

// Unicode White_Space property (what Rust's char::is_whitespace and Oniguruma's \s use).
bool IsUnicodeWhitespace(char32_t code_point);

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_UTF8_H_
