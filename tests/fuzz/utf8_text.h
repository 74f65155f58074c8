// UTF-8 text as the router streams it to the fuzz targets: whole characters, in pieces.
#ifndef MOBIUS_TESTS_FUZZ_UTF8_TEXT_H_
#define MOBIUS_TESTS_FUZZ_UTF8_TEXT_H_

#include <string_view>
#include <vector>

#include "tokenizer/utf8.h"

namespace mobius::fuzz {

// Length of the longest prefix of `text` that is well-formed UTF-8.
inline size_t ValidUtf8Prefix(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const tokenizer::Utf8Step step = tokenizer::DecodeUtf8Step(text, pos);
    if (step.kind != tokenizer::Utf8Step::Kind::kValid) break;
    pos += step.length;
  }
  return pos;
}

// Well-formed `text` in pieces of 1, 2, ... `period` characters, cycling, as a detokenizer
// delivers it.
inline std::vector<std::string_view> CharacterChunks(std::string_view text, int period) {
  std::vector<std::string_view> chunks;
  size_t pos = 0;
  for (int i = 0; pos < text.size(); ++i) {
    size_t end = pos;
    for (int c = 0; c < 1 + i % period && end < text.size(); ++c) {
      end += tokenizer::DecodeUtf8Step(text, end).length;
    }
    chunks.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return chunks;
}

}  // namespace mobius::fuzz

#endif  // MOBIUS_TESTS_FUZZ_UTF8_TEXT_H_
