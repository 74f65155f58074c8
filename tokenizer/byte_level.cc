#include "tokenizer/byte_level.h"

#include <array>

#include "tokenizer/utf8.h"

namespace mobius::tokenizer {
namespace {

bool IsPrintableByte(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct Alphabet {
  std::array<char32_t, 256> byte_to_cp;
  // Every alphabet code point is below 0x144, so a flat table indexes the inverse.
  std::array<int16_t, 0x200> cp_to_byte;

  Alphabet() {
    cp_to_byte.fill(-1);
    char32_t next_unprintable = 256;
    for (int b = 0; b < 256; ++b) {
      byte_to_cp[b] = IsPrintableByte(b) ? static_cast<char32_t>(b) : next_unprintable++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const Alphabet& GetAlphabet() {
  static const Alphabet* const alphabet = new Alphabet();
  return *alphabet;
}

}  // namespace

char32_t ByteToAlphabetCodePoint(uint8_t byte) { return GetAlphabet().byte_to_cp[byte]; }

std::string BytesToAlphabet(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) AppendUtf8(ByteToAlphabetCodePoint(static_cast<uint8_t>(c)), out);
  return out;
}

std::optional<std::string> AlphabetToBytes(std::string_view alphabet_text) {
  const Alphabet& alphabet = GetAlphabet();
  std::string out;
  out.reserve(alphabet_text.size());
  size_t pos = 0;
  while (pos < alphabet_text.size()) {
    const Utf8Step step = DecodeUtf8Step(alphabet_text, pos);
    if (step.kind != Utf8Step::Kind::kValid || step.code_point >= alphabet.cp_to_byte.size() ||
        alphabet.cp_to_byte[step.code_point] < 0) {
      return std::nullopt;
    }
    out.push_back(static_cast<char>(alphabet.cp_to_byte[step.code_point]));
    pos += step.length;
  }
  return out;
}

std::string ByteLevelDecodeToken(std::string_view token) {
  std::optional<std::string> bytes = AlphabetToBytes(token);
  return bytes.has_value() ? *std::move(bytes) : std::string(token);
}

}  // namespace mobius::tokenizer
