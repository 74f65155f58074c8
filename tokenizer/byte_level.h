// The GPT-2 "ByteLevel" alphabet: every byte is shown as one printable code point, so that BPE
// vocabularies can be stored as text. Encoding maps raw bytes to that alphabet; decoding maps
// it back.
#ifndef MOBIUS_TOKENIZER_BYTE_LEVEL_H_
#define MOBIUS_TOKENIZER_BYTE_LEVEL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace mobius::tokenizer {

// The code point that stands for `byte` in the byte-level alphabet.
char32_t ByteToAlphabetCodePoint(uint8_t byte);

// UTF-8 text of the byte-level alphabet for `bytes` (what a vocabulary entry looks like).
std::string BytesToAlphabet(std::string_view bytes);

// Inverse of BytesToAlphabet; nullopt when `alphabet_text` holds a code point outside the
// alphabet (or is not valid UTF-8).
std::optional<std::string> AlphabetToBytes(std::string_view alphabet_text);

// What the ByteLevel decoder produces for one token string: its bytes when the whole token is in
// the alphabet, otherwise the token's own UTF-8 text (added tokens such as "<|im_end|>" or
// tokens holding a plain space take this path).
std::string ByteLevelDecodeToken(std::string_view token);

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_BYTE_LEVEL_H_
