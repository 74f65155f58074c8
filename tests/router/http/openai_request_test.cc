// Request translation, response formatting and error mapping of the OpenAI front end, without
// sockets.
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "router/http/openai_request.h"
#include "router/http/openai_response.h"
#include "router/http/structured_output_request.h"

namespace mobius::router::openai {
namespace {

using Json = nlohmann::json;

TEST(ParseCompletion, SamplingFields) {
  absl::StatusOr<CompletionParams> params =
      ParseCompletionRequest(Json{{"prompt", "p"},
                                  {"top_p", 0.9},
                                  {"top_k", 40.0},  // integral floats are integers
                                  {"min_p", 0.1},
                                  {"presence_penalty", 0.5},
                                  {"frequency_penalty", -0.5},
                                  {"repetition_penalty", 1.1},
                                  {"seed", -1},
                                  {"stop", {"a", "b"}},
                                  {"stop_token_ids", {2, 3}},
                                  {"ignore_eos", true},
                                  {"logprobs", 2},
                                  {"max_tokens", nullptr},  // null is unset
                                  {"n", 1},
                                  {"best_of", 1},
                                  {"suffix", ""}},
                             "m");
  ASSERT_TRUE(params.ok()) << params.status();
  ASSERT_EQ(params->prompts.size(), 1u);
  EXPECT_EQ(params->n, 1);
  const v1::SamplingParams& s = params->prompts[0].sampling_params();
  EXPECT_FLOAT_EQ(s.top_p(), 0.9f);
  EXPECT_EQ(s.top_k(), 40);
  EXPECT_FLOAT_EQ(s.min_p(), 0.1f);
  EXPECT_FLOAT_EQ(s.presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty(), -0.5f);
  EXPECT_FLOAT_EQ(s.repetition_penalty(), 1.1f);
  EXPECT_EQ(s.seed(), ~uint64_t{0});
  EXPECT_EQ(s.stop_size(), 2);
  EXPECT_EQ(s.stop_token_ids_size(), 2);
  EXPECT_TRUE(s.ignore_eos());
  EXPECT_EQ(s.logprobs(), 2);
  EXPECT_TRUE(params->logprobs);
  EXPECT_EQ(s.max_tokens(), 16);
  EXPECT_FALSE(s.has_temperature());
  EXPECT_FALSE(params->stream);
}

TEST(ParseCompletion, IncludeUsageOnlyWhenStreaming) {
  Json body{{"prompt", "p"}, {"stream_options", {{"include_usage", true}}}};
  EXPECT_FALSE(ParseCompletionRequest(body, "")->include_usage);
  body["stream"] = true;
  EXPECT_TRUE(ParseCompletionRequest(body, "")->include_usage);
}

TEST(ParseCompletion, ReturnTokensAsTokenIds) {
  Json body{{"prompt", "p"}};
  EXPECT_FALSE(ParseCompletionRequest(body, "")->tokens_as_ids);
  body["return_tokens_as_token_ids"] = true;
  EXPECT_TRUE(ParseCompletionRequest(body, "")->tokens_as_ids);
  Json chat{{"messages", {{{"role", "user"}, {"content", "x"}}}},
            {"return_tokens_as_token_ids", true}};
  EXPECT_TRUE(ParseChatRequest(chat, "")->tokens_as_ids);
  body["return_tokens_as_token_ids"] = "yes";
  EXPECT_FALSE(ParseCompletionRequest(body, "").ok());
}

TEST(ParseCompletion, EmptyServedNameAcceptsAnyModel) {
  EXPECT_TRUE(ParseCompletionRequest(Json{{"model", "x"}, {"prompt", "p"}}, "").ok());
  absl::Status wrong = ParseCompletionRequest(Json{{"model", "x"}, {"prompt", "p"}}, "y").status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrorParam(wrong), "model");
  EXPECT_EQ(ErrorCode(wrong), "model_not_found");
}

TEST(ParseCompletion, FieldErrors) {
  struct Case {
    Json body;
    std::string param;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"prompt", 5}},
       "prompt",
       "prompt must be a string, an array of token ids, or an array of those, got 5"},
      {{{"prompt", Json::array()}}, "prompt", "prompt must not be empty"},
      {{{"prompt", ""}}, "prompt", "prompt must not be empty"},
      {{{"prompt", {1, -2}}}, "prompt[1]", "prompt[1] must be an integer in [0, 2147483647]"},
      {{{"prompt", {1, "a"}}}, "prompt[1]", "prompt[1] must be an integer, got \"a\""},
      {{{"prompt", "p"}, {"top_k", "40"}}, "top_k", "top_k must be an integer, got \"40\""},
      {{{"prompt", "p"}, {"max_tokens", 1e12}}, "max_tokens", "max_tokens must be an integer in"},
      {{{"prompt", "p"}, {"stop", {"ok", 3}}}, "stop[1]", "stop[1] must be a string, got 3"},
      {{{"prompt", "p"}, {"stop", ""}}, "stop", "stop must not be an empty string"},
      {{{"prompt", "p"}, {"stop_token_ids", 3}}, "stop_token_ids", "stop_token_ids must be"},
      {{{"prompt", "p"}, {"logprobs", true}}, "logprobs", "logprobs must be an integer, got true"},
      {{{"prompt", "p"}, {"ignore_eos", 1}}, "ignore_eos", "ignore_eos must be a boolean, got 1"},
      {{{"prompt", "p"}, {"seed", 1.5}}, "seed", "seed must be an integer, got 1.5"},
      {{{"prompt", "p"}, {"stream_options", {{"include_usage", "y"}}}},
       "stream_options.include_usage",
       "stream_options.include_usage must be a boolean"},
      {{{"prompt", "p"}, {"temperature", {1}}},
       "temperature",
       "temperature must be a number, got an array"},
      {{{"prompt", "p"}, {"best_of", 3}}, "best_of", "best_of must equal n (1), got 3"},
      {{{"prompt", "p"}, {"n", 129}}, "n", "n must be an integer in [1, 128], got 129"},
      {{{"prompt", "p"}, {"n", "2"}}, "n", "n must be an integer, got \"2\""},
      {{{"prompt", {{1}, "a"}}}, "prompt[1]", "prompt[1] must be an array of token ids, as"},
      {{{"prompt", {{1}, {2, -1}}}}, "prompt[1][1]", "prompt[1][1] must be an integer in"},
      {{{"prompt", Json(std::vector<std::string>(129, "a"))}},
       "prompt",
       "prompt holds 129 prompts; a request takes at most 128"},
      {{{"prompt", {"a", "b"}}, {"n", 65}}, "n", "n = 65 choices for each of 2 prompts is 130"},
      {{{"prompt", "p"}, {"suffix", "x"}}, "suffix", "suffix is not supported"},
      {{{"prompt", "p"}, {"model", 3}}, "model", "model must be a string"},
  };
  for (const Case& c : cases) {
    absl::Status status = ParseCompletionRequest(c.body, "").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(ErrorParam(status), c.param) << c.body;
    EXPECT_TRUE(absl::StartsWith(status.message(), c.message)) << c.body << ": " << status;
  }
}

