// A token vocabulary for the fixture models, which come without a tokenizer: id i spells a JSON
// piece or a printable ASCII byte (i mod their count), as a byte-level BPE vocabulary holds
// every byte, so that structured output can be tested on them. `eos` spells nothing.
#ifndef MOBIUS_TESTS_RUNTIME_PIECE_VOCABULARY_H_
#define MOBIUS_TESTS_RUNTIME_PIECE_VOCABULARY_H_

#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "grammar/token_mask.h"

namespace mobius::testing {

inline std::shared_ptr<const grammar::TokenVocabulary> PieceVocabulary(int vocab_size, int eos) {
  static const char* kPieces[] = {"{",    "}",    "[",        "]",    "\"",     ":",     ",",
                                  " ",    "name", "\"name\"", "age",  "true",   "false", "null",
                                  "x\"",  "\": ", "\"a",      "\n  ", "\"ok\"", "yes",   "no",
                                  " way", "12",   "-0.",      "e+"};
  std::vector<std::string> pieces(std::begin(kPieces), std::end(kPieces));
  for (char c = ' '; c <= '~'; ++c) pieces.emplace_back(1, c);
  std::vector<std::string> bytes(vocab_size);
  for (int i = 0; i < vocab_size; ++i) bytes[i] = pieces[i % pieces.size()];
  if (eos >= 0 && eos < vocab_size) bytes[eos] = "";
  return std::make_shared<const grammar::TokenVocabulary>(std::move(bytes));
}

}  // namespace mobius::testing

#endif  // MOBIUS_TESTS_RUNTIME_PIECE_VOCABULARY_H_
