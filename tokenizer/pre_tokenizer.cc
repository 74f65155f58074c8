#include "tokenizer/pre_tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "tokenizer/json_fields.h"

namespace mobius::tokenizer {
namespace {

constexpr char kSection[] = "tokenizer.json pre_tokenizer";

// The pattern GPT-2 style ByteLevel pre-tokenizers apply when `use_regex` is true.
constexpr std::string_view kByteLevelPattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

absl::StatusOr<SplitBehavior> ParseBehavior(const nlohmann::json& config) {
  if (!config.contains("behavior") || !config["behavior"].is_string()) {
    return absl::InvalidArgumentError("tokenizer.json pre_tokenizer Split: missing \"behavior\"");
  }
  const std::string name = config["behavior"].get<std::string>();
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return absl::InvalidArgumentError(
      absl::StrCat("tokenizer.json pre_tokenizer Split: unsupported behavior \"", name, "\""));
}

struct Segment {
  size_t start;
  size_t end;
  bool is_match;
};

// Applies a delimiter behaviour to the alternating match/gap segments of one word, following
// the Hugging Face definitions of each behaviour.
std::vector<std::pair<size_t, size_t>> ApplyBehavior(const std::vector<Segment>& segments,
                                                     SplitBehavior behavior) {
  std::vector<std::pair<size_t, size_t>> pieces;
  pieces.reserve(segments.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Segment& s : segments) pieces.emplace_back(s.start, s.end);
      break;
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments) {
        if (!s.is_match) pieces.emplace_back(s.start, s.end);
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Segment& s : segments) {
        if (s.is_match && !previous_match && !pieces.empty()) {
          pieces.back().second = s.end;
        } else {
          pieces.emplace_back(s.start, s.end);
        }
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->is_match && !previous_match && !pieces.empty()) {
          pieces.back().first = it->start;
        } else {
          pieces.emplace_back(it->start, it->end);
        }
        previous_match = it->is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Segment& s : segments) {
        if (s.is_match == previous_match && !pieces.empty()) {
          pieces.back().second = s.end;
        } else {
          pieces.emplace_back(s.start, s.end);
        }
        previous_match = s.is_match;
      }
      break;
  }
  return pieces;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::FromJson(const nlohmann::json& config) {
  auto pre_tokenizer = std::unique_ptr<PreTokenizer>(new PreTokenizer());
  bool saw_byte_level = false;
  RETURN_IF_ERROR(pre_tokenizer->AddStep(config, saw_byte_level));
  if (!saw_byte_level) {
    return absl::InvalidArgumentError(
        "tokenizer.json pre_tokenizer: a ByteLevel pre-tokenizer is required (only byte-level BPE "
        "tokenizers are supported)");
  }
  return pre_tokenizer;
}

absl::Status PreTokenizer::AddStep(const nlohmann::json& config, bool& saw_byte_level) {
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string()) {
    return absl::InvalidArgumentError(
        "tokenizer.json pre_tokenizer: expected an object with a \"type\"");
  }
  const std::string type = config["type"].get<std::string>();
  if (type == "Sequence") {
    if (!config.contains("pretokenizers") || !config["pretokenizers"].is_array()) {
      return absl::InvalidArgumentError(
          "tokenizer.json pre_tokenizer: Sequence needs a \"pretokenizers\" array");
    }
    for (const nlohmann::json& child : config["pretokenizers"]) {
      RETURN_IF_ERROR(AddStep(child, saw_byte_level));
    }
    return absl::OkStatus();
  }
  // ByteLevel rewrites words into its alphabet, so a later step would see different text.
  if (saw_byte_level) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer.json pre_tokenizer: \"", type,
        "\" after ByteLevel is not supported (ByteLevel must be the last pre-tokenizer)"));
  }
  Step step;
  if (type == "Split") {
    if (!config.contains("pattern") || !config["pattern"].is_object()) {
      return absl::InvalidArgumentError("tokenizer.json pre_tokenizer Split: missing \"pattern\"");
    }
    const nlohmann::json& pattern = config["pattern"];
    std::string regex_text;
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
      regex_text = pattern["Regex"].get<std::string>();
    } else if (pattern.contains("String") && pattern["String"].is_string()) {
      regex_text = EscapeRegexLiteral(pattern["String"].get<std::string>());
    } else {
      return absl::InvalidArgumentError(
          "tokenizer.json pre_tokenizer Split: \"pattern\" needs a \"Regex\" or \"String\"");
    }
    ASSIGN_OR_RETURN(step.regex, Regex::Compile(regex_text));
    ASSIGN_OR_RETURN(step.behavior, ParseBehavior(config));
    ASSIGN_OR_RETURN(step.invert, OptionalBool(config, "invert", false, kSection));
  } else if (type == "ByteLevel") {
    saw_byte_level = true;
    ASSIGN_OR_RETURN(step.add_prefix_space,
                     OptionalBool(config, "add_prefix_space", true, kSection));
    ASSIGN_OR_RETURN(const bool use_regex, OptionalBool(config, "use_regex", true, kSection));
    // trim_offsets only moves reported offsets; ids are the same either way.
    if (use_regex) {
      ASSIGN_OR_RETURN(step.regex, Regex::Compile(kByteLevelPattern));
    }
    step.behavior = SplitBehavior::kIsolated;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json pre_tokenizer: unsupported type \"", type,
                     "\" (supported: Sequence, Split, ByteLevel)"));
  }
  steps_.push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status PreTokenizer::ApplyStep(const Step& step, std::string_view word,
                                     std::vector<std::string_view>& words,
                                     std::deque<std::string>& storage) const {
  if (step.add_prefix_space && (word.empty() || word.front() != ' ')) {
    storage.push_back(std::string(" ").append(word));
    word = storage.back();
  }
  if (step.regex == nullptr) {
    if (!word.empty()) words.push_back(word);
    return absl::OkStatus();
  }
  std::vector<std::pair<size_t, size_t>> matches;
  RETURN_IF_ERROR(step.regex->FindAll(word, matches));
  std::vector<Segment> segments;
  segments.reserve(matches.size() * 2 + 1);
  size_t previous_end = 0;
  for (const auto& [start, end] : matches) {
    if (start > previous_end) segments.push_back({previous_end, start, step.invert});
    segments.push_back({start, end, !step.invert});
    previous_end = end;
  }
  if (previous_end < word.size()) segments.push_back({previous_end, word.size(), step.invert});
  for (const auto& [start, end] : ApplyBehavior(segments, step.behavior)) {
    // Empty pieces carry no text and Hugging Face drops them too.
    if (end > start) words.push_back(word.substr(start, end - start));
  }
  return absl::OkStatus();
}

absl::Status PreTokenizer::Split(std::string_view text, WordList& out) const {
  if (text.empty()) return absl::OkStatus();
  // The common case (one step) writes straight into `out`; longer sequences feed each step's
  // words to the next.
  std::vector<std::string_view> current = {text};
  for (size_t i = 0; i < steps_.size(); ++i) {
    const bool last = i + 1 == steps_.size();
    std::vector<std::string_view> next;
    std::vector<std::string_view>& target = last ? out.words : next;
    for (std::string_view word : current) {
      RETURN_IF_ERROR(ApplyStep(steps_[i], word, target, out.storage));
    }
    if (last) break;
    current = std::move(next);
  }
  return absl::OkStatus();
}

}  // namespace mobius::tokenizer