TEST(ParseCompletion, BatchesOfPromptsShareTheSamplingParams) {
  absl::StatusOr<CompletionParams> texts = ParseCompletionRequest(
      Json{{"prompt", {"a", "bc"}}, {"n", 2}, {"best_of", 2}, {"temperature", 0.5}}, "");
  ASSERT_TRUE(texts.ok()) << texts.status();
  ASSERT_EQ(texts->prompts.size(), 2u);
  EXPECT_EQ(texts->n, 2);
  EXPECT_EQ(texts->prompts[0].text(), "a");
  EXPECT_EQ(texts->prompts[1].text(), "bc");
  for (const v1::GenerateRequest& p : texts->prompts) {
    EXPECT_FLOAT_EQ(p.sampling_params().temperature(), 0.5f);
    EXPECT_EQ(p.sampling_params().max_tokens(), 16);
  }
  absl::StatusOr<CompletionParams> ids =
      ParseCompletionRequest(Json{{"prompt", {{1, 2}, {3}}}}, "");
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_EQ(ids->prompts.size(), 2u);
  EXPECT_EQ(ids->prompts[0].input_ids().ids_size(), 2);
  EXPECT_EQ(ids->prompts[1].input_ids().ids(0), 3);
  // 128 choices in all is the limit, however they are made.
  EXPECT_TRUE(ParseCompletionRequest(Json{{"prompt", {"a", "b"}}, {"n", 64}}, "").ok());
  absl::StatusOr<ChatParams> chat =
      ParseChatRequest(Json{{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"n", 128}}, "");
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->n, 128);
}

TEST(ExpandChoices, SeedsAndIdsPerChoice) {
  std::vector<v1::GenerateRequest> prompts(2);
  prompts[0].set_text("a");
  prompts[1].set_text("b");
  for (v1::GenerateRequest& p : prompts) p.mutable_sampling_params()->set_seed(~uint64_t{0});
  const std::vector<v1::GenerateRequest> choices = ExpandChoices(prompts, 3, "r");
  ASSERT_EQ(choices.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(choices[i].text(), i < 3 ? "a" : "b");
    EXPECT_EQ(choices[i].request_id(), "r-" + std::to_string(i));
    // seed + k, wrapping: the largest seed, then 0 and 1.
    EXPECT_EQ(choices[i].sampling_params().seed(), ~uint64_t{0} + static_cast<uint64_t>(i % 3));
  }
  prompts.resize(1);
  prompts[0].mutable_sampling_params()->clear_seed();
  const std::vector<v1::GenerateRequest> unseeded = ExpandChoices(prompts, 2, "r");
  ASSERT_EQ(unseeded.size(), 2u);
  for (const v1::GenerateRequest& c : unseeded) EXPECT_FALSE(c.sampling_params().has_seed());
  // One choice keeps the id as given (empty: the service names it).
  const std::vector<v1::GenerateRequest> one = ExpandChoices(prompts, 1, "");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].request_id(), "");
}

