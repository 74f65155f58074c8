// The tokenizer.json "pre_tokenizer": splits normalised text into the words that BPE encodes
// independently. Supports "Split" (regex or literal, every delimiter behaviour, invert) and
// "ByteLevel" (add_prefix_space, use_regex; trim_offsets only affects offsets, which this
// library does not report), alone or in a "Sequence".
#ifndef MOBIUS_TOKENIZER_PRE_TOKENIZER_H_
#define MOBIUS_TOKENIZER_PRE_TOKENIZER_H_

#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tokenizer/regex.h"

namespace mobius::tokenizer {

// Words produced by the pre-tokenizer. Most views point into the caller's text; words that had
// to be rewritten (a prefix space added) live in `storage`.
struct WordList {
  std::vector<std::string_view> words;
  std::deque<std::string> storage;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

class PreTokenizer {
 public:
  // Errors name the unsupported type or setting. The sequence must end with exactly one
  // ByteLevel step, since the BPE model works on the byte-level alphabet.
  static absl::StatusOr<std::unique_ptr<PreTokenizer>> FromJson(const nlohmann::json& config);

  // Splits `text` (valid UTF-8) into words, appending them to `out` in order. `text` must
  // outlive `out`.
  absl::Status Split(std::string_view text, WordList& out) const;

 private:
  struct Step {
    std::unique_ptr<Regex> regex;  // Null for a step that splits nothing.
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
    bool add_prefix_space = false;
  };

  PreTokenizer() = default;
  absl::Status AddStep(const nlohmann::json& config, bool& saw_byte_level);
  // `storage` is a deque so that views into earlier entries stay valid as it grows.
  absl::Status ApplyStep(const Step& step, std::string_view word,
                         std::vector<std::string_view>& words,
                         std::deque<std::string>& storage) const;

  std::vector<Step> steps_;
};

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_PRE_TOKENIZER_H_
