// The tokenizer.json "normalizer": Unicode normalisation applied to text before it is split into
// words (added tokens marked `normalized: false` are matched before this step).
#ifndef MOBIUS_TOKENIZER_NORMALIZER_H_
#define MOBIUS_TOKENIZER_NORMALIZER_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace mobius::tokenizer {

enum class NormalizationForm { kNfc, kNfd, kNfkc, kNfkd };

class Normalizer {
 public:
  // Accepts null (identity), {"type": "NFC"|"NFD"|"NFKC"|"NFKD"} and a "Sequence" of those.
  // Any other type is an InvalidArgument error naming it.
  static absl::StatusOr<Normalizer> FromJson(const nlohmann::json& config);

  // `text` must be valid UTF-8 (the tokenizer sanitises input first).
  [[nodiscard]] std::string Normalize(std::string_view text) const;

  [[nodiscard]] bool is_identity() const { return forms_.empty(); }

 private:
  std::vector<NormalizationForm> forms_;
};

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_NORMALIZER_H_