TEST(ParseChat, MessagesAndLogprobs) {
  absl::StatusOr<ChatParams> params = ParseChatRequest(
      Json{{"messages",
            {{{"role", "system"}, {"content", "s"}},
             {{"role", "assistant"}, {"content", nullptr}},
             {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "u"}}}}}}},
           {"max_tokens", 5},
           {"max_completion_tokens", 7},
           {"logprobs", true},
           {"top_logprobs", 3},
           {"tools", Json::array()},
           {"response_format", {{"type", "text"}}}},
      "");
  ASSERT_TRUE(params.ok()) << params.status();
  ASSERT_EQ(params->messages.size(), 3u);
  EXPECT_EQ(params->messages[1].content, "");
  EXPECT_EQ(params->messages[2].content, "u");
  EXPECT_EQ(params->sampling.max_tokens(), 7);
  EXPECT_EQ(params->sampling.logprobs(), 3);
  EXPECT_TRUE(params->logprobs);

  absl::StatusOr<ChatParams> plain =
      ParseChatRequest(Json{{"messages", {{{"role", "user"}, {"content", "x"}}}}}, "");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->sampling.has_max_tokens());
  EXPECT_FALSE(plain->sampling.has_logprobs());
}

TEST(ParseChat, FieldErrors) {
  const Json user = {{"role", "user"}, {"content", "x"}};
  struct Case {
    Json body;
    std::string param;
    std::string message;
  };
  const std::vector<Case> cases = {
      {Json::object(), "messages", "messages is required"},
      {{{"messages", Json::array()}}, "messages", "messages must not be empty"},
      {{{"messages", {{{"content", "x"}}}}}, "messages[0].role", "messages[0].role is required"},
      {{{"messages", {user, {{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}},
       "messages[1].content[0].type",
       "messages[1].content[0].type \"image_url\" is not supported"},
      {{{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}}}}}}}},
       "messages[0].content[0].text",
       "messages[0].content[0].text is required"},
      {{{"messages", {user}}, {"top_logprobs", 2}}, "top_logprobs", "top_logprobs requires"},
      {{{"messages", {user}}, {"logprobs", 2}}, "logprobs", "logprobs must be a boolean"},
      {{{"messages", {user}}, {"tools", {{{"type", "function"}}}}},
       "tools[0].function",
       "tools[0].function is required"},
      {{{"messages", {user}}, {"tools", {{{"type", "code"}}}}},
       "tools[0].type",
       "tools[0].type must be \"function\", got \"code\""},
      {{{"messages", {user}}, {"tools", "f"}}, "tools", "tools must be an array of tools"},
      {{{"messages", {user}}, {"tools", {{{"type", "function"}, {"function", {{"name", ""}}}}}}},
       "tools[0].function.name",
       "tools[0].function.name must be a non-empty string, got \"\""},
      {{{"messages", {user}}, {"tool_choice", "required"}},
       "tool_choice",
       "tool_choice \"required\" needs tools"},
      {{{"messages", {user}}, {"tool_choice", {{"type", "function"}}}},
       "tool_choice.function.name",
       "tool_choice names a function as {\"type\": \"function\""},
      {{{"messages", {user}}, {"parallel_tool_calls", "no"}},
       "parallel_tool_calls",
       "parallel_tool_calls must be a boolean"},
      {{{"messages", {user, {{"role", "assistant"}, {"tool_calls", {{{"type", "function"}}}}}}}},
       "messages[1].tool_calls[0].function",
       "messages[1].tool_calls[0].function is required"},
      {{{"messages",
         {user,
          {{"role", "assistant"},
           {"tool_calls", {{{"function", {{"name", "f"}, {"arguments", 3}}}}}}}}}},
       "messages[1].tool_calls[0].function.arguments",
       "messages[1].tool_calls[0].function.arguments must be a JSON string or an object"},
      {{{"messages", {user, {{"role", "tool"}, {"content", "x"}, {"tool_call_id", 5}}}}},
       "messages[1].tool_call_id",
       "messages[1].tool_call_id must be a string, got 5"},
      {{{"messages", {user, {{"role", "assistant"}, {"reasoning_content", 1}}}}},
       "messages[1].reasoning_content",
       "messages[1].reasoning_content must be a string, got 1"},
      {{{"messages", {user}}, {"tool_choice", "sometimes"}},
       "tool_choice",
       "tool_choice must be \"auto\", \"none\", \"required\" or a named function, got "
       "\"sometimes\""},
      {{{"messages", {user}}, {"response_format", {{"type", "json_schema"}}}},
       "response_format.json_schema.schema",
       "response_format of type json_schema needs json_schema.schema"},
      {{{"messages", {user}}, {"response_format", {{"type", "yaml"}}}},
       "response_format.type",
       "response_format.type \"yaml\" is not supported"},
      {{{"messages", {user}},
        {"response_format",
         {{"type", "json_schema"},
          {"json_schema",
           {{"name", "s"}, {"schema", {{"type", "string"}, {"pattern", "(a)\\1"}}}}}}}},
       "response_format.json_schema.schema",
       "response_format.json_schema.schema: schema.pattern: backreferences are not supported "
       "(at offset 3)"},
      {{{"messages", {user}}, {"guided_regex", "(?=a)"}},
       "guided_regex",
       "guided_regex: lookaround assertions are not supported (at offset 0)"},
      {{{"messages", {user}}, {"guided_regex", 7}},
       "guided_regex",
       "guided_regex must be a string (a regular expression)"},
      {{{"messages", {user}}, {"guided_regex", "a*"}, {"guided_choice", {"a"}}},
       "guided_regex",
       "give one form for the output, not both guided_choice and guided_regex"},
      {{{"messages", {user}}, {"guided_regex", "a{0}"}},
       "guided_regex",
       "guided_regex: it matches only the empty text"},
      {{{"messages", {user}}, {"guided_choice", {"a", 1}}},
       "guided_choice",
       "guided_choice[1] must be a string"},
      {{{"messages", {user}}, {"guided_choice", {"a"}}, {"guided_json", {{"type", "object"}}}},
       "guided_choice",
       "give one form for the output, not both guided_json and guided_choice"},
      {{{"messages", {user}}, {"structured_outputs", {{"grammar", "root ::= x"}}}},
       "structured_outputs.grammar",
       "structured_outputs.grammar is not supported"},
  };
  for (const Case& c : cases) {
    absl::Status status = ParseChatRequest(c.body, "").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(ErrorParam(status), c.param) << c.body;
    EXPECT_TRUE(absl::StartsWith(status.message(), c.message)) << c.body << ": " << status;
  }
}

