// Fuzzes structured output's compilers and matcher: a request's JSON schema, regex or choice
// list (client input, compiled on the worker) and then output bytes walked through the compiled
// grammar, as the sampler's token masks do. A spec may be refused (InvalidArgument naming why);
// neither compiling nor walking may crash, hang or exhaust memory.
//
// Input: structured_output_input.h (any of its six kinds).
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "grammar/grammar_matcher.h"
#include "grammar/structured_output.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/structured_output_input.h"

namespace {

using mobius::grammar::GrammarMatcher;
using mobius::grammar::StructuredOutputSpec;

// The longest token of the Qwen3 vocabulary is 256 bytes; the mask cache keys states that far.
constexpr int kHorizon = 256;

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
  auto [spec, output] = mobius::fuzz::ReadStructuredOutputInput(input, /*kinds=*/6);
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
