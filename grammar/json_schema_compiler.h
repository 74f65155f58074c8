// Compiles what a request asks its output to be (OpenAI's response_format json_object /
// json_schema, vLLM's guided_json / guided_choice / guided_regex) into a Grammar.
//
// The JSON Schema subset: type (one or a list), properties / required / additionalProperties,
// items / minItems / maxItems, minLength / maxLength / pattern (grammar/regex.h), minimum /
// maximum / exclusiveMinimum / exclusiveMaximum, enum, const, anyOf / oneOf (alternatives of
// different JSON types, or objects told apart by their first property's const values), a
// one-element allOf, and local $ref ("#", "#/$defs/...", "#/definitions/..."), recursion
// included. Annotations (title, description, default, examples, format, discriminator, ...) are
// ignored. Validation keywords outside the subset (multipleOf, uniqueItems, ...) are refused by
// name rather than silently dropped. Objects with declared properties get exactly those, in the
// schema's order; extra keys are not generated (OpenAI's strict mode).
#ifndef MOBIUS_GRAMMAR_JSON_SCHEMA_COMPILER_H_
#define MOBIUS_GRAMMAR_JSON_SCHEMA_COMPILER_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "grammar/grammar.h"
#include "nlohmann/json.hpp"

namespace mobius::grammar {

// InvalidArgument naming the schema location (e.g. "schema.properties.age: ...") and the reason.
// The schema's members in their text's order (declared properties are generated in it).
absl::StatusOr<Grammar> CompileJsonSchema(const nlohmann::ordered_json& schema);
// The same from the schema's JSON text.
absl::StatusOr<Grammar> CompileJsonSchemaText(std::string_view text);

// Any JSON object (response_format {"type": "json_object"}).
Grammar JsonObjectGrammar();

// Exactly one of `choices`, as raw text (guided_choice). InvalidArgument when the list or a
// choice is empty.
absl::StatusOr<Grammar> ChoiceGrammar(const std::vector<std::string>& choices);

// Raw text that `pattern` (grammar/regex.h syntax) matches whole, at least one character
// (guided_regex). InvalidArgument naming what is unsupported, without a field name.
absl::StatusOr<Grammar> RegexGrammar(std::string_view pattern);

// Puts free text before `g`'s value, up to and including `end` and the whitespace after it: a
// reasoning model thinks first ("<think>...</think>\n\n") and the constraint holds after.
absl::Status AddReasoningBlock(Grammar& g, const std::string& end);

// `begin`, a value of the schema, then `end`, as raw text around the value (a tool call:
// "<tool_call>\n", the call's JSON, "\n</tool_call>"); with `max_blocks` other than 1, one to
// that many such blocks (-1: no limit) with `separator` between them (parallel tool calls).
// InvalidArgument when a text is empty or the schema does not compile.
absl::StatusOr<Grammar> TaggedJsonGrammar(const std::string& begin, std::string_view schema,
                                          const std::string& end, int32_t max_blocks = 1,
                                          const std::string& separator = "");

}  // namespace mobius::grammar

#endif  // MOBIUS_GRAMMAR_JSON_SCHEMA_COMPILER_H_
