// The request fields that constrain the output's form, as OpenAI and vLLM take them:
// response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
// ...}}), guided_json, guided_choice, guided_regex, and structured_outputs ({"json": ...},
// {"choice": [...]}, {"regex": ...}, {"json_object": true}). At most one of them; grammars are
// refused.
#ifndef MOBIUS_ROUTER_HTTP_STRUCTURED_OUTPUT_REQUEST_H_
#define MOBIUS_ROUTER_HTTP_STRUCTURED_OUTPUT_REQUEST_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "sampling.pb.h"

namespace mobius::router::openai {

// Reads those fields into `out` (left unset when the body has none) and compiles the schema or
// choices, so that a schema outside the supported subset is refused here with its location.
// Errors name the field (FieldError).
absl::Status ParseStructuredOutput(const nlohmann::json& body, v1::StructuredOutput* out);

// The JSON schema of a body that ParseStructuredOutput accepted, as text in the client's key
// order (declared properties are generated in that order; `body` as parsed for the request
// sorts them). Empty when the body asks for no schema.
absl::StatusOr<std::string> OrderedSchemaText(absl::string_view body);

// The form of a forced tool call (tool_choice "required", `function` empty, or a named
// `function`) for a chat body that ParseChatRequest accepted: one block of the Qwen3 template's
// call format, "<tool_call>\n" {"name": ..., "arguments": ...} "\n</tool_call>", the arguments
// held to the named function's `parameters` (with "required" and several tools, an anyOf of one
// call per tool, told apart by the name). A `parameters` schema outside the supported subset is
// refused, naming the tool; so are repeated tool names under "required". With `parallel`
// (parallel_tool_calls, the default), "required" takes one or more blocks, a line apart.
absl::StatusOr<v1::StructuredOutput> ForcedToolCallForm(absl::string_view body,
                                                        const std::string& function, bool parallel);

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_STRUCTURED_OUTPUT_REQUEST_H_
