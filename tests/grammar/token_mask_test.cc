#include "grammar/token_mask.h"

#include <algorithm>
#include <bit>
#include <filesystem>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "grammar/json_schema_compiler.h"
#include "grammar/structured_output.h"
#include "grammar/tokenizer_vocabulary.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/grammar/brute_force_mask.h"
#include "tests/tokenizer/test_util.h"
#include "tokenizer/tokenizer.h"

namespace mobius::grammar {
namespace {

// The Qwen3 tokenizer's tokens as bytes (special tokens empty), loaded once.
std::shared_ptr<const TokenVocabulary> QwenVocabulary() {
  static std::shared_ptr<const TokenVocabulary> vocab = [] {
    const std::filesystem::path dir =
        std::filesystem::path(MOBIUS_FIXTURES_DIR) / "tokenizer-qwen3";
    absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok =
        tokenizer::Tokenizer::FromDirectory(dir);
    if (!tok.ok()) {
      ADD_FAILURE() << "the Qwen3 tokenizer fixture at " << dir << ": " << tok.status();
      return std::shared_ptr<const TokenVocabulary>();
    }
    return VocabularyFromTokenizer(**tok, (*tok)->id_limit());
  }();
  return vocab;
}

using ::mobius::grammar::testing::BruteForceMask;

// The mask at each state the prefixes reach equals the brute-force one.
void ExpectMasksMatchBruteForce(const Grammar& g, const TokenVocabulary& vocab,
                                const std::vector<std::string>& prefixes) {
  for (const std::string& prefix : prefixes) {
    GrammarMatcher state(g);
    ASSERT_TRUE(state.FeedBytes(prefix)) << prefix;
    TokenBitmask fast;
    vocab.ComputeMask(state, fast);
    EXPECT_EQ(fast, BruteForceMask(state, vocab)) << prefix;
  }
}

TEST(TokenMaskTest, SmallVocabularyTrieMatchesBruteForce) {
  const TokenVocabulary vocab({"{", "{\"", "\"", "\":",  "a",   "ab",   "abc",  "",         "}",
                               " ", "1",   "12", "\"}",  "x\"", "\xc3", "\xa9", "\xc3\xa9", "ab",
                               "[", "]",   ",",  "true", "tr",  "ue",   "null"});
  const Grammar g = JsonObjectGrammar();
  GrammarMatcher state(g);
  std::mt19937 rng(7);
  // Walk a random path of allowed tokens, checking the mask at every state.
  for (int step = 0; step < 40; ++step) {
    TokenBitmask fast;
    vocab.ComputeMask(state, fast);
    const TokenBitmask slow = BruteForceMask(state, vocab);
    ASSERT_EQ(fast, slow) << "step " << step;
    std::vector<int32_t> allowed;
    for (size_t id = 0; id < vocab.size(); ++id) {
      if (TestToken(fast, static_cast<int32_t>(id))) allowed.push_back(static_cast<int32_t>(id));
    }
    if (allowed.empty()) break;
    const int32_t pick = allowed[rng() % allowed.size()];
    ASSERT_TRUE(state.FeedBytes(vocab.bytes(pick)));
  }
}

TEST(TokenMaskTest, QwenVocabularyMatchesBruteForceAtSeveralStates) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  const Grammar g = JsonObjectGrammar();
  for (const std::string prefix :
       {"", "{", "{\"ke", "{\"key\": ", "{\"key\": \"va", "{\"key\": 12", "{\"key\": [tr",
        "{\"key\": \"\xe4\xb8", "{\"k\": {\"a\": null}, \"b\": -0.5e"}) {
    GrammarMatcher state(g);
    ASSERT_TRUE(state.FeedBytes(prefix)) << prefix;
    TokenBitmask fast;
    vocab->ComputeMask(state, fast);
    const TokenBitmask slow = BruteForceMask(state, *vocab);
    EXPECT_EQ(fast, slow) << prefix;
    size_t allowed = 0;
    for (uint64_t w : fast) allowed += static_cast<size_t>(__builtin_popcountll(w));
    EXPECT_GT(allowed, 0u) << prefix;
  }
}

// Strings under length limits, far from them (the plain-content shortcut) and near them (the
// walk alone), and after escapes and partial characters.
TEST(TokenMaskTest, QwenVocabularyInsideLimitedStrings) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  absl::StatusOr<Grammar> g = CompileJsonSchemaText(
      R"({"type": "object", "properties": {"s": {"type": "string", "minLength": 3,
        "maxLength": 400}, "t": {"type": "string", "maxLength": 6}}, "required": ["s", "t"]})");
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectMasksMatchBruteForce(
      *g, *vocab,
      {"{\"s\": \"", "{\"s\": \"ab", "{\"s\": \"a\\", "{\"s\": \"a\\u00", "{\"s\": \"\xe4",
       "{\"s\": \"" + std::string(390, 'x'), "{\"s\": \"abc\", \"t\": \"12"});
}

