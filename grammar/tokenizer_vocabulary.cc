#include "grammar/tokenizer_vocabulary.h"

#include <string>
#include <vector>

namespace mobius::grammar {

std::shared_ptr<const TokenVocabulary> VocabularyFromTokenizer(const tokenizer::Tokenizer& tok,
                                                               size_t vocab_size) {
  std::vector<std::string> bytes(vocab_size);
  for (size_t id = 0; id < vocab_size && id < tok.id_limit(); ++id) {
    const int32_t i = static_cast<int32_t>(id);
    if (tok.IsSpecialToken(i)) continue;
    absl::StatusOr<std::string_view> b = tok.TokenBytes(i);
    if (b.ok()) bytes[id] = std::string(*b);
  }
  return std::make_shared<const TokenVocabulary>(std::move(bytes));
}

}  // namespace mobius::grammar
