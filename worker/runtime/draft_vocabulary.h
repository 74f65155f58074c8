// The token ids an MTP head may propose: a "hot" vocabulary, as SGLang's
// --speculative-token-map and FR-Spec's frequency-ranked draft vocabulary. The head's lm_head
// then keeps only these rows, so a draft step reads N rows of the output projection instead of
// the whole vocabulary's (at release scale the lm_head is 1.02 GB, two thirds of a batch-1 head
// step). Drafts never change outputs: the target verifies every draft against its full
// vocabulary, so a smaller map can only lower the acceptance rate, never the results. Which
// tokens to keep is the user's choice, for example the most frequent tokens of their traffic.
#ifndef MOBIUS_WORKER_RUNTIME_DRAFT_VOCABULARY_H_
#define MOBIUS_WORKER_RUNTIME_DRAFT_VOCABULARY_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace mobius::worker {

class DraftVocabulary {
 public:
  // The whole vocabulary (no map): the head keeps the target's lm_head.
  DraftVocabulary() = default;

  // Token ids in decimal (a leading '+' or zeros are accepted), separated by whitespace, commas
  // or brackets (so a JSON array of ints parses as well); `#` starts a comment that runs to the
  // end of the line; a UTF-8 byte order mark is skipped. Every id must lie in
  // [0, vocab_size) and appear once, and there must be at least one. Errors name `source`, the
  // entry (1-based, with its line) and the reason.
  static absl::StatusOr<DraftVocabulary> Parse(std::string_view text, int vocab_size,
                                               std::string_view source);
  // Parse of the file at `path`. NotFound when it is not a regular file; InvalidArgument when
  // it is larger than any map of `vocab_size` tokens could be (it is never read then).
  static absl::StatusOr<DraftVocabulary> Load(const std::string& path, int vocab_size);

  [[nodiscard]] bool whole() const { return ids_.empty(); }
  // Ascending: so that the head's argmax over the kept rows breaks exact ties toward the lower
  // id, as the argmax over the whole vocabulary does.
  [[nodiscard]] std::span<const int32_t> ids() const { return ids_; }
  // The vocabulary id of row `index` of the head's logits (the index itself when whole()), or
  // -1 when `index` is not a row.
  [[nodiscard]] int32_t TokenOfRow(int64_t index) const;

 private:
  explicit DraftVocabulary(std::vector<int32_t> ids) : ids_(std::move(ids)) {}

  std::vector<int32_t> ids_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_DRAFT_VOCABULARY_H_