TEST(ParseChat, StructuredOutputForms) {
  const Json user = {{"role", "user"}, {"content", "hi"}};
  absl::StatusOr<ChatParams> object =
      ParseChatRequest({{"messages", {user}}, {"response_format", {{"type", "json_object"}}}}, "");
  ASSERT_TRUE(object.ok()) << object.status();
  EXPECT_TRUE(object->sampling.structured_output().json_object());
  absl::StatusOr<ChatParams> schema = ParseChatRequest(
      {{"messages", {user}},
       {"response_format",
        {{"type", "json_schema"},
         {"json_schema", {{"name", "p"}, {"schema", {{"type", "object"}}}, {"strict", true}}}}}},
      "");
  ASSERT_TRUE(schema.ok()) << schema.status();
  EXPECT_EQ(schema->sampling.structured_output().json_schema(), R"({"type":"object"})");
  absl::StatusOr<ChatParams> text =
      ParseChatRequest({{"messages", {user}}, {"response_format", {{"type", "text"}}}}, "");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_FALSE(text->sampling.has_structured_output());
  absl::StatusOr<ChatParams> choice =
      ParseChatRequest({{"messages", {user}}, {"guided_choice", {"yes", "no"}}}, "");
  ASSERT_TRUE(choice.ok()) << choice.status();
  ASSERT_EQ(choice->sampling.structured_output().choice().choices_size(), 2);
  EXPECT_EQ(choice->sampling.structured_output().choice().choices(1), "no");
  // vLLM takes guided_json as the schema's text too, and the newer structured_outputs object.
  absl::StatusOr<CompletionParams> completion = ParseCompletionRequest(
      {{"prompt", "x"}, {"structured_outputs", {{"json", R"({"type": "integer"})"}}}}, "");
  ASSERT_TRUE(completion.ok()) << completion.status();
  EXPECT_EQ(completion->prompts[0].sampling_params().structured_output().json_schema(),
            R"({"type": "integer"})");
  // Regular expressions: vLLM's guided_regex and structured_outputs.regex.
  absl::StatusOr<CompletionParams> regex =
      ParseCompletionRequest({{"prompt", "x"}, {"guided_regex", "[a-z]+@[a-z]+\\.com"}}, "");
  ASSERT_TRUE(regex.ok()) << regex.status();
  EXPECT_EQ(regex->prompts[0].sampling_params().structured_output().regex(), "[a-z]+@[a-z]+\\.com");
  absl::StatusOr<CompletionParams> newer = ParseCompletionRequest(
      {{"prompt", "x"}, {"structured_outputs", {{"regex", "(yes|no)"}}}}, "");
  ASSERT_TRUE(newer.ok()) << newer.status();
  EXPECT_EQ(newer->prompts[0].sampling_params().structured_output().regex(), "(yes|no)");
  // Neutral values ask for nothing.
  absl::StatusOr<CompletionParams> neutral = ParseCompletionRequest(
      {{"prompt", "x"}, {"guided_json", nullptr}, {"guided_choice", Json::array()}}, "");
  ASSERT_TRUE(neutral.ok()) << neutral.status();
  EXPECT_FALSE(neutral->prompts[0].sampling_params().has_structured_output());
}

TEST(ParseChat, OrderedSchemaTextKeepsTheClientsKeyOrder) {
  const std::string body =
      R"({"messages": [], "response_format": {"type": "json_schema", "json_schema": {"schema":)"
      R"( {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {}}}}}})";
  absl::StatusOr<std::string> text = OrderedSchemaText(body);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":{}}})");
  absl::StatusOr<std::string> none = OrderedSchemaText(R"({"prompt": "x"})");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, "");
}

