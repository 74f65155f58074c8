#include "tokenizer/chat_template.h"

#include <vector>

#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"

namespace mobius::tokenizer {
namespace {

TEST(ChatTemplateTest, RendersChatMl) {
  const std::vector<ChatMessage> messages = {{"system", "You are helpful."},
                                             {"user", "What is 2+2?"},
                                             {"assistant", "4"},
                                             {"user", "And 3+3?"}};
  absl::StatusOr<std::string> prompt = RenderChatMessages(messages, {});
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(*prompt,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n"
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n4<|im_end|>\n"
            "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
            "<|im_start|>assistant\n");
  absl::StatusOr<std::string> no_prompt =
      RenderChatMessages(messages, {.add_generation_prompt = false});
  ASSERT_TRUE(no_prompt.ok());
  EXPECT_EQ(*no_prompt + "<|im_start|>assistant\n", *prompt);
}

// OpenAI's "developer" role is the system turn it replaced.
TEST(ChatTemplateTest, DeveloperRoleIsASystemTurn) {
  const std::vector<ChatMessage> messages = {{"developer", "Be brief."}, {"user", "hi"}};
  absl::StatusOr<std::string> prompt =
      RenderChatMessages(messages, {.add_generation_prompt = false});
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(*prompt, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
}

TEST(ChatTemplateTest, RejectsUnknownRoles) {
  const std::vector<ChatMessage> messages = {{"user", "hi"}, {"wizard", "boo"}};  // not dropped
  absl::StatusOr<std::string> prompt = RenderChatMessages(messages, {});
  ASSERT_FALSE(prompt.ok());
  EXPECT_EQ(prompt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(prompt.status().message().find("wizard"), std::string::npos);
}

TEST(ChatTemplateTest, RenderedPromptEncodesToTheFixtureIds) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<ChatMessage> messages = {{"user", "What is 2+2?"}};
  absl::StatusOr<std::string> prompt = RenderChatMessages(messages, {});
  ASSERT_TRUE(prompt.ok());
  // Same ids as the ChatML case of encode_cases.json.
  EXPECT_EQ(testing::EncodeOrFail(*tokenizer, *prompt),
            (std::vector<int32_t>{151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198,
                                  151644, 77091, 198}));
}

}  // namespace
}  // namespace mobius::tokenizer
