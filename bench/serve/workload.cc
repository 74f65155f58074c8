#include "bench/serve/workload.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/json_parse.h"

namespace mobius::bench {
namespace {

// Common English words: with a Qwen-family tokenizer each is one token after a space, so a
// prompt of N words is close to N tokens.
constexpr const char* kWords[] = {
    "the",   "of",    "and",   "to",     "in",   "is",   "you",   "that",   "it",    "he",
    "was",   "for",   "on",    "are",    "as",   "with", "his",   "they",   "at",    "be",
    "this",  "have",  "from",  "or",     "one",  "had",  "by",    "word",   "but",   "not",
    "what",  "all",   "were",  "we",     "when", "your", "can",   "said",   "there", "use",
    "an",    "each",  "which", "she",    "do",   "how",  "their", "if",     "will",  "up",
    "other", "about", "out",   "many",   "then", "them", "these", "so",     "some",  "her",
    "would", "make",  "like",  "him",    "into", "time", "has",   "look",   "two",   "more",
    "write", "go",    "see",   "number", "no",   "way",  "could", "people", "my",    "than",
    "first", "water", "been",  "call",   "who",  "oil",  "its",   "now",    "find",  "long",
    "down",  "day",   "did",   "get",    "come", "made", "may",   "part",   "over",  "new"};

absl::Status CheckLength(const char* flag, int value) {
  if (value < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be >= 1, got ", value));
  }
  return absl::OkStatus();
}

// Uniform in [len * (1 - ratio), len * (1 + ratio)], at least 1.
int DrawLength(int len, double ratio, std::mt19937_64& rng) {
  const int low = std::max(1, static_cast<int>(len * (1 - ratio)));
  const int high = std::max(low, static_cast<int>(len * (1 + ratio)));
  return std::uniform_int_distribution<int>(low, high)(rng);
}

}  // namespace

absl::StatusOr<std::vector<BenchRequest>> MakeRandomWorkload(const RandomWorkloadOptions& options) {
  if (absl::Status s = CheckLength("random-input-len", options.input_len); !s.ok()) return s;
  if (absl::Status s = CheckLength("random-output-len", options.output_len); !s.ok()) return s;
  if (!(options.range_ratio >= 0 && options.range_ratio < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--random-range-ratio must be in [0, 1), got ", options.range_ratio));
  }
  if (options.vocab_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab-size must be >= 1, got ", options.vocab_size));
  }
  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<int32_t> token(0, options.vocab_size - 1);
  std::uniform_int_distribution<size_t> word(0, std::size(kWords) - 1);
  std::vector<BenchRequest> requests(std::max(options.num_prompts, 0));
  for (BenchRequest& r : requests) {
    r.prompt_len = DrawLength(options.input_len, options.range_ratio, rng);
    r.output_len = DrawLength(options.output_len, options.range_ratio, rng);
    r.is_text = options.text;
    if (options.text) {
      for (int i = 0; i < r.prompt_len; ++i) {
        absl::StrAppend(&r.prompt_text, i == 0 ? "" : " ", kWords[word(rng)]);
      }
    } else {
      r.prompt_ids.resize(r.prompt_len);
      for (int32_t& id : r.prompt_ids) id = token(rng);
    }
  }
  return requests;
}

absl::StatusOr<std::vector<BenchRequest>> LoadJsonlWorkload(const std::string& path,
                                                            int num_prompts,
                                                            int default_output_len) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--dataset: cannot open ", path));
  std::vector<BenchRequest> lines;
  std::string text;
  for (int line_number = 1; std::getline(in, text); ++line_number) {
    if (absl::StripAsciiWhitespace(text).empty()) continue;
    const std::string where = absl::StrCat(path, ":", line_number, ": ");
    absl::StatusOr<nlohmann::json> parsed = ParseJson(text);
    if (!parsed.ok())
      return absl::InvalidArgumentError(where + std::string(parsed.status().message()));
    const nlohmann::json& j = *parsed;
    if (!j.is_object()) return absl::InvalidArgumentError(where + "expected a JSON object");
    BenchRequest r;
    auto prompt = j.find("prompt");
    if (prompt == j.end()) return absl::InvalidArgumentError(where + "no \"prompt\"");
    if (prompt->is_string()) {
      r.is_text = true;
      r.prompt_text = prompt->get<std::string>();
      if (r.prompt_text.empty()) return absl::InvalidArgumentError(where + "empty \"prompt\"");
      // An estimate for the report until the server's usage count replaces it.
      r.prompt_len = 1;
      for (char c : r.prompt_text) r.prompt_len += c == ' ';
    } else if (prompt->is_array() && !prompt->empty()) {
      for (const nlohmann::json& id : *prompt) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
            id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
          return absl::InvalidArgumentError(
              where + "\"prompt\" must hold non-negative 32-bit token ids, got " + id.dump());
        }
        r.prompt_ids.push_back(id.get<int32_t>());
      }
      r.prompt_len = static_cast<int>(r.prompt_ids.size());
    } else {
      return absl::InvalidArgumentError(
          where + "\"prompt\" must be a string or a non-empty array of token ids");
    }
    r.output_len = default_output_len;
    for (const char* key : {"max_tokens", "output_len"}) {
      auto it = j.find(key);
      if (it == j.end() || it->is_null()) continue;
      if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > (1 << 30)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "\"", key, "\" must be a positive integer, got ", it->dump()));
      }
      r.output_len = it->get<int>();
    }
    lines.push_back(std::move(r));
  }
  if (lines.empty())
    return absl::InvalidArgumentError(absl::StrCat("--dataset ", path, ": no prompts"));
  std::vector<BenchRequest> requests;
  for (int i = 0; i < num_prompts; ++i) requests.push_back(lines[i % lines.size()]);
  return requests;
}

}  // namespace mobius::bench
