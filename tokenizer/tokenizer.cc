#include "tokenizer/tokenizer.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "tokenizer/byte_level.h"
#include "tokenizer/utf8.h"

namespace mobius::tokenizer {
namespace {

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path.string()));
  return std::move(contents).str();
}

std::string TypeOf(const nlohmann::json& component) {
  if (component.is_object() && component.contains("type") && component["type"].is_string()) {
    return component["type"].get<std::string>();
  }
  return component.dump();
}

// The only decoder this library implements is ByteLevel (alone or as a one-element Sequence);
// its add_prefix_space/trim_offsets/use_regex settings do not affect decoding.
absl::Status CheckDecoder(const nlohmann::json& decoder) {
  if (decoder.is_null()) {
    return absl::InvalidArgumentError(
        "tokenizer.json decoder: missing (a ByteLevel decoder is required)");
  }
  const std::string type = TypeOf(decoder);
  if (type == "ByteLevel") return absl::OkStatus();
  if (type == "Sequence" && decoder.contains("decoders") && decoder["decoders"].is_array()) {
    for (const nlohmann::json& child : decoder["decoders"]) RETURN_IF_ERROR(CheckDecoder(child));
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json decoder: unsupported type \"",
                                                 type, "\" (supported: ByteLevel)"));
}

// ByteLevel post-processing only trims offsets; anything that would add ids is refused.
absl::Status CheckPostProcessor(const nlohmann::json& post_processor) {
  if (post_processor.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(post_processor);
  if (type == "ByteLevel") return absl::OkStatus();
  if (type == "Sequence" && post_processor.contains("processors") &&
      post_processor["processors"].is_array()) {
    for (const nlohmann::json& child : post_processor["processors"]) {
      RETURN_IF_ERROR(CheckPostProcessor(child));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "tokenizer.json post_processor: unsupported type \"", type, "\" (supported: ByteLevel)"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromDirectory(
    const std::filesystem::path& dir) {
  return FromJsonFile(dir / "tokenizer.json");
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJsonFile(
    const std::filesystem::path& path) {
  ASSIGN_OR_RETURN(const std::string contents, ReadFile(path));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = FromJsonString(contents);
  if (!tokenizer.ok()) {
    return absl::Status(tokenizer.status().code(),
                        absl::StrCat(path.string(), ": ", tokenizer.status().message()));
  }
  return tokenizer;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJsonString(std::string_view json) {
  const nlohmann::json root = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError("tokenizer.json is not a valid JSON object");
  }
  for (const char* key : {"truncation", "padding"}) {
    if (root.contains(key) && !root[key].is_null()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json: unsupported \"", key, "\" settings (must be null)"));
    }
  }
  auto tokenizer = std::unique_ptr<Tokenizer>(new Tokenizer());
  ASSIGN_OR_RETURN(tokenizer->model_, BpeModel::FromJson(root.value("model", nlohmann::json())));
  ASSIGN_OR_RETURN(tokenizer->normalizer_,
                   Normalizer::FromJson(root.value("normalizer", nlohmann::json())));
  if (!root.contains("pre_tokenizer") || root["pre_tokenizer"].is_null()) {
    return absl::InvalidArgumentError(
        "tokenizer.json pre_tokenizer: missing (a ByteLevel pre-tokenizer is required)");
  }
  ASSIGN_OR_RETURN(tokenizer->pre_tokenizer_, PreTokenizer::FromJson(root["pre_tokenizer"]));
  RETURN_IF_ERROR(CheckDecoder(root.value("decoder", nlohmann::json())));
  RETURN_IF_ERROR(CheckPostProcessor(root.value("post_processor", nlohmann::json())));

  std::vector<AddedToken> raw_tokens;
  std::vector<AddedToken> normalized_tokens;
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    if (!root["added_tokens"].is_array()) {
      return absl::InvalidArgumentError("tokenizer.json: \"added_tokens\" must be an array");
    }
    for (const nlohmann::json& entry : root["added_tokens"]) {
      ASSIGN_OR_RETURN(AddedToken token, ParseAddedToken(entry));
      tokenizer->added_by_content_[token.content] = token.id;
      tokenizer->added_by_id_[token.id] = token;
      if (token.normalized) {
        // Such tokens are looked for in normalised text, so their spelling is normalised too.
        token.content = tokenizer->normalizer_.Normalize(token.content);
        normalized_tokens.push_back(std::move(token));
      } else {
        raw_tokens.push_back(std::move(token));
      }
    }
  }
  tokenizer->raw_matcher_ = std::make_unique<AddedTokenMatcher>(std::move(raw_tokens));
  tokenizer->normalized_matcher_ =
      std::make_unique<AddedTokenMatcher>(std::move(normalized_tokens));

  // Decoded bytes per id, computed once so that decoding is a table lookup. An added token wins
  // over a model token with the same id, as in the reference.
  int32_t id_limit = tokenizer->model_->id_limit();
  for (const auto& [id, token] : tokenizer->added_by_id_) id_limit = std::max(id_limit, id + 1);
  tokenizer->decoded_bytes_.resize(id_limit);
  tokenizer->id_known_.assign(id_limit, false);
  for (int32_t id = 0; id < tokenizer->model_->id_limit(); ++id) {
    if (const std::string* token = tokenizer->model_->IdToToken(id); token != nullptr) {
      tokenizer->decoded_bytes_[id] = ByteLevelDecodeToken(*token);
      tokenizer->id_known_[id] = true;
    }
  }
  for (const auto& [id, token] : tokenizer->added_by_id_) {
    tokenizer->decoded_bytes_[id] = ByteLevelDecodeToken(token.content);
    tokenizer->id_known_[id] = true;
  }
  for (bool known : tokenizer->id_known_) tokenizer->vocab_size_ += known ? 1 : 0;
  return tokenizer;
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       const EncodeOptions& options) const {
  std::string sanitized;
  if (!IsValidUtf8(text)) {
    sanitized = ReplaceInvalidUtf8(text);
    text = sanitized;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<TextSegment> segments;
  raw_matcher_->Split(text, options.parse_special_tokens, segments);
  for (const TextSegment& segment : segments) {
    if (segment.token_id >= 0) {
      ids.push_back(segment.token_id);
    } else {
      RETURN_IF_ERROR(EncodePlainText(segment.text, options, ids));
    }
  }
  return ids;
}

absl::Status Tokenizer::EncodePlainText(std::string_view text, const EncodeOptions& options,
                                        std::vector<int32_t>& ids) const {
  if (normalizer_.is_identity() && normalized_matcher_->empty()) {
    return EncodeNormalizedText(text, ids);
  }
  const std::string normalized = normalizer_.Normalize(text);
  std::vector<TextSegment> segments;
  normalized_matcher_->Split(normalized, options.parse_special_tokens, segments);
  for (const TextSegment& segment : segments) {
    if (segment.token_id >= 0) {
      ids.push_back(segment.token_id);
    } else {
      RETURN_IF_ERROR(EncodeNormalizedText(segment.text, ids));
    }
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::EncodeNormalizedText(std::string_view text,
                                             std::vector<int32_t>& ids) const {
  WordList words;
  RETURN_IF_ERROR(pre_tokenizer_->Split(text, words));
  for (std::string_view word : words.words) model_->EncodeWord(word, ids);
  return absl::OkStatus();
}

absl::StatusOr<std::string_view> Tokenizer::TokenBytes(int32_t id,
                                                       const DecodeOptions& options) const {
  if (id < 0 || static_cast<size_t>(id) >= id_known_.size() || !id_known_[id]) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown token id ", id, " (vocabulary has ", id_known_.size(), " ids)"));
  }
  if (options.skip_special_tokens && IsSpecialToken(id)) return std::string_view();
  return std::string_view(decoded_bytes_[id]);
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids,
                                              const DecodeOptions& options) const {
  std::string bytes;
  for (int32_t id : ids) {
    ASSIGN_OR_RETURN(const std::string_view piece, TokenBytes(id, options));
    bytes.append(piece);
  }
  if (IsValidUtf8(bytes)) return bytes;
  return ReplaceInvalidUtf8(bytes);
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  if (const auto it = added_by_content_.find(absl::string_view(token.data(), token.size()));
      it != added_by_content_.end()) {
    return it->second;
  }
  return model_->TokenToId(token);
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (const auto it = added_by_id_.find(id); it != added_by_id_.end()) return it->second.content;
  if (const std::string* token = model_->IdToToken(id); token != nullptr) return *token;
  return std::nullopt;
}

bool Tokenizer::IsSpecialToken(int32_t id) const {
  const auto it = added_by_id_.find(id);
  return it != added_by_id_.end() && it->second.special;
}

}  // namespace mobius::tokenizer
