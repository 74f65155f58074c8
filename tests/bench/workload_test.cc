// Random workloads (lengths, id range, seeds, text) and JSONL datasets (both prompt forms,
// output lengths, cycling, errors naming file and line).
#include "bench/serve/workload.h"

#include <fstream>
#include <set>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mobius::bench {
namespace {

using ::testing::HasSubstr;

TEST(RandomWorkloadTest, ExactLengthsAndIdsInTheVocabulary) {
  RandomWorkloadOptions options;
  options.num_prompts = 50;
  options.input_len = 32;
  options.output_len = 8;
  options.vocab_size = 100;
  auto w = MakeRandomWorkload(options);
  ASSERT_TRUE(w.ok());
  ASSERT_EQ(w->size(), 50u);
  std::set<int32_t> seen;
  for (const BenchRequest& r : *w) {
    EXPECT_FALSE(r.is_text);
    EXPECT_EQ(r.prompt_len, 32);
    EXPECT_EQ(r.prompt_ids.size(), 32u);
    EXPECT_EQ(r.output_len, 8);
    for (int32_t id : r.prompt_ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, 100);
      seen.insert(id);
    }
  }
  EXPECT_GT(seen.size(), 90u);  // 1600 draws cover nearly all of 100 ids
}

TEST(RandomWorkloadTest, RangeRatioBoundsTheLengths) {
  RandomWorkloadOptions options;
  options.num_prompts = 400;
  options.input_len = 100;
  options.output_len = 10;
  options.range_ratio = 0.5;
  auto w = MakeRandomWorkload(options);
  ASSERT_TRUE(w.ok());
  std::set<int> inputs;
  for (const BenchRequest& r : *w) {
    EXPECT_GE(r.prompt_len, 50);
    EXPECT_LE(r.prompt_len, 150);
    EXPECT_GE(r.output_len, 5);
    EXPECT_LE(r.output_len, 15);
    inputs.insert(r.prompt_len);
  }
  EXPECT_GT(inputs.size(), 50u);
}

TEST(RandomWorkloadTest, SeedDecidesThePrompts) {
  RandomWorkloadOptions options;
  options.num_prompts = 3;
  options.input_len = 5;
  options.output_len = 2;
  auto a = MakeRandomWorkload(options);
  auto b = MakeRandomWorkload(options);
  options.seed = 1;
  auto c = MakeRandomWorkload(options);
  EXPECT_EQ((*a)[2].prompt_ids, (*b)[2].prompt_ids);
  EXPECT_NE((*a)[2].prompt_ids, (*c)[2].prompt_ids);
}

TEST(RandomWorkloadTest, TextPromptsHaveOneWordPerToken) {
  RandomWorkloadOptions options;
  options.num_prompts = 2;
  options.input_len = 12;
  options.output_len = 2;
  options.text = true;
  auto w = MakeRandomWorkload(options);
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE((*w)[0].is_text);
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit((*w)[0].prompt_text, ' ')).size(), 12u);
}

TEST(RandomWorkloadTest, BadOptionsNameTheFlag) {
  RandomWorkloadOptions options;
  options.num_prompts = 1;
  options.input_len = 0;
  options.output_len = 1;
  EXPECT_THAT(std::string(MakeRandomWorkload(options).status().message()),
              HasSubstr("--random-input-len"));
  options.input_len = 1;
  options.output_len = -2;
  EXPECT_THAT(std::string(MakeRandomWorkload(options).status().message()),
              HasSubstr("--random-output-len"));
  options.output_len = 1;
  options.range_ratio = 1;
  EXPECT_THAT(std::string(MakeRandomWorkload(options).status().message()),
              HasSubstr("--random-range-ratio"));
  options.range_ratio = 0;
  options.vocab_size = 0;
  EXPECT_THAT(std::string(MakeRandomWorkload(options).status().message()),
              HasSubstr("--vocab-size"));
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(JsonlWorkloadTest, BothPromptFormsOutputLengthsAndCycling) {
  const std::string path = WriteFile("bench_ok.jsonl",
                                     "{\"prompt\": [1, 2, 3], \"max_tokens\": 4}\n"
                                     "\n"
                                     "{\"prompt\": \"hello big world\", \"output_len\": 6}\n"
                                     "{\"prompt\": [9]}\n");
  auto w = LoadJsonlWorkload(path, 5, 11);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(w->size(), 5u);
  EXPECT_EQ((*w)[0].prompt_ids, std::vector<int32_t>({1, 2, 3}));
  EXPECT_EQ((*w)[0].prompt_len, 3);
  EXPECT_EQ((*w)[0].output_len, 4);
  EXPECT_TRUE((*w)[1].is_text);
  EXPECT_EQ((*w)[1].prompt_text, "hello big world");
  EXPECT_EQ((*w)[1].output_len, 6);
  EXPECT_EQ((*w)[2].output_len, 11);                  // the default
  EXPECT_EQ((*w)[3].prompt_ids, (*w)[0].prompt_ids);  // cycled
}

TEST(JsonlWorkloadTest, ErrorsNameTheFileAndLine) {
  struct Case {
    const char* text;
    const char* message;
  };
  for (const Case& c : {Case{"{\"prompt\": [1]}\n{oops\n", ":2: invalid JSON"},
                        Case{"[1]\n", ":1: expected a JSON object"},
                        Case{"{\"max_tokens\": 3}\n", ":1: no \"prompt\""},
                        Case{"{\"prompt\": [1, -4]}\n", ":1: \"prompt\" must hold"},
                        Case{"{\"prompt\": []}\n", ":1: \"prompt\" must be a string or"},
                        Case{"{\"prompt\": \"x\", \"max_tokens\": 0}\n", ":1: \"max_tokens\""},
                        Case{"\n\n", "no prompts"}}) {
    const std::string path = WriteFile("bench_bad.jsonl", c.text);
    auto w = LoadJsonlWorkload(path, 2, 4);
    ASSERT_FALSE(w.ok()) << c.text;
    EXPECT_THAT(std::string(w.status().message()), HasSubstr(c.message)) << c.text;
  }
  EXPECT_EQ(LoadJsonlWorkload("/nonexistent/x.jsonl", 1, 1).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace mobius::bench
