#include "grammar/token_mask.h"

#include <algorithm>
#include <filesystem>
#include <iterator>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "grammar/json_schema_compiler.h"
#include "grammar/structured_output.h"
#include "grammar/tokenizer_vocabulary.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
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
    return VocabularyFromTokenizer(**tok, (*tok)->vocab_size());
  }();
  return vocab;
}

// The mask by brute force: each token's bytes fed to a copy of the state.
TokenBitmask BruteForceMask(const GrammarMatcher& state, const TokenVocabulary& vocab) {
  TokenBitmask mask((vocab.size() + 63) / 64, 0);
  GrammarMatcher probe = state;
  for (size_t id = 0; id < vocab.size(); ++id) {
    const std::string_view b = vocab.bytes(static_cast<int32_t>(id));
    if (b.empty()) continue;
    probe.CopyFrom(state);
    if (probe.FeedBytes(b)) mask[id / 64] |= uint64_t{1} << (id % 64);
  }
  return mask;
}

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

// Draws random allowed tokens until the grammar is finished: every such output must parse as
// JSON and hold the schema's shape.
TEST(TokenMaskTest, RandomConstrainedOutputsFollowTheSchema) {
  std::shared_ptr<const TokenVocabulary> vocab = QwenVocabulary();
  ASSERT_NE(vocab, nullptr);
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kJsonSchema;
  spec.json_schema = R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 8},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
      "required": ["name", "tags"]})";
  GrammarCache cache;
  absl::StatusOr<std::shared_ptr<CompiledGrammar>> compiled = cache.Get(spec);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  int32_t eos = static_cast<int32_t>(vocab->size()) - 1;  // a special token: no bytes
  while (eos > 0 && !vocab->bytes(eos).empty()) --eos;
  ASSERT_TRUE(vocab->bytes(eos).empty());
  std::vector<int32_t> all_ids(vocab->size());
  std::iota(all_ids.begin(), all_ids.end(), 0);
  std::mt19937 rng(11);
  int completed = 0;
  for (int sample = 0; sample < 20; ++sample) {
    TokenConstraint constraint(*compiled, vocab, {eos});
    std::string text;
    std::vector<int32_t> allowed;
    bool ended = false;
    for (int step = 0; step < 400 && !ended; ++step) {
      if (constraint.Finished()) break;
      constraint.AllowedTokens(allowed);
      ASSERT_FALSE(allowed.empty()) << text;
      // The shorter form names the same set.
      TokenConstraint::TokenSet next;
      constraint.NextTokens(next);
      if (next.banned) {
        std::vector<int32_t> complement;
        std::set_difference(all_ids.begin(), all_ids.end(), next.ids.begin(), next.ids.end(),
                            std::back_inserter(complement));
        ASSERT_EQ(complement, allowed) << text;
      } else {
        ASSERT_EQ(next.ids, allowed) << text;
      }
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
        ASSERT_TRUE(constraint.Accepting());
        ended = true;
        break;
      }
      ASSERT_TRUE(constraint.Accept(pick));
      text += vocab->bytes(pick);
    }
    if (!ended && !constraint.Finished()) continue;  // ran out of steps mid-value
    ++completed;
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
  EXPECT_GE(completed, 10);
  EXPECT_GT((*compiled)->masks_computed(), 0);
}

}  // namespace
}  // namespace mobius::grammar
