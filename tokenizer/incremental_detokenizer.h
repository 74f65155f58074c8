// Streaming decode: turns ids arriving one at a time into text that can be sent to a client at
// once, holding back only the bytes of a character that is not complete yet. The concatenation
// of everything returned equals Tokenizer::Decode of all ids.
#ifndef MOBIUS_TOKENIZER_INCREMENTAL_DETOKENIZER_H_
#define MOBIUS_TOKENIZER_INCREMENTAL_DETOKENIZER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"

namespace mobius::tokenizer {

class IncrementalDetokenizer {
 public:
  // `tokenizer` must outlive this object.
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, DecodeOptions options = {});

  // Adds `id` and returns the text it completed: always valid UTF-8, possibly empty. An
  // unknown id is InvalidArgument and leaves the state unchanged.
  absl::StatusOr<std::string> Push(int32_t id);

  // Ends the stream: returns the held-back bytes (an unfinished character becomes U+FFFD, as in
  // a full decode) and resets the state for a new stream.
  std::string Finish();

  // Bytes of an unfinished character waiting for the next id (at most 3).
  [[nodiscard]] size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer& tokenizer_;
  DecodeOptions options_;
  std::string pending_;
};

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_INCREMENTAL_DETOKENIZER_H_
