// Text <-> token ids for byte-level BPE tokenizers shipped as Hugging Face `tokenizer.json`
// (the Qwen family used by Intern-S2-Mobius and Qwen3-Next). Produces the same ids as the
// Hugging Face `tokenizers` library for the supported components; anything else is refused
// when loading, with an error naming the component.
#ifndef MOBIUS_TOKENIZER_TOKENIZER_H_
#define MOBIUS_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"

namespace mobius::tokenizer {

struct EncodeOptions {
  // When false, special added tokens written in the text (e.g. "<|im_start|>" typed by a user)
  // are encoded as ordinary text instead of as their control id.
  bool parse_special_tokens = true;
};

struct DecodeOptions {
  // Leave out added tokens marked special (e.g. "<|im_end|>").
  bool skip_special_tokens = false;
};

class Tokenizer {
 public:
  // Loads `dir`/tokenizer.json.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromDirectory(const std::filesystem::path& dir);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJsonFile(const std::filesystem::path& path);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJsonString(std::string_view json);

  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Ids for `text`. Invalid UTF-8 is first replaced, one U+FFFD per maximal ill-formed
  // subsequence, so any byte string encodes. Linear-time in the input. Thread-safe.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              const EncodeOptions& options = {}) const;

  // Text for `ids`; an unknown id is InvalidArgument naming it. Byte sequences that do not form
  // valid UTF-8 (e.g. a character cut between ids) become U+FFFD, as in the reference.
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     const DecodeOptions& options = {}) const;

  // The raw bytes `id` decodes to, possibly part of a multi-byte character; empty when the id is
  // skipped under `options`. InvalidArgument for an unknown id.
  absl::StatusOr<std::string_view> TokenBytes(int32_t id, const DecodeOptions& options = {}) const;

  // Number of distinct ids, added tokens included.
  [[nodiscard]] size_t vocab_size() const { return vocab_size_; }
  // One past the largest id. Ids lie in [0, id_limit()); a file whose added tokens sit past its
  // vocabulary leaves unknown ids in between, so this can exceed vocab_size().
  [[nodiscard]] size_t id_limit() const { return id_known_.size(); }
  // Lookups use the token's stored spelling (byte-level alphabet, e.g. "Ġhello").
  [[nodiscard]] std::optional<int32_t> TokenToId(std::string_view token) const;
  [[nodiscard]] std::optional<std::string> IdToToken(int32_t id) const;
  [[nodiscard]] bool IsSpecialToken(int32_t id) const;

 private:
  Tokenizer() = default;
  absl::Status EncodePlainText(std::string_view text, const EncodeOptions& options,
                               std::vector<int32_t>& ids) const;
  absl::Status EncodeNormalizedText(std::string_view text, std::vector<int32_t>& ids) const;

  std::unique_ptr<BpeModel> model_;
  Normalizer normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<AddedTokenMatcher> raw_matcher_;         // normalized: false
  std::unique_ptr<AddedTokenMatcher> normalized_matcher_;  // normalized: true
  absl::flat_hash_map<int32_t, AddedToken> added_by_id_;
  absl::flat_hash_map<std::string, int32_t> added_by_content_;
  std::vector<std::string> decoded_bytes_;  // Indexed by id; see TokenBytes.
  std::vector<bool> id_known_;
  size_t vocab_size_ = 0;
};

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_TOKENIZER_H_
