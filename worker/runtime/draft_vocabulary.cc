#include "worker/runtime/draft_vocabulary.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"

namespace mobius::worker {

absl::StatusOr<DraftVocabulary> DraftVocabulary::Parse(std::string_view text, int vocab_size,
                                                       std::string_view source) {
  struct Entry {
    int32_t id;
    int64_t ordinal;  // 1-based
    int64_t line;
  };
  const std::string name(source);
  std::vector<Entry> entries;
  int64_t line = 1;
  size_t i = 0;
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
    const int64_t ordinal = static_cast<int64_t>(entries.size()) + 1;
    int64_t id = 0;
    if (!absl::SimpleAtoi(absl::string_view(word.data(), word.size()), &id)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: entry %d (line %d) is \"%s\", not a token id (decimal integers "
                          "separated by whitespace or commas)",
                          name, ordinal, line, std::string(word)));
    }
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: entry %d (line %d) is token %d, outside the model's vocabulary "
                          "[0, %d)",
                          name, ordinal, line, id, vocab_size));
    }
    entries.push_back({static_cast<int32_t>(id), ordinal, line});
    i = end;
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: no token ids (a draft vocabulary needs at least one; leave the map out to draft "
        "over the whole vocabulary)",
        name));
  }
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.id < b.id; });
  std::vector<int32_t> ids;
  ids.reserve(entries.size());
  for (size_t e = 0; e < entries.size(); ++e) {
    if (e > 0 && entries[e].id == entries[e - 1].id) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: token %d appears twice (entries %d and %d, lines %d and %d)", name, entries[e].id,
          entries[e - 1].ordinal, entries[e].ordinal, entries[e - 1].line, entries[e].line));
    }
    ids.push_back(entries[e].id);
  }
  return DraftVocabulary(std::move(ids));
}

absl::StatusOr<DraftVocabulary> DraftVocabulary::Load(const std::string& path, int vocab_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrFormat("draft vocabulary %s: cannot be read", path));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::DataLossError(absl::StrFormat("draft vocabulary %s: read failed", path));
  }
  return Parse(text.str(), vocab_size, path);
}

int32_t DraftVocabulary::TokenOfRow(int64_t index) const {
  if (index < 0) return -1;
  if (ids_.empty()) return static_cast<int32_t>(index);
  return index < static_cast<int64_t>(ids_.size()) ? ids_[static_cast<size_t>(index)] : -1;
}

}  // namespace mobius::worker