// An object switch: the shared key, the tag's values, and each object after its tag.
TEST(TokenMaskTest, QwenVocabularyAcrossAnObjectSwitch) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  absl::StatusOr<Grammar> g = CompileJsonSchemaText(R"({"anyOf": [
      {"properties": {"name": {"const": "get_weather"}, "arguments": {"properties":
        {"city": {"type": "string"}}, "required": ["city"]}}, "required": ["name", "arguments"]},
      {"properties": {"name": {"const": "get_time"}, "arguments": {"properties":
        {"zone": {"type": "integer"}}, "required": ["zone"]}}, "required": ["name", "arguments"]}
    ]})");
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectMasksMatchBruteForce(
      *g, *vocab,
      {"{", "{\"na", "{\"name\": \"get_", "{\"name\": \"get_weather\"", "{\"name\": \"get_time\", ",
       "{\"name\": \"get_time\", \"arguments\": {"});
}

// Bounded numbers: the value so far decides which digits (and multi-digit tokens) may follow.
TEST(TokenMaskTest, QwenVocabularyInsideBoundedNumbers) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  absl::StatusOr<Grammar> g = CompileJsonSchemaText(
      R"({"type": "object", "properties": {"n": {"type": "integer", "minimum": -40,
        "maximum": 250}, "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5}},
        "required": ["n", "x"]})");
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectMasksMatchBruteForce(
      *g, *vocab,
      {"{\"n\": ", "{\"n\": 2", "{\"n\": 25", "{\"n\": -", "{\"n\": -4",
       "{\"n\": 7, \"x\": ", "{\"n\": 7, \"x\": 1.", "{\"n\": 7, \"x\": 0.00000"});
}

// Strings under a pattern: the walk alone (no plain-content shortcut), inside escapes and UTF-8.
TEST(TokenMaskTest, QwenVocabularyInsidePatternStrings) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  absl::StatusOr<Grammar> g = CompileJsonSchemaText(
      R"({"type": "object", "properties": {"id": {"type": "string",
        "pattern": "^[A-Z]{2}-\\d{2,4}$"}, "word": {"type": "string", "pattern": "\u00e9t\u00e9",
        "maxLength": 8}}, "required": ["id", "word"]})");
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectMasksMatchBruteForce(
      *g, *vocab,
      {"{\"id\": \"", "{\"id\": \"AB", "{\"id\": \"AB-12", "{\"id\": \"\\u00",
       "{\"id\": \"AB-1234\", \"word\": \"x", "{\"id\": \"AB-1234\", \"word\": \"\xc3",
       "{\"id\": \"AB-1234\", \"word\": \"xx\xc3\xa9t"});
}

// guided_regex's raw text, across characters of one to four bytes.
TEST(TokenMaskTest, QwenVocabularyUnderARegex) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  absl::StatusOr<Grammar> g = RegexGrammar("[a-z ]{1,12}(\u00e9|\u4e2d|\\uD83D\\uDE00)?\\.");
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectMasksMatchBruteForce(
      *g, *vocab, {"", "hello", "hello wor", "hello \xe4", "hello \xe4\xb8", "ab \xf0\x9f\x98"});
}

// A reasoning block before the form: free text (every token), the marker's partial matches, the
// whitespace after it.
TEST(TokenMaskTest, QwenVocabularyAroundAReasoningBlock) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  Grammar g = JsonObjectGrammar();
  ASSERT_TRUE(AddReasoningBlock(g, "</think>").ok());
  ExpectMasksMatchBruteForce(
      g, *vocab, {"", "<think>\nhm", "<think>\nhm </th", "<think>\nhm </think>", "x</think>\n\n"});
}