TEST(ParseChat, ToolsAndToolTurns) {
  const Json body = {
      {"messages",
       {{{"role", "user"}, {"content", "weather?"}},
        {{"role", "assistant"},
         {"content", nullptr},
         {"reasoning_content", "need a tool"},
         {"tool_calls",
          {{{"id", "call_1"},
            {"type", "function"},
            {"function", {{"name", "get"}, {"arguments", "{\"city\": \"Paris\"}"}}}},
           {{"function", {{"name", "now"}, {"arguments", {{"tz", "UTC"}, {"a", 1}}}}}}}}},
        {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "21"}}}},
      {"tools", {{{"type", "function"}, {"function", {{"name", "get"}}}}}},
      {"parallel_tool_calls", false}};
  absl::StatusOr<ChatParams> params = ParseChatRequest(body, "");
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_TRUE(params->use_tools);
  EXPECT_FALSE(params->parallel_tool_calls);
  ASSERT_EQ(params->messages.size(), 3u);
  const tokenizer::ChatMessage& assistant = params->messages[1];
  EXPECT_EQ(assistant.content, "");
  EXPECT_EQ(assistant.reasoning_content, "need a tool");
  ASSERT_EQ(assistant.tool_calls.size(), 2u);
  EXPECT_EQ(assistant.tool_calls[0].name, "get");
  EXPECT_EQ(assistant.tool_calls[0].arguments, "{\"city\": \"Paris\"}");  // as sent
  // An object is written as Python's json.dumps would (keys sorted by the parser here).
  EXPECT_EQ(assistant.tool_calls[1].arguments, "{\"a\": 1, \"tz\": \"UTC\"}");
  EXPECT_EQ(params->messages[2].role, "tool");
  EXPECT_EQ(params->messages[2].content, "21");

  Json none = body;
  none["tool_choice"] = "none";
  EXPECT_FALSE(ParseChatRequest(none, "")->use_tools);
  EXPECT_FALSE(ParseChatRequest(none, "")->forced_tool.has_value());
  Json required = body;
  required["tool_choice"] = "required";
  absl::StatusOr<ChatParams> forced = ParseChatRequest(required, "");
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_TRUE(forced->use_tools);
  EXPECT_EQ(forced->forced_tool, std::optional<std::string>(""));
  Json empty = body;
  empty["tools"] = Json::array();
  EXPECT_FALSE(ParseChatRequest(empty, "")->use_tools);
}

// The tools as the template's `tojson` writes them: the client's key order, Python's separators,
// non-ASCII kept, strings escaped as json.dumps escapes them.
TEST(ToolDefinitions, PythonJsonInTheClientsOrder) {
  const std::string body =
      R"({"messages": [], "tools": [{"type": "function", "function": {"name": "f", )"
      R"("parameters": {"type": "object", "properties": {"q": {"type": "string", )"
      R"("description": "caf\u00e9 \"x\"\n"}}, "required": ["q"]}}}, {"function": {"name": "g"}, )"
      R"("type": "function"}]})";
  absl::StatusOr<std::vector<std::string>> tools = ToolDefinitions(body);
  ASSERT_TRUE(tools.ok()) << tools.status();
  ASSERT_EQ(tools->size(), 2u);
  EXPECT_EQ((*tools)[0],
            "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": "
            "{\"type\": \"object\", \"properties\": {\"q\": {\"type\": \"string\", "
            "\"description\": \"caf\xc3\xa9 \\\"x\\\"\\n\"}}, \"required\": [\"q\"]}}}");
  EXPECT_EQ((*tools)[1], "{\"function\": {\"name\": \"g\"}, \"type\": \"function\"}");
}

TEST(ParseJsonBody, MalformedAndDeep) {
  absl::Status status = ParseJsonBody("{\"a\": tru}").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "invalid JSON at byte")) << status;
  EXPECT_FALSE(ParseJsonBody("").ok());
  EXPECT_FALSE(ParseJsonBody(std::string(100000, '[')).ok());
  EXPECT_TRUE(ParseJsonBody("{\"a\": [1, 2]}").ok());
}

TEST(Errors, RetryAfterHints) {
  EXPECT_EQ(RetryAfterSeconds("queue full"), 1);
  EXPECT_EQ(RetryAfterSeconds("queue full; retry after 3s"), 3);
  EXPECT_EQ(RetryAfterSeconds("Retry in 2.5 seconds"), 3);
  EXPECT_EQ(RetryAfterSeconds("retry_after=1500ms"), 2);
  EXPECT_EQ(RetryAfterSeconds("retry after 10 ms"), 1);
  EXPECT_EQ(RetryAfterSeconds("retry after 2 minutes"), 120);
  EXPECT_EQ(RetryAfterSeconds("retry later"), 1);
}

TEST(Errors, ObjectShape) {
  nlohmann::ordered_json e = ErrorJson(FieldError("top_p", "top_p must be a number"));
  EXPECT_EQ(e["error"]["message"], "top_p must be a number");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "top_p");
  EXPECT_TRUE(e["error"]["code"].is_null());
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kCancelled), 499);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnknown), 500);
}

// A whole response of one choice.
std::string BodyOf(CompletionFormatter& f) {
  return CompletionFormatter::Body(std::span<CompletionFormatter>(&f, 1), f.usage());
}

