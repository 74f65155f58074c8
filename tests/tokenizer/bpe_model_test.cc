#include "tokenizer/bpe_model.h"

#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"
#include "tokenizer/byte_level.h"

namespace mobius::tokenizer {
namespace {

using Merges = std::vector<std::pair<std::string, std::string>>;

std::unique_ptr<BpeModel> ModelOrFail(const Merges& merges) {
  absl::StatusOr<std::unique_ptr<BpeModel>> model =
      BpeModel::FromJson(testing::TinyTokenizerJson(merges)["model"]);
  if (!model.ok()) {
    ADD_FAILURE() << model.status();
    return nullptr;
  }
  return *std::move(model);
}

std::vector<std::string> Tokens(const BpeModel& model, std::string_view word) {
  std::vector<int32_t> ids;
  model.EncodeWord(word, ids);
  std::vector<std::string> tokens;
  for (int32_t id : ids) tokens.push_back(*model.IdToToken(id));
  return tokens;
}

// Straightforward reference: repeatedly apply the lowest-ranked merge at its leftmost place.
std::vector<std::string> NaiveBpe(const Merges& merges, std::string_view word) {
  std::map<std::pair<std::string, std::string>, size_t> ranks;
  for (size_t r = 0; r < merges.size(); ++r) ranks[merges[r]] = r;
  std::vector<std::string> symbols;
  for (char c : word) symbols.push_back(BytesToAlphabet(std::string(1, c)));
  while (true) {
    size_t best_rank = merges.size();
    size_t best_pos = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto it = ranks.find({symbols[i], symbols[i + 1]});
      if (it != ranks.end() && it->second < best_rank) {
        best_rank = it->second;
        best_pos = i;
      }
    }
    if (best_rank == merges.size()) break;
    symbols[best_pos] += symbols[best_pos + 1];
    symbols.erase(symbols.begin() + best_pos + 1);
  }
  return symbols;
}

std::string RandomWord(std::mt19937& rng, size_t length) {
  std::string word;
  for (size_t i = 0; i < length; ++i) word.push_back("aabc "[rng() % 5]);
  return word;
}

const Merges kMerges = {{"a", "a"}, {"b", "c"},    {"aa", "aa"}, {"a", "b"}, {"ab", "c"},
                        {"c", "a"}, {"aaaa", "a"}, {"bc", "a"},  {"Ġ", "a"}, {"aa", "b"}};

TEST(BpeModelTest, LowestRankFirstThenLeftmost) {
  std::unique_ptr<BpeModel> model = ModelOrFail(kMerges);
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(Tokens(*model, "aaa"), (std::vector<std::string>{"aa", "a"}));
  EXPECT_EQ(Tokens(*model, "aaaaa"), (std::vector<std::string>{"aaaaa"}));
  EXPECT_EQ(Tokens(*model, "abc"), (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(Tokens(*model, " a"), (std::vector<std::string>{"Ġa"}));
  EXPECT_EQ(Tokens(*model, "xyz"), (std::vector<std::string>{"x", "y", "z"}));
}

TEST(BpeModelTest, ShortAndLongWordPathsAgreeWithNaiveReference) {
  std::unique_ptr<BpeModel> model = ModelOrFail(kMerges);
  ASSERT_NE(model, nullptr);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const std::string word = RandomWord(rng, 1 + rng() % 200);  // Crosses the short-word limit.
    EXPECT_EQ(Tokens(*model, word), NaiveBpe(kMerges, word)) << word;
    EXPECT_EQ(Tokens(*model, word), NaiveBpe(kMerges, word)) << "cached: " << word;
  }
}

TEST(BpeModelTest, VeryLongWordsAgreeWithNaiveReference) {
  // kMerges only create pairs of higher rank (rank-by-rank path); the reordered list does not
  // (heap path). Both must give the reference result on words beyond the very-long threshold.
  Merges unordered = kMerges;
  std::swap(unordered[0], unordered[2]);
  for (const Merges& merges : {kMerges, unordered}) {
    std::unique_ptr<BpeModel> model = ModelOrFail(merges);
    ASSERT_NE(model, nullptr);
    std::mt19937 rng(11);
    for (int trial = 0; trial < 2; ++trial) {
      const std::string word = RandomWord(rng, 4200);
      EXPECT_EQ(Tokens(*model, word), NaiveBpe(merges, word));
    }
    EXPECT_EQ(Tokens(*model, std::string(5000, 'a')), NaiveBpe(merges, std::string(5000, 'a')));
  }
}

TEST(BpeModelTest, RejectsSettingsThatChangeIds) {
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, nlohmann::json>>{{"dropout", 0.1},
                                                           {"byte_fallback", true},
                                                           {"continuing_subword_prefix", "##"},
                                                           {"end_of_word_suffix", "</w>"},
                                                           {"type", "WordPiece"}}) {
    nlohmann::json model = testing::TinyTokenizerJson(kMerges)["model"];
    model[key] = value;
    absl::StatusOr<std::unique_ptr<BpeModel>> result = BpeModel::FromJson(model);
    ASSERT_FALSE(result.ok()) << key;
    EXPECT_NE(result.status().message().find(key == "type" ? "WordPiece" : key), std::string::npos)
        << result.status();
  }
}

TEST(BpeModelTest, MergeWithUnknownTokenIsALoadError) {
  nlohmann::json model = testing::TinyTokenizerJson(kMerges)["model"];
  model["merges"].push_back({"zz", "q"});
  EXPECT_FALSE(BpeModel::FromJson(model).ok());
}

TEST(BpeModelTest, AcceptsLegacyStringMerges) {
  nlohmann::json model = testing::TinyTokenizerJson(kMerges)["model"];
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& [left, right] : kMerges) merges.push_back(left + " " + right);
  model["merges"] = merges;
  absl::StatusOr<std::unique_ptr<BpeModel>> result = BpeModel::FromJson(model);
  ASSERT_TRUE(result.ok()) << result.status();
  std::vector<int32_t> ids;
  (*result)->EncodeWord("aaaaa", ids);
  EXPECT_EQ(ids.size(), 1u);
}

TEST(BpeModelTest, IgnoreMergesUsesWholeWordTokens) {
  // "ca" is in the vocabulary (from a merge) but "cab" would not be reached by merges.
  nlohmann::json model = testing::TinyTokenizerJson(kMerges)["model"];
  model["vocab"]["cab"] = 9999;
  model["ignore_merges"] = true;
  absl::StatusOr<std::unique_ptr<BpeModel>> result = BpeModel::FromJson(model);
  ASSERT_TRUE(result.ok()) << result.status();
  std::vector<int32_t> ids;
  (*result)->EncodeWord("cab", ids);
  EXPECT_EQ(ids, std::vector<int32_t>{9999});
}

}  // namespace
}  // namespace mobius::tokenizer
