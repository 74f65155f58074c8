// Fuzzes structured output's compilers and matcher: a request's JSON schema, regex or choice
// list (client input, compiled on the worker) and then output bytes walked through the compiled
// grammar, as the sampler's token masks do. A spec may be refused (InvalidArgument naming why);
// neither compiling nor walking may crash, hang or exhaust memory.
//
// Input: one byte choosing the spec's kind, then the spec's text, a 0 byte, and the output text.
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "grammar/grammar_matcher.h"
#include "grammar/structured_output.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using mobius::grammar::GrammarMatcher;
using mobius::grammar::StructuredOutputSpec;

// The longest token of the Qwen3 vocabulary is 256 bytes; the mask cache keys states that far.
constexpr int kHorizon = 256;

// The Qwen3 template's tool-call tags (as std::string_view: GCC 12 warns falsely, -Wrestrict, on
// a std::string assigned from a short literal).
constexpr std::string_view kToolCallBegin = "<tool_call>\n";
constexpr std::string_view kToolCallEnd = "\n</tool_call>";
constexpr std::string_view kBlockSeparator = "\n";

void WalkOutput(const mobius::grammar::Grammar& grammar, std::string_view output) {
  GrammarMatcher matcher(grammar);
  GrammarMatcher probe(grammar);
  std::string key;
  for (const char c : output) {
    probe.CopyFrom(matcher);
    if (!probe.Feed(static_cast<uint8_t>(c))) {
      // The matcher must have said no byte could follow at a finished state.
      break;
    }
    matcher.CopyFrom(probe);
    FUZZ_CHECK(!matcher.Finished() || matcher.Accepting(), "a finished state that does not accept");
    key.clear();
    matcher.AppendStateKey(key, kHorizon);
    (void)matcher.InPlainStringBody(kHorizon);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mobius::fuzz::InputCursor input(data, size);
  const uint8_t mode = input.TakeByte();
  const std::string_view rest = input.Rest();
  const size_t split = rest.find('\0');
  const std::string_view spec_text = rest.substr(0, split);
  const std::string_view output =
      split == std::string_view::npos ? std::string_view() : rest.substr(split + 1);

  StructuredOutputSpec spec;
  switch (mode % 6) {
    case 0:
      spec.kind = StructuredOutputSpec::Kind::kJsonSchema;
      spec.json_schema = std::string(spec_text);
      break;
    case 1:
      spec.kind = StructuredOutputSpec::Kind::kRegex;
      spec.regex = std::string(spec_text);
      break;
    case 2:
      spec.kind = StructuredOutputSpec::Kind::kChoice;
      spec.choices = absl::StrSplit(absl::string_view(spec_text.data(), spec_text.size()), '\n');
      break;
    case 3:
      spec.kind = StructuredOutputSpec::Kind::kJsonObject;
      break;
    case 4:
      // Tool-call blocks: a schema between tags, any number of blocks.
      spec.kind = StructuredOutputSpec::Kind::kTaggedJson;
      spec.json_schema = std::string(spec_text);
      spec.begin = std::string(kToolCallBegin);
      spec.end = std::string(kToolCallEnd);
      spec.separator = std::string(kBlockSeparator);
      spec.max_blocks = (mode >> 3) % 2 == 0 ? 1 : -1;
      break;
    default:
      // A reasoning block first, then a schema.
      spec.kind = StructuredOutputSpec::Kind::kJsonSchema;
      spec.json_schema = std::string(spec_text);
      spec.reasoning_end = "</think>";
      break;
  }
  auto grammar = mobius::grammar::CompileStructuredOutput(spec);
  if (!grammar.ok()) {
    FUZZ_CHECK(grammar.status().code() == absl::StatusCode::kInvalidArgument,
               grammar.status().ToString());
    FUZZ_CHECK(!grammar.status().message().empty(), "refused without a message");
    return 0;
  }
  (void)spec.Key();
  WalkOutput(*grammar, output);
  if (spec.kind == StructuredOutputSpec::Kind::kChoice) {
    // Every listed choice is an output the grammar takes whole.
    for (const std::string& choice : spec.choices) {
      GrammarMatcher matcher(*grammar);
      FUZZ_CHECK(matcher.FeedBytes(choice) && matcher.Accepting(),
                 "choice \"" + choice + "\" is not accepted");
    }
  }
  return 0;
}
