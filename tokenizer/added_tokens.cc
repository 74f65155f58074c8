#include "tokenizer/added_tokens.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "tokenizer/bpe_model.h"
#include "tokenizer/json_fields.h"
#include "tokenizer/utf8.h"
#include "utf8proc.h"

namespace mobius::tokenizer {
namespace {

// Start of the character that ends just before `pos`.
size_t PreviousCharStart(std::string_view text, size_t pos) {
  size_t start = pos - 1;
  while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
  return start;
}

// Approximates Rust's char::is_alphanumeric (Alphabetic or Numeric) by general category.
bool IsWordCharacter(char32_t cp) {
  if (cp == '_') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

bool EndsWithWordCharacter(std::string_view text, size_t end) {
  if (end == 0) return false;
  return IsWordCharacter(DecodeUtf8Step(text, PreviousCharStart(text, end)).code_point);
}

bool StartsWithWordCharacter(std::string_view text, size_t start) {
  if (start >= text.size()) return false;
  return IsWordCharacter(DecodeUtf8Step(text, start).code_point);
}

// Start of the run of whitespace that ends at `end`.
size_t WhitespaceRunStart(std::string_view text, size_t end) {
  while (end > 0) {
    const size_t start = PreviousCharStart(text, end);
    if (!IsUnicodeWhitespace(DecodeUtf8Step(text, start).code_point)) break;
    end = start;
  }
  return end;
}

// End of the run of whitespace that starts at `start`.
size_t WhitespaceRunEnd(std::string_view text, size_t start) {
  while (start < text.size()) {
    const Utf8Step step = DecodeUtf8Step(text, start);
    if (!IsUnicodeWhitespace(step.code_point)) break;
    start += step.length;
  }
  return start;
}

}  // namespace

absl::StatusOr<AddedToken> ParseAddedToken(const nlohmann::json& entry) {
  if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_number_integer() ||
      !entry.contains("content") || !entry["content"].is_string()) {
    return absl::InvalidArgumentError(
        "tokenizer.json added_tokens: each entry needs an integer \"id\" and a \"content\"");
  }
  AddedToken token;
  const int64_t id = entry["id"].get<int64_t>();
  if (id < 0 || id >= kTokenIdLimit) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json added_tokens: invalid id ", id,
                                                   " (ids must be in [0, ", kTokenIdLimit, "))"));
  }
  token.id = static_cast<int32_t>(id);
  token.content = entry["content"].get<std::string>();
  if (token.content.empty() || !IsValidUtf8(token.content)) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json added_tokens: token ", id,
                                                   " has empty or invalid UTF-8 content"));
  }
  for (auto [key, field] :
       {std::pair{"single_word", &AddedToken::single_word},
        std::pair{"lstrip", &AddedToken::lstrip}, std::pair{"rstrip", &AddedToken::rstrip},
        std::pair{"normalized", &AddedToken::normalized},
        std::pair{"special", &AddedToken::special}}) {
    ASSIGN_OR_RETURN(token.*field, OptionalBool(entry, key, false, "tokenizer.json added_tokens"));
  }
  return token;
}

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)) {
  for (const AddedToken& token : tokens_) {
    by_first_byte_[static_cast<uint8_t>(token.content.front())].push_back(&token);
  }
  for (auto& candidates : by_first_byte_) {
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const AddedToken* a, const AddedToken* b) {
                       return a->content.size() > b->content.size();
                     });
  }
}

AddedTokenMatcher::Match AddedTokenMatcher::FindNext(std::string_view text, size_t from) const {
  for (size_t pos = from; pos < text.size(); ++pos) {
    const auto& candidates = by_first_byte_[static_cast<uint8_t>(text[pos])];
    for (const AddedToken* token : candidates) {
      if (text.compare(pos, token->content.size(), token->content) == 0) {
        return {pos, pos + token->content.size(), token};
      }
    }
  }
  return {text.size(), text.size(), nullptr};
}

void AddedTokenMatcher::Split(std::string_view text, bool match_special,
                              std::vector<TextSegment>& out) const {
  size_t emitted = 0;  // Everything before this offset has been emitted.
  size_t search_from = 0;
  while (!tokens_.empty()) {
    const Match match = FindNext(text, search_from);
    if (match.token == nullptr) break;
    // A rejected match still consumes its bytes, as in the reference's non-overlapping scan.
    search_from = match.end;
    if (!match_special && match.token->special) continue;
    if (match.token->single_word &&
        (EndsWithWordCharacter(text, match.start) || StartsWithWordCharacter(text, match.end))) {
      continue;
    }
    size_t start = match.start;
    size_t end = match.end;
    if (match.token->lstrip) start = std::max(WhitespaceRunStart(text, start), emitted);
    if (match.token->rstrip) end = WhitespaceRunEnd(text, end);
    if (emitted < start) out.push_back({text.substr(emitted, start - emitted), -1});
    out.push_back({text.substr(match.start, match.end - match.start), match.token->id});
    // Like the reference, the next search resumes at the match itself, not after the stripped
    // whitespace.
    emitted = std::max(emitted, end);
  }
  if (emitted < text.size()) out.push_back({text.substr(emitted), -1});
}

}  // namespace mobius::tokenizer