v1::GenerateResponse LogprobChunk() {
  v1::GenerateResponse r;
  v1::TextChunk* chunk = r.mutable_chunk();
  chunk->set_text("hé");
  chunk->add_token_ids(11);
  chunk->add_token_ids(12);
  for (int k = 0; k < 2; ++k) {
    v1::OutputLogprobs* lp = chunk->add_logprobs();
    lp->set_logprob(-0.5f * (k + 1));
    v1::TokenLogprob* top = lp->add_top();
    top->set_token_id(99);
    top->set_logprob(-0.25f);
  }
  return r;
}

TEST(Formatter, CompletionLogprobsAccumulate) {
  CompletionFormatter f({Endpoint::kCompletions, "cmpl-1", 5, "m", /*logprobs=*/true, false});
  f.Append(LogprobChunk());
  f.Append(LogprobChunk());
  v1::GenerateResponse done;
  done.mutable_complete()->set_finish_reason(v1::FINISH_REASON_ABORT);
  done.mutable_complete()->set_matched_string("###");
  f.Append(done);
  ASSERT_TRUE(f.complete());
  Json body = Json::parse(BodyOf(f));
  const Json& lp = body["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], Json({"token_id:11", "token_id:12", "token_id:11", "token_id:12"}));
  EXPECT_EQ(lp["token_logprobs"][1], -1.0);
  EXPECT_EQ(lp["top_logprobs"][0]["token_id:99"], -0.25);
  EXPECT_EQ(lp["top_logprobs"][0]["token_id:11"], -0.5);
  EXPECT_EQ(lp["text_offset"], Json({0, 0, 2, 2}));  // code points, per chunk (no bytes)
  EXPECT_EQ(body["choices"][0]["text"], "héhé");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(body["choices"][0]["stop_reason"], "###");
}

TEST(Formatter, ChatLogprobsStream) {
  CompletionFormatter f({Endpoint::kChat, "chatcmpl-1", 5, "m", /*logprobs=*/true, false});
  std::string event = f.StreamEvents(LogprobChunk());
  ASSERT_TRUE(absl::StartsWith(event, "data: "));
  Json chunk = Json::parse(event.substr(6));
  const Json& content = chunk["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "token_id:11");
  EXPECT_EQ(content[0]["logprob"], -0.5);
  EXPECT_EQ(content[0]["top_logprobs"][0]["token"], "token_id:99");
}

// With the tokens' bytes (a router with a tokenizer sends them) the logprobs show the tokens:
// their text when whole UTF-8, vLLM's "bytes:\xNN" spelling for part of a character, and chat's
// `bytes` as integers; return_tokens_as_token_ids keeps the "token_id:<id>" labels.
v1::GenerateResponse LogprobChunkWithBytes() {
  v1::GenerateResponse r = LogprobChunk();
  v1::TextChunk* chunk = r.mutable_chunk();
  chunk->mutable_logprobs(0)->set_token_bytes("h");
  chunk->mutable_logprobs(1)->set_token_bytes("\xc3");  // the first byte of "é"
  for (int k = 0; k < 2; ++k) chunk->mutable_logprobs(k)->mutable_top(0)->set_token_bytes(" a");
  return r;
}

TEST(Formatter, LogprobTokensAreTheirTextWhenTheBytesAreKnown) {
  CompletionFormatter completions({Endpoint::kCompletions, "cmpl-1", 5, "m", true, false});
  completions.Append(LogprobChunkWithBytes());
  v1::GenerateResponse done;
  done.mutable_complete()->set_finish_reason(v1::FINISH_REASON_STOP);
  completions.Append(done);
  const Json lp = Json::parse(BodyOf(completions))["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], Json({"h", "bytes:\\xc3"}));
  EXPECT_EQ(lp["text_offset"], Json({0, 1}));  // "h" is one code point
  EXPECT_EQ(lp["top_logprobs"][0][" a"], -0.25);
  EXPECT_EQ(lp["top_logprobs"][0]["h"], -0.5);

  CompletionFormatter chat({Endpoint::kChat, "chatcmpl-1", 5, "m", true, false});
  const std::string event = chat.StreamEvents(LogprobChunkWithBytes());
  const Json content = Json::parse(event.substr(6))["choices"][0]["logprobs"]["content"];
  EXPECT_EQ(content[0]["token"], "h");
  EXPECT_EQ(content[0]["bytes"], Json({104}));
  EXPECT_EQ(content[1]["bytes"], Json({0xc3}));
  EXPECT_EQ(content[0]["top_logprobs"][0]["token"], " a");
  EXPECT_EQ(content[0]["top_logprobs"][0]["bytes"], Json({32, 97}));

  ResponseContext as_ids{Endpoint::kCompletions, "cmpl-2", 5, "m", true, false};
  as_ids.tokens_as_ids = true;
  CompletionFormatter ids(as_ids);
  ids.Append(LogprobChunkWithBytes());
  ids.Append(done);
  EXPECT_EQ(Json::parse(BodyOf(ids))["choices"][0]["logprobs"]["tokens"],
            Json({"token_id:11", "token_id:12"}));
}

// The prompt "abé" (ids 5, 6, 7) as the router sends it with echo and prompt_logprobs = 2,
// ahead of LogprobChunkWithBytes' output "hé".
v1::GenerateResponse PromptAndOutputChunk() {
  v1::GenerateResponse r = LogprobChunkWithBytes();
  v1::PromptEcho* prompt = r.mutable_chunk()->mutable_prompt();
  prompt->set_text("abé");
  for (int id : {5, 6, 7}) prompt->add_token_ids(id);
  for (const char* b : {"a", "b", "é"}) prompt->add_token_bytes(b);
  auto score = [&](float logprob, int rank, const char* bytes,
                   std::vector<std::tuple<int, float, const char*>> top) {
    v1::OutputLogprobs* lp = prompt->add_logprobs();
    lp->set_logprob(logprob);
    lp->set_rank(rank);
    lp->set_token_bytes(bytes);
    for (const auto& [id, value, text] : top) {
      v1::TokenLogprob* t = lp->add_top();
      t->set_token_id(id);
      t->set_logprob(value);
      t->set_token_bytes(text);
    }
  };
  score(-1.5f, 3, "b", {{9, -0.125f, "x"}, {8, -1.25f, "y"}});
  score(-0.25f, 1, "é", {{7, -0.25f, "é"}, {9, -2.0f, "x"}});
  return r;
}

ResponseContext EchoContext(Endpoint endpoint) {
  ResponseContext context{endpoint, "cmpl-1", 5, "m", /*logprobs=*/true, false};
  context.echo = endpoint == Endpoint::kCompletions;
  context.top_logprobs = 1;
  context.prompt_logprobs = true;
  return context;
}

// vLLM's prompt_logprobs list for PromptAndOutputChunk's prompt.
Json ExpectedPromptLogprobs() {
  return Json::parse(R"([null,
    {"6": {"logprob": -1.5, "rank": 3, "decoded_token": "b"},
     "9": {"logprob": -0.125, "rank": 1, "decoded_token": "x"},
     "8": {"logprob": -1.25, "rank": 2, "decoded_token": "y"}},
    {"7": {"logprob": -0.25, "rank": 1, "decoded_token": "é"},
     "9": {"logprob": -2.0, "rank": 2, "decoded_token": "x"}}])");
}

// echo: the text and logprobs begin with the prompt, whose first token has null logprobs and
// whose entries keep `logprobs` (1) alternatives besides the token itself; offsets run on into
// the output. prompt_logprobs is vLLM's list, in the choice.
TEST(Formatter, CompletionEchoAndPromptLogprobs) {
  Json expected_logprobs = Json::parse(R"({
    "tokens": ["a", "b", "é", "h", "bytes:\\xc3"],
    "token_logprobs": [null, -1.5, -0.25, -0.5, -1.0],
    "top_logprobs": [null, {"x": -0.125, "b": -1.5}, {"é": -0.25}, {" a": -0.25, "h": -0.5},
                     {" a": -0.25, "bytes:\\xc3": -1.0}],
    "text_offset": [0, 1, 2, 3, 4]})");
  v1::GenerateResponse done;
  done.mutable_complete()->set_finish_reason(v1::FINISH_REASON_LENGTH);

  CompletionFormatter whole(EchoContext(Endpoint::kCompletions));
  whole.Append(PromptAndOutputChunk());
  whole.Append(done);
  const Json choice = Json::parse(BodyOf(whole))["choices"][0];
  EXPECT_EQ(choice["text"], "abéhé");
  EXPECT_EQ(choice["logprobs"], expected_logprobs);
  EXPECT_EQ(choice["prompt_logprobs"], ExpectedPromptLogprobs());

  CompletionFormatter streamed(EchoContext(Endpoint::kCompletions));
  const std::string event = streamed.StreamEvents(PromptAndOutputChunk());
  const Json first = Json::parse(event.substr(6))["choices"][0];
  EXPECT_EQ(first["text"], "abéhé");
  EXPECT_EQ(first["logprobs"], expected_logprobs);
  EXPECT_EQ(first["prompt_logprobs"], ExpectedPromptLogprobs());
  // Later chunks carry only their own output, offsets after the prompt and what came before.
  const Json second =
      Json::parse(streamed.StreamEvents(LogprobChunkWithBytes()).substr(6))["choices"][0];
  EXPECT_EQ(second["text"], "hé");
  EXPECT_EQ(second["logprobs"]["text_offset"], Json({5, 6}));
  EXPECT_FALSE(second.contains("prompt_logprobs"));

  // max_tokens 0: the prompt alone, in one event (and with echo off, an empty text).
  v1::GenerateResponse prompt_only;
  *prompt_only.mutable_chunk()->mutable_prompt() = PromptAndOutputChunk().chunk().prompt();
  ResponseContext scored = EchoContext(Endpoint::kCompletions);
  scored.echo = false;
  scored.logprobs = false;
  CompletionFormatter scores(scored);
  const Json only = Json::parse(scores.StreamEvents(prompt_only).substr(6))["choices"][0];
  EXPECT_EQ(only["text"], "");
  EXPECT_TRUE(only["logprobs"].is_null());
  EXPECT_EQ(only["prompt_logprobs"], ExpectedPromptLogprobs());
}

// Chat's prompt_logprobs belong to the response: top-level in the whole body, and in an event of
// their own ahead of the content when streamed.
TEST(Formatter, ChatPromptLogprobs) {
  v1::GenerateResponse done;
  done.mutable_complete()->set_finish_reason(v1::FINISH_REASON_STOP);
  CompletionFormatter whole(EchoContext(Endpoint::kChat));
  whole.Append(PromptAndOutputChunk());
  whole.Append(done);
  const Json body = Json::parse(BodyOf(whole));
  EXPECT_EQ(body["prompt_logprobs"], ExpectedPromptLogprobs());
  EXPECT_EQ(body["choices"][0]["message"]["content"], "hé");  // no echo in chat
  EXPECT_FALSE(body["choices"][0].contains("prompt_logprobs"));

  CompletionFormatter streamed(EchoContext(Endpoint::kChat));
  const std::vector<std::string> events =
      absl::StrSplit(streamed.StreamEvents(PromptAndOutputChunk()), "\n\n", absl::SkipEmpty());
  ASSERT_EQ(events.size(), 2u);
  const Json scores = Json::parse(events[0].substr(6));
  EXPECT_EQ(scores["prompt_logprobs"], ExpectedPromptLogprobs());
  EXPECT_EQ(scores["choices"][0]["delta"], Json::object());
  const Json content = Json::parse(events[1].substr(6));
  EXPECT_EQ(content["choices"][0]["delta"]["content"], "hé");
  EXPECT_FALSE(content.contains("prompt_logprobs"));
}

// return_token_ids (vLLM's): prompt_token_ids in the choice (completions) or the response (chat),
// token_ids per choice; echo then leaves the prompt's text out; streamed chunks carry their own
// ids, and a chunk whose text is held back still sends them.
TEST(Formatter, ReturnTokenIds) {
  v1::GenerateResponse done;
  done.mutable_complete()->set_finish_reason(v1::FINISH_REASON_STOP);
  ResponseContext completions = EchoContext(Endpoint::kCompletions);
  completions.return_token_ids = true;
  completions.prompt_logprobs = false;
  CompletionFormatter whole(completions);
  whole.Append(PromptAndOutputChunk());
  whole.Append(done);
  const Json choice = Json::parse(BodyOf(whole))["choices"][0];
  EXPECT_EQ(choice["text"], "hé");
  EXPECT_EQ(choice["prompt_token_ids"], Json({5, 6, 7}));
  EXPECT_EQ(choice["token_ids"], Json({11, 12}));
  EXPECT_EQ(choice["logprobs"]["tokens"].size(), 5u);  // the echoed prompt's entries stay

  CompletionFormatter streamed(completions);
  const Json first =
      Json::parse(streamed.StreamEvents(PromptAndOutputChunk()).substr(6))["choices"][0];
  EXPECT_EQ(first["text"], "hé");
  EXPECT_EQ(first["prompt_token_ids"], Json({5, 6, 7}));
  EXPECT_EQ(first["token_ids"], Json({11, 12}));
  v1::GenerateResponse held;  // ids whose text the router holds back (a partial stop string)
  held.mutable_chunk()->add_token_ids(13);
  const Json next = Json::parse(streamed.StreamEvents(held).substr(6))["choices"][0];
  EXPECT_EQ(next["text"], "");
  EXPECT_EQ(next["token_ids"], Json({13}));
  EXPECT_FALSE(next.contains("prompt_token_ids"));

  ResponseContext chat = EchoContext(Endpoint::kChat);
  chat.return_token_ids = true;
  chat.prompt_logprobs = false;
  chat.logprobs = false;
  CompletionFormatter chat_whole(chat);
  chat_whole.Append(PromptAndOutputChunk());
  chat_whole.Append(done);
  const Json body = Json::parse(BodyOf(chat_whole));
  EXPECT_EQ(body["prompt_token_ids"], Json({5, 6, 7}));
  EXPECT_FALSE(body.contains("prompt_logprobs"));
  EXPECT_EQ(body["choices"][0]["token_ids"], Json({11, 12}));

  CompletionFormatter chat_streamed(chat);
  const std::vector<std::string> events =
      absl::StrSplit(chat_streamed.StreamEvents(PromptAndOutputChunk()), "\n\n", absl::SkipEmpty());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(Json::parse(events[0].substr(6))["prompt_token_ids"], Json({5, 6, 7}));
  EXPECT_EQ(Json::parse(events[1].substr(6))["choices"][0]["token_ids"], Json({11, 12}));
  const Json held_chat = Json::parse(chat_streamed.StreamEvents(held).substr(6));
  EXPECT_EQ(held_chat["choices"][0]["token_ids"], Json({13}));
}

TEST(Formatter, EmptyChunksAreSkippedInStreams) {
  CompletionFormatter f({Endpoint::kCompletions, "cmpl-1", 5, "m", false, false});
  v1::GenerateResponse r;
  r.mutable_chunk()->add_token_ids(3);
  EXPECT_EQ(f.StreamEvents(r), "");
  EXPECT_EQ(f.StreamStart(), "");
}

}  // namespace
}  // namespace mobius::router::openai
