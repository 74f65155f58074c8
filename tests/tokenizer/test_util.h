// Shared helpers for the tokenizer tests: locating fixtures (missing fixtures fail the test with
// a message naming the path) and a tiny synthetic tokenizer.json for unit tests.
#ifndef MOBIUS_TESTS_TOKENIZER_TEST_UTIL_H_
#define MOBIUS_TESTS_TOKENIZER_TEST_UTIL_H_

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tokenizer/tokenizer.h"

namespace mobius::tokenizer::testing {

std::filesystem::path QwenTokenizerDir();
std::filesystem::path TestDataDir();

// Parses a JSON file; on failure records a test failure and returns null JSON.
nlohmann::json ReadJsonFileOrFail(const std::filesystem::path& path);

// The Qwen3 tokenizer from the fixtures, loaded once per process; null (with a recorded test
// failure) when it cannot be loaded.
const Tokenizer* QwenTokenizerOrFail();

// A minimal byte-level BPE tokenizer.json: the 256 byte tokens, the given merges (pairs of
// byte-level spellings, added to the vocab in order) and the given added tokens.
nlohmann::json TinyTokenizerJson(const std::vector<std::pair<std::string, std::string>>& merges,
                                 const nlohmann::json& added_tokens = nlohmann::json::array());

std::unique_ptr<Tokenizer> TinyTokenizerOrFail(const nlohmann::json& json);

// Ids of `text` or a recorded failure.
std::vector<int32_t> EncodeOrFail(const Tokenizer& tokenizer, std::string_view text,
                                  const EncodeOptions& options = {});

}  // namespace mobius::tokenizer::testing

#endif  // MOBIUS_TESTS_TOKENIZER_TEST_UTIL_H_
