#include "worker/runtime/draft_vocabulary.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mobius::worker {
namespace {

std::vector<int32_t> Ids(const DraftVocabulary& v) { return {v.ids().begin(), v.ids().end()}; }

TEST(DraftVocabularyTest, WholeVocabularyMapsRowsToThemselves) {
  const DraftVocabulary whole;
  EXPECT_TRUE(whole.whole());
  EXPECT_EQ(whole.TokenOfRow(0), 0);
  EXPECT_EQ(whole.TokenOfRow(12345), 12345);
  EXPECT_EQ(whole.TokenOfRow(-1), -1);
}

TEST(DraftVocabularyTest, ParsesWhitespaceCommasCommentsAndSortsIds) {
  const auto v = DraftVocabulary::Parse("# hot tokens\n 9 3,\t7\r\n0 # zero\n42", 100, "map");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->whole());
  EXPECT_EQ(Ids(*v), (std::vector<int32_t>{0, 3, 7, 9, 42}));
  EXPECT_EQ(v->TokenOfRow(0), 0);
  EXPECT_EQ(v->TokenOfRow(2), 7);
  EXPECT_EQ(v->TokenOfRow(4), 42);
  EXPECT_EQ(v->TokenOfRow(5), -1) << "row past the map";
}

TEST(DraftVocabularyTest, ParsesAJsonArray) {
  const auto v = DraftVocabulary::Parse("[5, 1, 99]\n", 100, "map.json");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(Ids(*v), (std::vector<int32_t>{1, 5, 99}));
}

TEST(DraftVocabularyTest, RejectsBadEntriesNamingSourceEntryAndLine) {
  auto v = DraftVocabulary::Parse("1 2\n3 x4 5", 100, "hot.txt");
  ASSERT_FALSE(v.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(v.status()));
  EXPECT_NE(v.status().message().find("hot.txt: entry 4 (line 2) is \"x4\""), std::string::npos)
      << v.status();

  v = DraftVocabulary::Parse("1\n2\n100", 100, "hot.txt");
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("entry 3 (line 3) is token 100, outside the model's "
                                      "vocabulary [0, 100)"),
            std::string::npos)
      << v.status();

  v = DraftVocabulary::Parse("-1", 100, "hot.txt");
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("token -1"), std::string::npos) << v.status();

  v = DraftVocabulary::Parse("4 8\n15 16\n8", 100, "hot.txt");
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("token 8 appears twice (entries 2 and 5, lines 1 and 3)"),
            std::string::npos)
      << v.status();

  v = DraftVocabulary::Parse("1.5", 100, "hot.txt");
  EXPECT_FALSE(v.ok());
  v = DraftVocabulary::Parse("99999999999999999999", 100, "hot.txt");
  EXPECT_FALSE(v.ok());
}

TEST(DraftVocabularyTest, RejectsAnEmptyMap) {
  for (const char* text : {"", "  \n", "# only a comment\n", "[]"}) {
    const auto v = DraftVocabulary::Parse(text, 100, "empty.txt");
    ASSERT_FALSE(v.ok()) << "\"" << text << "\"";
    EXPECT_NE(v.status().message().find("empty.txt: no token ids"), std::string::npos)
        << v.status();
  }
}

TEST(DraftVocabularyTest, LoadsAFileAndReportsAMissingOne) {
  const std::string path = ::testing::TempDir() + "/draft_vocabulary_test.txt";
  {
    std::ofstream out(path);
    out << "2\n1\n";
  }
  const auto v = DraftVocabulary::Load(path, 10);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(Ids(*v), (std::vector<int32_t>{1, 2}));
  std::remove(path.c_str());
  const auto missing = DraftVocabulary::Load(path, 10);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
}

}  // namespace
}  // namespace mobius::worker
