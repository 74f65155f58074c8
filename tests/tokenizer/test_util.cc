#include "tests/tokenizer/test_util.h"

#include <fstream>

#include "tokenizer/byte_level.h"

namespace mobius::tokenizer::testing {

std::filesystem::path QwenTokenizerDir() {
  return std::filesystem::path(MOBIUS_FIXTURES_DIR) / "tokenizer-qwen3";
}

std::filesystem::path TestDataDir() { return MOBIUS_TOKENIZER_TESTDATA_DIR; }

nlohmann::json ReadJsonFileOrFail(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    ADD_FAILURE() << "missing fixture " << path
                  << " (set the CMake cache variable MOBIUS_FIXTURES_DIR to the fixtures folder)";
    return nlohmann::json();
  }
  nlohmann::json json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    ADD_FAILURE() << "fixture " << path << " is not valid JSON";
    return nlohmann::json();
  }
  return json;
}

const Tokenizer* QwenTokenizerOrFail() {
  static const absl::StatusOr<std::unique_ptr<Tokenizer>>* const loaded =
      new absl::StatusOr<std::unique_ptr<Tokenizer>>(Tokenizer::FromDirectory(QwenTokenizerDir()));
  if (!loaded->ok()) {
    ADD_FAILURE() << "cannot load the Qwen3 tokenizer fixture from " << QwenTokenizerDir()
                  << " (set MOBIUS_FIXTURES_DIR): " << loaded->status();
    return nullptr;
  }
  return loaded->value().get();
}

nlohmann::json TinyTokenizerJson(const std::vector<std::pair<std::string, std::string>>& merges,
                                 const nlohmann::json& added_tokens) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    vocab[BytesToAlphabet(std::string(1, static_cast<char>(b)))] = b;
  }
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [left, right] : merges) {
    if (!vocab.contains(left + right)) vocab[left + right] = static_cast<int>(vocab.size());
    merge_list.push_back({left, right});
  }
  nlohmann::json byte_level = {{"type", "ByteLevel"},
                               {"add_prefix_space", false},
                               {"trim_offsets", false},
                               {"use_regex", false}};
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added_tokens},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", "\\s+|[^\\s]+"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          byte_level}}}},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
}

std::unique_ptr<Tokenizer> TinyTokenizerOrFail(const nlohmann::json& json) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromJsonString(json.dump());
  if (!tokenizer.ok()) {
    ADD_FAILURE() << "cannot load the synthetic tokenizer: " << tokenizer.status();
    return nullptr;
  }
  return *std::move(tokenizer);
}

std::vector<int32_t> EncodeOrFail(const Tokenizer& tokenizer, std::string_view text,
                                  const EncodeOptions& options) {
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(text, options);
  if (!ids.ok()) {
    ADD_FAILURE() << "Encode failed: " << ids.status();
    return {};
  }
  return *std::move(ids);
}

}  // namespace mobius::tokenizer::testing
