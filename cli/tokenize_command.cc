// `mobius tokenize`: encode text to token ids, or decode ids to text, with the same tokenizer
// library the router uses, printing one JSON object so that scripts can compare against other
// tokenizers.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "tokenizer/tokenizer.h"

ABSL_FLAG(std::string, tokenizer, "",
          "Tokenizer to use: a model directory holding tokenizer.json (Hugging Face format, "
          "byte-level BPE as shipped with Qwen-family models), or the path of a tokenizer.json "
          "file. Required.");
ABSL_FLAG(
    std::optional<std::string>, text, std::nullopt,
    "Text to encode; prints {\"ids\": [...]}. Special tokens written in the text (e.g. "
    "<|im_start|>) are encoded as their control ids. Invalid UTF-8 is replaced by U+FFFD "
    "before encoding. Exactly one of --text, --file and --decode must be given (an empty value "
    "counts as not given; encode empty input with --file /dev/null).");
ABSL_FLAG(std::optional<std::string>, file, std::nullopt,
          "Path of a file whose whole contents (bytes, no newline stripped) are encoded like "
          "--text; prints {\"ids\": [...]}. Use for large or multi-line input.");
ABSL_FLAG(std::optional<std::string>, decode, std::nullopt,
          "Comma-separated token ids to decode, e.g. --decode 9707,11,1879; prints "
          "{\"text\": \"...\"}. Special tokens are kept; bytes that do not form complete UTF-8 "
          "characters become U+FFFD. An id outside the vocabulary is an error.");

ABSL_FLAG(int, hot_tokens, 0,
          "With --file or --text: instead of the ids, print the N most frequent token ids of the "
          "encoded input as a JSON array (most frequent first, ties by lower id; fewer when the "
          "input has fewer distinct tokens), and on stderr the share of the input's tokens they "
          "cover. The array is a draft vocabulary for --spec-token-map (`mobius tokenize "
          "--tokenizer DIR --file corpus.txt --hot-tokens 32768 > hot.json`); encode text like "
          "the outputs the server produces. 0 (the default): print the ids.");

namespace mobius::cli {
namespace {

// Bad usage (exit code 2) is reported as InvalidArgument; anything else is a runtime error.
constexpr absl::StatusCode kUsageError = absl::StatusCode::kInvalidArgument;

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& list) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    part = absl::StripAsciiWhitespace(part);
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--decode: \"", part, "\" is not an integer token id"));
    }
    ids.push_back(id);
  }
  return ids;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("--file: cannot open ", path));
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) return absl::DataLossError(absl::StrCat("--file: cannot read ", path));
  return std::move(contents).str();
}

absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> LoadTokenizer(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_regular_file(path, error)) {
    return tokenizer::Tokenizer::FromJsonFile(path);
  }
  return tokenizer::Tokenizer::FromDirectory(path);
}

// --hot-tokens: the `count` most frequent ids of `ids` as a JSON array, and their coverage.
absl::Status PrintHotTokens(const std::vector<int32_t>& ids, int count) {
  absl::flat_hash_map<int32_t, int64_t> frequency;
  for (int32_t id : ids) ++frequency[id];
  std::vector<std::pair<int32_t, int64_t>> ranked(frequency.begin(), frequency.end());
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  if (ranked.size() > static_cast<size_t>(count)) ranked.resize(static_cast<size_t>(count));
  nlohmann::json hot = nlohmann::json::array();
  int64_t covered = 0;
  for (const auto& [id, n] : ranked) {
    hot.push_back(id);
    covered += n;
  }
  std::fprintf(stderr,
               "mobius tokenize: %zu hot tokens (of %zu distinct) cover %.2f%% of the input's "
               "%zu tokens\n",
               ranked.size(), frequency.size(),
               ids.empty() ? 0.0 : 100.0 * static_cast<double>(covered) / ids.size(), ids.size());
  if (ranked.empty()) {
    return absl::FailedPreconditionError("--hot-tokens: the input encodes to no tokens");
  }
  std::printf("%s\n", hot.dump().c_str());
  return absl::OkStatus();
}

absl::Status Tokenize() {
  const std::optional<std::string> text = absl::GetFlag(FLAGS_text);
  const std::optional<std::string> file = absl::GetFlag(FLAGS_file);
  const std::optional<std::string> decode = absl::GetFlag(FLAGS_decode);
  const int modes = text.has_value() + file.has_value() + decode.has_value();
  if (modes != 1) {
    return absl::Status(kUsageError, "exactly one of --text, --file and --decode is required");
  }
  const int hot_tokens = absl::GetFlag(FLAGS_hot_tokens);
  if (hot_tokens < 0 || (hot_tokens > 0 && decode.has_value())) {
    return absl::Status(kUsageError,
                        absl::StrCat("--hot-tokens is ", hot_tokens,
                                     "; it must be >= 0, and > 0 goes with --file or --text"));
  }
  const std::string tokenizer_path = absl::GetFlag(FLAGS_tokenizer);
  if (tokenizer_path.empty()) {
    return absl::Status(kUsageError, "--tokenizer DIR is required");
  }
  std::vector<int32_t> ids_to_decode;
  if (decode.has_value()) {
    // Parse before the (slower) tokenizer load so that a typo fails at once.
    ASSIGN_OR_RETURN(ids_to_decode, ParseIds(*decode));
  }
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tokenizer = LoadTokenizer(tokenizer_path);
  if (!tokenizer.ok()) {
    // A tokenizer that exists but cannot be used is a runtime error, not bad usage.
    return absl::FailedPreconditionError(tokenizer.status().ToString());
  }

  nlohmann::json output;
  if (decode.has_value()) {
    absl::StatusOr<std::string> decoded = (*tokenizer)->Decode(ids_to_decode);
    if (!decoded.ok()) return absl::Status(kUsageError, decoded.status().message());
    output["text"] = *decoded;
  } else {
    std::string input = text.value_or("");
    if (file.has_value()) {
      absl::StatusOr<std::string> contents = ReadWholeFile(*file);
      if (!contents.ok()) return absl::FailedPreconditionError(contents.status().message());
      input = *std::move(contents);
    }
    ASSIGN_OR_RETURN(const std::vector<int32_t> ids, (*tokenizer)->Encode(input));
    if (hot_tokens > 0) return PrintHotTokens(ids, hot_tokens);
    output["ids"] = ids;
  }
  // Decoded text is always valid UTF-8; `replace` only guards the dump against surprises.
  const std::string json = output.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::printf("%s\n", json.c_str());
  return absl::OkStatus();
}

}  // namespace

int RunTokenizeCommand() {
  const absl::Status status = Tokenize();
  if (status.ok()) return 0;
  std::fprintf(stderr, "mobius tokenize: %s\n", std::string(status.message()).c_str());
  return status.code() == kUsageError ? 2 : 1;
}

}  // namespace mobius::cli
