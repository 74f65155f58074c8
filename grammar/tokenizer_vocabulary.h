// The vocabulary a grammar masks, read from the model's tokenizer: each id's bytes, with
// special tokens (and ids the tokenizer lacks) left empty so that no grammar allows them.
#ifndef MOBIUS_GRAMMAR_TOKENIZER_VOCABULARY_H_
#define MOBIUS_GRAMMAR_TOKENIZER_VOCABULARY_H_

#include <cstddef>
#include <memory>

#include "grammar/token_mask.h"
#include "tokenizer/tokenizer.h"

namespace mobius::grammar {

// `vocab_size`: the model's (its embedding rows, often past the tokenizer's last id).
std::shared_ptr<const TokenVocabulary> VocabularyFromTokenizer(const tokenizer::Tokenizer& tok,
                                                               size_t vocab_size);

}  // namespace mobius::grammar

#endif  // MOBIUS_GRAMMAR_TOKENIZER_VOCABULARY_H_
