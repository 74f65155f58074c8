// Ids and decodes produced by the Hugging Face `tokenizers` library (make_golden_cases.py) for
// hundreds of hand-picked and random strings: whitespace runs, digits, contractions, scripts,
// emoji, combining marks, Unicode spaces, special tokens, invalid UTF-8 and random id sequences.
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"
#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/utf8.h"

namespace mobius::tokenizer {
namespace {

using testing::QwenTokenizerOrFail;

nlohmann::json LoadGolden() {
  return testing::ReadJsonFileOrFail(testing::TestDataDir() / "hf_golden_cases.json");
}

TEST(HfGoldenCasesTest, EncodeMatchesReference) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const nlohmann::json golden = LoadGolden();
  ASSERT_TRUE(golden.contains("encode"));
  int mismatches = 0;
  for (const nlohmann::json& c : golden["encode"]) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> expected = c["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> ids = testing::EncodeOrFail(*tokenizer, text);
    if (ids != expected) ++mismatches;
    EXPECT_EQ(ids, expected) << "text: " << nlohmann::json(text).dump();
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(HfGoldenCasesTest, DecodeAndStreamingMatchReference) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const nlohmann::json golden = LoadGolden();
  ASSERT_TRUE(golden.contains("encode") && golden.contains("decode"));
  std::vector<std::pair<std::vector<int32_t>, std::string>> cases;
  for (const nlohmann::json& c : golden["encode"]) {
    cases.emplace_back(c["ids"].get<std::vector<int32_t>>(), c["decoded"].get<std::string>());
  }
  // Random id sequences cut characters apart, which exercises the replacement policy.
  for (const nlohmann::json& c : golden["decode"]) {
    cases.emplace_back(c["ids"].get<std::vector<int32_t>>(), c["text"].get<std::string>());
  }
  for (const auto& [ids, expected] : cases) {
    absl::StatusOr<std::string> text = tokenizer->Decode(ids);
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, expected);
    IncrementalDetokenizer stream(*tokenizer);
    std::string streamed;
    for (int32_t id : ids) {
      absl::StatusOr<std::string> piece = stream.Push(id);
      ASSERT_TRUE(piece.ok()) << piece.status();
      EXPECT_TRUE(IsValidUtf8(*piece));
      streamed += *piece;
    }
    streamed += stream.Finish();
    EXPECT_EQ(streamed, expected);
  }
}

TEST(HfGoldenCasesTest, ConcurrentEncodesAgreeWithReference) {
  // The router shares one Tokenizer between threads; the shared word cache must not change ids.
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const nlohmann::json golden = LoadGolden();
  ASSERT_TRUE(golden.contains("encode"));
  std::vector<std::pair<std::string, std::vector<int32_t>>> cases;
  for (const nlohmann::json& c : golden["encode"]) {
    cases.emplace_back(c["text"].get<std::string>(), c["ids"].get<std::vector<int32_t>>());
  }
  constexpr int kThreads = 4;
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (size_t i = t; i < cases.size() * 2; i += kThreads) {
          const auto& [text, ids] = cases[i % cases.size()];
          absl::StatusOr<std::vector<int32_t>> encoded = tokenizer->Encode(text);
          if (!encoded.ok() || *encoded != ids) ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST(HfGoldenCasesTest, InvalidUtf8IsReplacedBeforeEncoding) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const nlohmann::json golden = LoadGolden();
  ASSERT_TRUE(golden.contains("invalid_utf8"));
  for (const nlohmann::json& c : golden["invalid_utf8"]) {
    const std::string bytes = absl::HexStringToBytes(c["bytes_hex"].get<std::string>());
    EXPECT_EQ(testing::EncodeOrFail(*tokenizer, bytes), c["ids"].get<std::vector<int32_t>>())
        << "bytes: " << c["bytes_hex"];
  }
}

}  // namespace
}  // namespace mobius::tokenizer
