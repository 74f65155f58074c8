// RenderChatMessages against the Qwen3 chat template itself: the fixture's tokenizer_config.json
// template rendered by Jinja the way transformers renders it (render_chat_template.py), over
// conversations that exercise every branch: system turns, tools, tool calls with and without
// content, consecutive tool results, reasoning given or embedded in the content, turns before and
// after the last user query, with and without the generation prompt, and enable_thinking.
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/tokenizer/test_util.h"
#include "tokenizer/chat_template.h"

namespace mobius::tokenizer {
namespace {

using Json = nlohmann::ordered_json;

struct Case {
  std::vector<ChatMessage> messages;
  Json tools;  // null: none
  bool add_generation_prompt = true;
  std::optional<bool> enable_thinking;  // unset: not passed to the template
};

Json MessageJson(const ChatMessage& m) {
  Json j{{"role", m.role}, {"content", m.content}};
  if (!m.tool_calls.empty()) {
    j["tool_calls"] = Json::array();
    for (const ToolCall& c : m.tool_calls) {
      j["tool_calls"].push_back(
          {{"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    }
  }
  if (m.reasoning_content.has_value()) j["reasoning_content"] = *m.reasoning_content;
  return j;
}

// Runs the reference renderer; its output, or null with a recorded failure.
Json RenderWithJinja(const std::vector<Case>& cases) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("mobius_chat_template_", ::getpid());
  std::filesystem::create_directories(dir);
  const std::filesystem::path input = dir / "cases.json";
  {
    Json all = Json::array();
    for (const Case& c : cases) {
      Json messages = Json::array();
      for (const ChatMessage& m : c.messages) messages.push_back(MessageJson(m));
      Json one = {{"messages", messages},
                  {"tools", c.tools},
                  {"add_generation_prompt", c.add_generation_prompt}};
      if (c.enable_thinking.has_value()) one["enable_thinking"] = *c.enable_thinking;
      all.push_back(std::move(one));
    }
    std::ofstream(input) << all.dump();
  }
  const std::string command = absl::StrCat(
      "python3 ", MOBIUS_CHAT_TEMPLATE_SCRIPT, " ",
      (testing::QwenTokenizerDir() / "tokenizer_config.json").string(), " ", input.string());
  std::string output;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "cannot run " << command;
    return nullptr;
  }
  std::array<char, 4096> buffer;
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe))
    output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  std::filesystem::remove_all(dir);
  // CI installs python3-jinja2 (.ci/run); without it this test fails rather than skips.
  if (status != 0) {
    ADD_FAILURE() << command << " exited with " << status
                  << " (python3 with jinja2 is needed: apt-get install python3-jinja2)";
    return nullptr;
  }
  return Json::parse(output, nullptr, /*allow_exceptions=*/false);
}

ChatMessage Assistant(std::string content, std::vector<ToolCall> calls = {},
                      std::optional<std::string> reasoning = std::nullopt) {
  return ChatMessage{"assistant", std::move(content), std::move(calls), std::move(reasoning)};
}

TEST(ChatTemplateReferenceTest, MatchesTheQwen3TemplateRenderedByJinja) {
  const Json weather = {
      {"type", "function"},
      {"function",
       {{"name", "get_weather"},
        {"description", "Current weather in a city, \"quoted\" and ünïcode"},
        {"parameters",
         {{"type", "object"},
          {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}},
          {"required", {"city"}}}}}}};
  const Json clock = {{"type", "function"},
                      {"function", {{"name", "now"}, {"parameters", Json::object()}}}};
  const ToolCall call_paris{"get_weather", R"({"city": "Paris"})"};
  const ToolCall call_rome{"get_weather", R"({"city": "Rome", "days": 2})"};

  std::vector<Case> cases = {
      // Plain conversations.
      {{{"user", "hi"}}},
      {{{"system", "Be brief."}, {"user", "What is 2+2?"}, Assistant("4"), {"user", "And 3+3?"}}},
      {{{"user", "a"}, {"system", "late system turn"}, {"user", "b"}}, nullptr, false},
      // A trailing assistant turn (continuing it) gets the empty reasoning block.
      {{{"user", "Write a haiku"}, Assistant("Autumn moon")}, nullptr, false},
      // Reasoning embedded in the content: dropped before the last query, kept after it.
      {{{"user", "q1"},
        Assistant("<think>\nfirst thoughts\n</think>\n\nanswer one"),
        {"user", "q2"},
        Assistant("<think>second</think>answer two")},
       nullptr,
       false},
      // Reasoning given as a field.
      {{{"user", "q"}, Assistant("\nthe answer", {}, "\nwhy\n")}, nullptr, false},
      // Tools, with and without a system turn.
      {{{"user", "Weather in Paris?"}}, Json::array({weather, clock})},
      {{{"system", "You are a weather bot."}, {"user", "Weather in Paris?"}},
       Json::array({weather})},
      // A tool-calling exchange: calls with no content, calls after content, two results in a
      // row, the final answer, and a follow-up query.
      {{{"system", "sys"},
        {"user", "Weather in Paris and Rome?"},
        Assistant("", {call_paris, call_rome}),
        {"tool", R"({"temp": 21})"},
        {"tool", R"({"temp": 25})"},
        Assistant("Paris 21, Rome 25."),
        {"user", "And tomorrow in Paris?"},
        Assistant("Let me check.", {call_paris}),
        {"tool", "sunny"}},
       Json::array({weather})},
      // The last user turn is itself a tool response: the query is the one before it.
      {{{"user", "Weather?"},
        Assistant("<think>need a tool</think>", {call_paris}),
        {"user", "<tool_response>\n18\n</tool_response>"},
        Assistant("<think>done</think>18 degrees")},
       Json::array({weather}),
       false},
      // enable_thinking: false opens the answer with an empty reasoning block; true changes
      // nothing.
      {{{"user", "hi"}}, nullptr, true, false},
      {{{"user", "hi"}}, Json::array({clock}), true, true},
  };
  const Json reference = RenderWithJinja(cases);
  ASSERT_TRUE(reference.is_array()) << reference.dump();
  ASSERT_EQ(reference.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<std::string> tools;
    for (const Json& t : reference[i]["tools"]) tools.push_back(t.get<std::string>());
    absl::StatusOr<std::string> ours = RenderChatMessages(
        cases[i].messages, {.tools = tools,
                            .add_generation_prompt = cases[i].add_generation_prompt,
                            .enable_thinking = cases[i].enable_thinking.value_or(true)});
    ASSERT_TRUE(ours.ok()) << ours.status();
    EXPECT_EQ(*ours, reference[i]["prompt"].get<std::string>()) << "case " << i;
  }
}

}  // namespace
}  // namespace mobius::tokenizer