// Draws random allowed tokens until the grammar of `schema` is finished, `samples` times;
// returns the outputs that finished within the step budget. Every step's bitmask (NextMask)
// must name the same set as AllowedTokens.
std::vector<std::string> RandomConstrainedOutputs(const std::string& schema, int samples,
                                                  uint32_t seed) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  std::vector<std::string> outputs;
  if (vocab == nullptr) {
    ADD_FAILURE() << "no Qwen3 vocabulary";
    return outputs;
  }
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kJsonSchema;
  spec.json_schema = schema;
  GrammarCache cache;
  absl::StatusOr<std::shared_ptr<CompiledGrammar>> compiled = cache.Get(spec);
  if (!compiled.ok()) {
    ADD_FAILURE() << compiled.status();
    return outputs;
  }
  int32_t eos = static_cast<int32_t>(vocab->size()) - 1;  // a special token: no bytes
  while (eos > 0 && !vocab->bytes(eos).empty()) --eos;
  EXPECT_TRUE(vocab->bytes(eos).empty());
  std::mt19937 rng(seed);
  std::vector<uint64_t> mask;
  for (int sample = 0; sample < samples; ++sample) {
    TokenConstraint constraint(*compiled, vocab, {eos});
    std::string text;
    std::vector<int32_t> allowed;
    bool ended = false;
    for (int step = 0; step < 400 && !ended; ++step) {
      if (constraint.Finished()) break;
      constraint.AllowedTokens(allowed);
      if (allowed.empty()) {
        ADD_FAILURE() << "no token allowed after " << text;
        return outputs;
      }
      // The bitmask the draw applies names the same set, and nothing past the vocabulary.
      constraint.NextMask(mask);
      std::vector<int32_t> in_mask;
      for (size_t w = 0; w < mask.size(); ++w) {
        for (uint64_t word = mask[w]; word != 0; word &= word - 1) {
          in_mask.push_back(static_cast<int32_t>(w * 64 + std::countr_zero(word)));
        }
      }
      EXPECT_EQ(in_mask, allowed) << text;
      EXPECT_EQ(mask.size(), (vocab->size() + 63) / 64);
      // Favour short tokens and the end, so outputs stay small.
      int32_t pick = allowed[rng() % allowed.size()];
      if (rng() % 4 == 0) {
        for (int32_t t : allowed) {
          if (t == eos || vocab->bytes(t).size() == 1) {
            pick = t;
            if (rng() % 2) break;
          }
        }
      }
      if (pick == eos) {
        EXPECT_TRUE(constraint.Accepting()) << text;
        ended = true;
        break;
      }
      if (!constraint.Accept(pick)) {
        ADD_FAILURE() << "token " << pick << " allowed but refused after " << text;
        return outputs;
      }
      text += vocab->bytes(pick);
    }
    if (!ended && !constraint.Finished()) continue;  // ran out of steps mid-value
    outputs.push_back(text);
  }
  EXPECT_GT((*compiled)->masks_computed(), 0);
  return outputs;
}

// Every random constrained output must parse as JSON and hold the schema's shape.
TEST(TokenMaskTest, RandomConstrainedOutputsFollowTheSchema) {
  const std::vector<std::string> outputs = RandomConstrainedOutputs(
      R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 8},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
      "required": ["name", "tags"]})",
      20, 11);
  for (const std::string& text : outputs) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << text;
    ASSERT_TRUE(j.is_object()) << text;
    ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
    EXPECT_LE(j["name"].get<std::string>().size(), 8u * 4) << text;
    ASSERT_TRUE(j.contains("tags") && j["tags"].is_array()) << text;
    EXPECT_LE(j["tags"].size(), 3u) << text;
    for (const auto& t : j["tags"]) EXPECT_TRUE(t == "a" || t == "b") << text;
    if (j.contains("age")) {
      EXPECT_TRUE(j["age"].is_number_integer()) << text;
    }
    for (const auto& [k, v] : j.items()) {
      EXPECT_TRUE(k == "name" || k == "age" || k == "tags") << text;
    }
  }
  EXPECT_GE(outputs.size(), 10u);
}

// Under an object switch each output's arguments follow the function its name selects.
TEST(TokenMaskTest, RandomOutputsOfAnObjectSwitchFollowTheSelectedObject) {
  const std::vector<std::string> outputs = RandomConstrainedOutputs(
      R"({"anyOf": [
      {"properties": {"name": {"const": "weather"}, "arguments": {"properties":
        {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}},
        "required": ["name", "arguments"]},
      {"properties": {"name": {"const": "time"}, "arguments": {"properties":
        {"zone": {"type": "integer"}}, "required": ["zone"]}}, "required": ["name", "arguments"]}
      ]})",
      30, 5);
  int weather = 0, time = 0;
  for (const std::string& text : outputs) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << text;
    ASSERT_TRUE(j.is_object() && j.size() == 2 && j.contains("arguments")) << text;
    const nlohmann::json& args = j["arguments"];
    ASSERT_EQ(args.size(), 1u) << text;
    if (j["name"] == "weather") {
      ++weather;
      EXPECT_TRUE(args.contains("city") && args["city"].is_string()) << text;
    } else {
      ++time;
      EXPECT_EQ(j["name"], "time") << text;
      EXPECT_TRUE(args.contains("zone") && args["zone"].is_number_integer()) << text;
    }
  }
  EXPECT_GE(outputs.size(), 15u);
  EXPECT_GT(weather, 0);
  EXPECT_GT(time, 0);
}

