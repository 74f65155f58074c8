#include "worker/runtime/draft_vocabulary.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace mobius::worker {

absl::StatusOr<DraftVocabulary> DraftVocabulary::Parse(std::string_view text, int vocab_size,
                                                       std::string_view source) {
  const std::string name(source);
  // The entry (1-based) and line where each id was first listed, so that a duplicate names both
  // places as it is read (and the ids never outgrow the vocabulary).
  std::vector<std::pair<int64_t, int64_t>> first_seen(static_cast<size_t>(std::max(vocab_size, 0)),
                                                      {0, 0});
  std::vector<int32_t> ids;
  int64_t line = 1;
  size_t i = 0;
  if (text.substr(0, 3) == "\xEF\xBB\xBF") i = 3;  // a UTF-8 byte order mark, as editors write
  auto separator = [](char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == ',' || c == '[' || c == ']';
  };
  while (i < text.size()) {
    const char c = text[i];
    if (c == '\n') ++line;
    if (separator(c)) {
      ++i;
      continue;
    }
    if (c == '#') {
      while (i < text.size() && text[i] != '\n') ++i;
      continue;
    }
    size_t end = i;
    while (end < text.size() && !separator(text[end]) && text[end] != '#') ++end;
    const std::string_view word = text.substr(i, end - i);
    const int64_t ordinal = static_cast<int64_t>(ids.size()) + 1;
    int64_t id = 0;
    if (!absl::SimpleAtoi(absl::string_view(word.data(), word.size()), &id)) {
      // Escaped and cut short: a binary file given by mistake must not flood the message.
      constexpr size_t kShown = 40;
      const std::string shown =
          absl::CHexEscape(absl::string_view(word.data(), std::min(word.size(), kShown))) +
          (word.size() > kShown ? "..." : "");
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: entry %d (line %d) is \"%s\", not a token id (decimal integers "
                          "separated by whitespace or commas)",
                          name, ordinal, line, shown));
    }
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: entry %d (line %d) is token %d, outside the model's vocabulary "
                          "[0, %d)",
                          name, ordinal, line, id, vocab_size));
    }
    auto& [first_entry, first_line] = first_seen[static_cast<size_t>(id)];
    if (first_entry > 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: token %d appears twice (entries %d and %d, lines %d and %d)", name,
                          id, first_entry, ordinal, first_line, line));
    }
    first_entry = ordinal;
    first_line = line;
    ids.push_back(static_cast<int32_t>(id));
    i = end;
  }
  if (ids.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: no token ids (a draft vocabulary needs at least one; leave the map out to draft "
        "over the whole vocabulary)",
        name));
  }
  std::sort(ids.begin(), ids.end());
  return DraftVocabulary(std::move(ids));
}

absl::StatusOr<DraftVocabulary> DraftVocabulary::Load(const std::string& path, int vocab_size) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return absl::NotFoundError(
        absl::StrFormat("draft vocabulary %s: not a readable file%s", path,
                        error ? absl::StrCat(" (", error.message(), ")") : std::string()));
  }
  // Every id once with a separator: a file far past that is not a map (a checkpoint shard given
  // by mistake would otherwise be read whole first).
  const uintmax_t size = std::filesystem::file_size(path, error);
  const uintmax_t limit = 32 * static_cast<uintmax_t>(std::max(vocab_size, 0)) + (1u << 20);
  if (error || size > limit) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "draft vocabulary %s: %s bytes, more than a map of a %d-token vocabulary can need (%d)",
        path, error ? std::string("unknown") : std::to_string(size), vocab_size, limit));
  }
  std::ifstream in(path, std::ios::binary);
  std::string text(static_cast<size_t>(size), '\0');
  if (!in || !in.read(text.data(), static_cast<std::streamsize>(size))) {
    return absl::DataLossError(absl::StrFormat("draft vocabulary %s: reading %d bytes failed: %s",
                                               path, size, std::strerror(errno)));
  }
  return Parse(text, vocab_size, path);
}

int32_t DraftVocabulary::TokenOfRow(int64_t index) const {
  if (index < 0) return -1;
  if (ids_.empty()) return static_cast<int32_t>(index);
  return index < static_cast<int64_t>(ids_.size()) ? ids_[static_cast<size_t>(index)] : -1;
}

}  // namespace mobius::worker
