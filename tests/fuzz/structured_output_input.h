// The structured-output spec and model output that structured_output_fuzz and token_mask_fuzz
// read from one input: a byte choosing the spec's kind, the spec's text, a 0 byte, the output.
#ifndef MOBIUS_TESTS_FUZZ_STRUCTURED_OUTPUT_INPUT_H_
#define MOBIUS_TESTS_FUZZ_STRUCTURED_OUTPUT_INPUT_H_

#include <string>
#include <string_view>

#include "absl/strings/str_split.h"
#include "grammar/structured_output.h"
#include "tests/fuzz/fuzz_check.h"

namespace mobius::fuzz {

struct StructuredOutputInput {
  grammar::StructuredOutputSpec spec;
  std::string_view output;
};

// The kinds, by the mode byte modulo `kinds`: 0 a JSON schema, 1 a regex, 2 choices (one a line),
// 3 any JSON object, 4 tool-call blocks of a schema (one, or any number when bit 3 of the mode is
// set), 5 a reasoning block and then a schema.
inline StructuredOutputInput ReadStructuredOutputInput(InputCursor& input, int kinds) {
  using Kind = grammar::StructuredOutputSpec::Kind;
  const uint8_t mode = input.TakeByte();
  const std::string_view text = input.TakeUntilNul();
  StructuredOutputInput result;
  result.output = input.Rest();
  grammar::StructuredOutputSpec& spec = result.spec;
  switch (mode % kinds) {
    case 0:
      spec.kind = Kind::kJsonSchema;
      spec.json_schema = std::string(text);
      break;
    case 1:
      spec.kind = Kind::kRegex;
      spec.regex = std::string(text);
      break;
    case 2:
      spec.kind = Kind::kChoice;
      spec.choices = absl::StrSplit(absl::string_view(text.data(), text.size()), '\n');
      break;
    case 3:
      spec.kind = Kind::kJsonObject;
      break;
    case 4:
      // The Qwen3 template's tags (string_views: GCC 12 warns falsely, -Wrestrict, on a
      // std::string assigned from a short literal).
      spec.kind = Kind::kTaggedJson;
      spec.json_schema = std::string(text);
      spec.begin = std::string(std::string_view("<tool_call>\n"));
      spec.end = std::string(std::string_view("\n</tool_call>"));
      spec.separator = std::string(std::string_view("\n"));
      spec.max_blocks = (mode >> 3) % 2 == 0 ? 1 : -1;
      break;
    default:
      spec.kind = Kind::kJsonSchema;
      spec.json_schema = std::string(text);
      spec.reasoning_end = std::string(std::string_view("</think>"));
      break;
  }
  return result;
}

}  // namespace mobius::fuzz

#endif  // MOBIUS_TESTS_FUZZ_STRUCTURED_OUTPUT_INPUT_H_