// Random outputs under bounds stay within them, and never reach a dead end.
TEST(TokenMaskTest, RandomBoundedNumbersStayWithinTheirBounds) {
  const std::vector<std::string> outputs = RandomConstrainedOutputs(
      R"({"type": "object", "properties": {
      "n": {"type": "integer", "minimum": -40, "maximum": 250},
      "big": {"type": "integer", "minimum": 1000},
      "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5}},
      "required": ["n", "big", "x"]})",
      30, 3);
  for (const std::string& text : outputs) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << text;
    ASSERT_TRUE(j["n"].is_number_integer()) << text;
    EXPECT_GE(j["n"].get<int64_t>(), -40) << text;
    EXPECT_LE(j["n"].get<int64_t>(), 250) << text;
    // (A long one may exceed int64: then it parses as a float, still >= 1000.)
    EXPECT_GE(j["big"].get<double>(), 1000) << text;
    EXPECT_GT(j["x"].get<double>(), 0) << text;
    EXPECT_LE(j["x"].get<double>(), 1.5) << text;
  }
  EXPECT_GE(outputs.size(), 15u);
}

// Random outputs under patterns: each string value matches its pattern (std::regex, ECMAScript,
// as JSON Schema specifies), the lengths hold.
TEST(TokenMaskTest, RandomPatternStringsMatchTheirPattern) {
  const std::vector<std::string> outputs = RandomConstrainedOutputs(
      R"({"type": "object", "properties": {
      "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2,4}$"},
      "mail": {"type": "string", "pattern": "^\\w+@\\w+\\.(com|org)$", "maxLength": 12},
      "free": {"type": "string", "pattern": "ok", "maxLength": 5}},
      "required": ["code", "mail", "free"]})",
      30, 9);
  const std::regex code("^[A-Z]{2}-\\d{2,4}$"), mail("^\\w+@\\w+\\.(com|org)$"), free("ok");
  for (const std::string& text : outputs) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << text;
    const std::string c = j["code"], m = j["mail"], f = j["free"];
    EXPECT_TRUE(std::regex_match(c, code)) << text;
    EXPECT_TRUE(std::regex_match(m, mail)) << text;
    EXPECT_LE(m.size(), 12u) << text;
    EXPECT_TRUE(std::regex_search(f, free)) << text;
  }
  EXPECT_GE(outputs.size(), 15u);
}

// Random walks under guided_regex: every finished text is a whole match.
TEST(TokenMaskTest, RandomRegexOutputsMatch) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  const std::string pattern = "(\\d{3}-\\d{2}|[A-Z][a-z]{2,6} [A-Z][a-z]{1,8})";
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kRegex;
  spec.regex = pattern;
  GrammarCache cache;
  absl::StatusOr<std::shared_ptr<CompiledGrammar>> compiled = cache.Get(spec);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  int32_t eos = static_cast<int32_t>(vocab->size()) - 1;
  while (eos > 0 && !vocab->bytes(eos).empty()) --eos;
  const std::regex reference(pattern);
  std::mt19937 rng(21);
  int matched = 0;
  for (int sample = 0; sample < 30; ++sample) {
    TokenConstraint constraint(*compiled, vocab, {eos});
    std::string text;
    std::vector<int32_t> allowed;
    for (int step = 0; step < 64 && !constraint.Finished(); ++step) {
      constraint.AllowedTokens(allowed);
      ASSERT_FALSE(allowed.empty()) << text;
      const int32_t pick = allowed[rng() % allowed.size()];
      if (pick == eos) break;
      ASSERT_TRUE(constraint.Accept(pick));
      text += vocab->bytes(pick);
    }
    ASSERT_TRUE(constraint.Accepting()) << text;
    EXPECT_TRUE(std::regex_match(text, reference)) << text;
    ++matched;
  }
  EXPECT_EQ(matched, 30);
}

// A tokenizer whose added tokens sit past its vocabulary: the vocabulary a grammar masks covers
// every id up to the last (the loop once stopped at the count of ids, leaving such tokens out of
// every mask).
TEST(TokenVocabularyTest, CoversAddedTokensPastAGap) {
  const nlohmann::json json = tokenizer::testing::TinyTokenizerJson(
      {}, {{{"id", 300}, {"content", "<think>"}, {"special", false}, {"normalized", false}},
           {{"id", 301}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}}});
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok =
      tokenizer::Tokenizer::FromJsonString(json.dump());
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::shared_ptr<const TokenVocabulary> vocab =
      VocabularyFromTokenizer(**tok, (*tok)->id_limit());
  ASSERT_EQ(vocab->size(), 302u);
  EXPECT_EQ(vocab->bytes(300), "<think>");
  EXPECT_EQ(vocab->bytes(301), "");  // special: never allowed by a grammar
  EXPECT_EQ(vocab->bytes(280), "");  // unknown id
  EXPECT_EQ(vocab->bytes('a'), "a");
}

}  // namespace
}  // namespace mobius::grammar
